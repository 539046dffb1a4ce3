#!/usr/bin/env bash
# Rehearses here, on the CPU and without network, the GPU call that runs the end-to-end check on the 0.12.1 fork
# (scripts/newcore/gpu_carry.py assembles .gpu-fork/ first): its GPU_CALL, the command for the device's `run`,
# with the CPU's substitutions (--cpu, --tiny, two workflows, folders under $REHEARSAL_DIR), run in a copy of the
# working tree as the device machine receives it (tracked and unignored files, and .gpu-fork), by a Python 3.12
# venv that holds only packages the GPU machine's image lists (its torch 2.11.0, transformers 5.17.0, numpy 2.5.2,
# ...; unversioned ones at their newest before the list's date), under `unshare -n`.
#
# Not covered here: everything CUDA (comfy-aimdo's init and dynamic VRAM, comfy_kitchen's kernels, torchao's fp8,
# inductor on the GPU, NVML, the emulated card), true-size models and the time budget, the image's own versions of
# the packages it lists unversioned, and the image's packages not installed here (jax's CUDA plugin, onnx, ...).
#
#   bash scripts/newcore/rehearse_gpu_call.sh          # the venv once (about 5 GB, 4 minutes), then the call
#   WORKFLOWS=ernie_image_turbo bash scripts/newcore/rehearse_gpu_call.sh
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
W=${REHEARSAL_DIR:-/tmp/rehearsal}
PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python}
WORKFLOWS=${WORKFLOWS:-ernie_image_turbo,ernie_image_cache_compile}
GPU_CMD=$(python3 "$REPO/scripts/newcore/gpu_carry.py" --print-call)  # the device command, as gpu_carry.py says it

[ -d "$REPO/.gpu-fork/wheels" ] || { echo "no .gpu-fork: run scripts/newcore/gpu_carry.py first"; exit 1; }
if [ ! -x "$W/venv/bin/python" ]; then
    mkdir -p "$W"
    "$PY312" -m venv "$W/venv"
    pip=("$W/venv/bin/python" -m pip install -q --disable-pip-version-check)
    "${pip[@]}" -U pip  # >= 26 for --uploaded-prior-to
    before=(--uploaded-prior-to 2026-11-17T00:00:00Z)  # the day the image's list was read
    # The image's versions where KINDS.md gives them; the others it lists, unversioned, at their newest before then.
    "${pip[@]}" "${before[@]}" torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0 transformers==5.17.0 huggingface_hub==1.33.0 \
        safetensors==0.8.0 tokenizers==0.23.2 numpy==2.5.2 accelerate==1.15.0 sentencepiece==0.2.2 tiktoken==0.14.0 \
        jaxtyping==0.3.11 torchdiffeq==0.2.5 jax==0.11.2 jaxlib==0.11.2 flax nvidia-ml-py einops pillow scipy psutil \
        pyyaml aiohttp aiofiles requests tqdm protobuf opencv-python-headless scikit-image scikit-learn wrapt \
        lazy-loader humanize joblib rich click attrs httpx anyio h11 packaging regex filelock fsspec networkx sympy \
        jinja2 zipp peft timm typing-extensions cloudpickle hf-xet imageio tifffile pandas matplotlib uvloop xxhash \
        simplejson werkzeug six annotated-doc
    # Newer releases of these two need packages the image lacks (pydantic, tzdata).
    "${pip[@]}" "${before[@]}" typer==0.28.0 python-dateutil==2.9.0.post0
    "$W/venv/bin/python" -m pip uninstall -q -y pydantic pydantic-core annotated-types typing-inspection tzdata \
        2>/dev/null || true
fi
rm -rf "$W/tree" "$W/site" "$W/e2e" "$W/out"
mkdir -p "$W/tree" "$W/out"
(cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 cp --parents -t "$W/tree")
cp -r "$REPO/.gpu-fork" "$W/tree/"
echo "tree as the device gets it: $(du -sm "$W/tree" | cut -f1) MB"
local_cmd=$(sed -e "s#/tmp/site#$W/site#g" -e 's#fork_check.py 2>#fork_check.py --cpu 2>#' \
    -e "s#--modes default,card16 --parallel 2 --base-steps 20 --work /tmp/e2e#--tiny --cpu --modes default --workflows $WORKFLOWS --work $W/e2e#" \
    <<< "$GPU_CMD")
echo "+ $local_cmd"
cd "$W/tree"
unshare -n env -u PYTHONPATH PATH="$W/venv/bin:$PATH" OUT="$W/out" bash -c "$local_cmd"
echo "files back: $(ls "$W/out" | tr '\n' ' ')"
