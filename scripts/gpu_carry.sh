#!/usr/bin/env bash
# Assembles .gpu/ (git-ignored, about 34 MB) for the GPU end-to-end check on a machine without a package index:
# ComfyUI 0.3.75's core without its tests, and wheels of what the H200 image lacks (Python 3.12). There, run:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/wheels/*.whl
#   PYTHONPATH=/tmp/site python3 checks/gpu/gpu_e2e.py [--tier full]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh > /dev/null
rm -rf .gpu && mkdir -p .gpu/wheels
cp -r .cache/comfyui .gpu/comfyui
rm -rf .gpu/comfyui/tests .gpu/comfyui/tests-unit
find .gpu/comfyui -name __pycache__ -prune -exec rm -rf {} +
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/wheels \
    diffusers==0.42.1 cache-dit==1.5.3 torchao==0.17.0 importlib_metadata==8.7.0 gguf==0.19.0 torchsde==0.2.6 trampoline==0.1.2 \
    2>&1 | { grep -v "is ignored: it is neither" || true; }
du -sh .gpu
