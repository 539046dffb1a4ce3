#!/usr/bin/env bash
# The test command: sets up the environment when needed, then runs ruff and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest tests "$@"
