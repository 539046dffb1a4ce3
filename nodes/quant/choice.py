"""``quantization: auto``: the DiT's storage chosen from the GPU and its memory (engine: no ComfyUI here).

The fastest choice that leaves the DiT whole on the card beside the rest of a prompt, else one ComfyUI can load in
part:

- FP8 matmul (sm89+: RTX 40/50, L40, H100/H200) with torchao installed, where the FP8 DiT fits beside what
  ``BESIDE_THE_DIT`` counts: ``fp8_per_row`` (torchao's FP8 matmul; the whole DiT stays on the card).
- Elsewhere, ``none`` with ``weight_dtype`` ``fp8_e4m3fn``: the blocks' weights stored in fp8 and cast to the
  compute dtype as each layer runs (core's own fp8 storage). It runs on every CUDA GPU, takes LoRAs as core does,
  and core's partial loading streams what does not fit. On RTX 30 (sm80/86) that is bf16 compute, eager (Triton
  cannot compile an fp8 cast below sm89: ``accel/compile.fp8_cast_problem``); on RTX 20 and
  older (no bf16) the DiT computes in fp32 (``dit/precision.py``: it never computes in fp16, whose range the
  bf16-trained weights exceed), so a step's activations take twice the memory.
  ``int8_weight_only`` would also run on RTX 30, but ComfyUI must then load the DiT whole and its eager matmul
  dequantizes each layer anyway: fp8 storage is the one that streams.
- Not an NVIDIA GPU: ``none`` and the loader's ``weight_dtype``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..model_files import read_header
from .capability import FP8_MIN_ARCH, Facts
from .saved import weight_files

AUTO = "auto"  # the loaders' ``quantization`` choice that this module resolves
GIB = 2**30
# What must fit on the card beside a resident DiT for a 1024² Turbo prompt: the text encoder with its decoder
# layers in fp8 (about 3.4 GiB), the VAE (0.15 GiB), its whole decode (1.64 GiB, ``dit/vae.DECODE_BYTES_1024_BF16``)
# and a sampling step's activations (about 1 GiB: the DiT's memory estimate at 1024²).
BESIDE_THE_DIT = int(6.2 * GIB)


@dataclass(frozen=True)
class Choice:
    quantization: str
    weight_dtype: str
    why: str


def fp8_bytes(source: Path) -> int:
    """About what the DiT at ``source`` holds quantized to FP8: one byte per weight (its block linears are most of
    them; its embeddings and final layers stay bf16, a few percent more), read off the file headers."""
    return sum(math.prod(info.shape) for file in weight_files(source) if file.suffix == ".safetensors"
               for info in read_header(file).values())


def choose(facts: Facts, capacity: int, dit_fp8_bytes: int, weight_dtype: str) -> Choice:
    """The ``quantization`` and ``weight_dtype`` that ``auto`` means on this GPU (``facts``), whose ComfyUI can
    hold ``capacity`` bytes of models, for a DiT of ``dit_fp8_bytes`` in FP8; ``weight_dtype`` is the loader's."""
    if facts.arch is None:
        return Choice("none", weight_dtype, f"not an NVIDIA GPU ({facts.device}): the DiT as weight_dtype asks")
    where = f"{facts.gpu or facts.device} (sm{facts.arch[0]}{facts.arch[1]}, {capacity / GIB:.1f} GiB for models)"
    needed = dit_fp8_bytes + BESIDE_THE_DIT
    if facts.arch < FP8_MIN_ARCH:
        return _fp8_storage(f"{where} has no FP8 matmul: fp8 storage, cast to the compute dtype per layer, eager "
                            "(ComfyUI streams what does not fit)")
    if needed > capacity:
        return _fp8_storage(f"the FP8 DiT and what a prompt needs beside it ({needed / GIB:.1f} GiB) do not fit "
                            f"{where}: fp8 storage, which ComfyUI streams in part")
    if not facts.torchao:
        return _fp8_storage(f"torchao is not installed: fp8 storage on {where} (`pip install torchao` for FP8 "
                            "matmul, faster)")
    return Choice("fp8_per_row", "default", f"the FP8 DiT and what a prompt needs beside it ({needed / GIB:.1f} GiB) "
                  f"fit {where}: torchao FP8 matmul, the whole DiT resident")


def _fp8_storage(why: str) -> Choice:
    return Choice("none", "fp8_e4m3fn", why)
