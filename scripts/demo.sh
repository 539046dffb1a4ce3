#!/usr/bin/env bash
# The main job: set up when needed, then run the Turbo example workflow through a headless ComfyUI.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m scripts.run_workflow "$@"
