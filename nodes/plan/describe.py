"""Load records from file headers (engine: no ComfyUI; headers only, never a weight).

Each model's bytes in each of its forms are counted from its tensors' shapes: what the loaders hold (``dit/``,
``text/``, ``pe/``) is the file's tensors in the compute dtype (bf16), or, in fp8 forms, its repeated blocks' 2-D
linear weights in one byte each with a 4-byte scale per row, or, for GGUF, the blocks as stored with every other
tensor decoded into the compute dtype. A block is one of the ``layers.N.`` groups: the unit that streams.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from ..gguf.dequant import BLOCKS
from .costs import IMAGE_PNG
from .records import CPU, DIT, PARTIAL, PER_PROMPT, RESIDENT, SET, STREAMED, VAE, Form, LoadRecord, LoraSet

COMPUTE_BYTES = 2  # bf16: what the pack computes the models in on the GPUs it plans for
ROW_SCALE = 4  # one fp32 scale per output row of an fp8 weight
# A compiled DiT step against the eager forward the probe times, per kind of form: the warm Turbo sampler (8 steps,
# 1024², compiled blocks) against 8 × the probe's eager forward on the H200 (bench/RESULTS.md, 2026-12-05): GGUF
# Q4_K 1.2 s / (8 × 0.301 s), FP8 matmul 0.7 s / (8 × 0.156 s), bf16 1.0 s / (8 × 0.143 s): compiling fuses a GGUF
# layer's decode and FP8's activation scaling, and gains bf16's matrix products little. fp8 storage cast per layer
# is not measured: its eager time (never optimistic).
COMPILED = {"gguf": 0.50, "fp8_matmul": 0.56, "bf16": 0.87}
# The PE's static-cache decode in CUDA graphs (what ``auto`` takes on CUDA) against the probe's eager token, per form:
# 64 new tokens after a 438-token prompt at 166.7 tokens/s in bf16 and 43.2 in fp8 under cudaMallocAsync on an H100,
# against that machine's probe (bench/bench_pe.py --probe, bench/RESULTS.md 2026-12-05 session 34). The graph saves
# the launches, not fp8's per-layer casts. Measured when fp8 scaled the weight (two passes over it); it scales the
# product now, in the probe too (probe version 5), and the factor was not measured again. A GGUF PE's was not
# measured: its eager time (never optimistic).
GRAPHED_PE = {"bf16": 0.516, "fp8": 0.781}
_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")  # transformers' and diffusers' names, llama.cpp's


@dataclass(frozen=True)
class Tensor:
    """One tensor as a header declares it: ``name``, ``shape``, and ``stored`` bytes where it stays as stored (a
    GGUF block type, an fp8 weight); None where it is held in the compute dtype. ``kind``: its GGUF type."""

    name: str
    shape: tuple[int, ...]
    stored: int | None = None
    kind: str | None = None

    @property
    def numel(self) -> int:
        count = 1
        for side in self.shape:
            count *= side
        return count

    @property
    def computed(self) -> int:
        return self.stored if self.stored is not None else self.numel * COMPUTE_BYTES

    @property
    def fp8(self) -> int:
        """Its bytes in an fp8 form: a block's 2-D weight in one byte per value and a scale per row."""
        if self.stored is None and len(self.shape) == 2 and _LAYER.search(self.name) and self.name.endswith("weight"):
            return self.numel + self.shape[0] * ROW_SCALE
        return self.computed


@dataclass(frozen=True)
class Sizes:
    """A model's bytes as held (``total``) and in fp8 forms (``total_fp8``), its largest block in each, and the
    bytes of tensors outside the blocks (the embedding table, which stays on the host when the model streams)."""

    total: int
    total_fp8: int
    block: int
    block_fp8: int
    outside: int
    blocks: int


def sizes(tensors: Iterable[Tensor]) -> Sizes:
    per_block: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    total = total_fp8 = outside = 0
    for tensor in tensors:
        total, total_fp8 = total + tensor.computed, total_fp8 + tensor.fp8
        layer = _LAYER.search(tensor.name)
        if layer is None:
            outside += tensor.computed
            continue
        per_block[int(layer.group(1))][0] += tensor.computed
        per_block[int(layer.group(1))][1] += tensor.fp8
    block = max((b[0] for b in per_block.values()), default=0)
    block_fp8 = max((b[1] for b in per_block.values()), default=0)
    return Sizes(total, total_fp8, block, block_fp8, outside, len(per_block))


def safetensors_tensor(name: str, shape: tuple[int, ...], dtype: str) -> Tensor:
    """A safetensors header entry: fp8 and integer tensors stay as stored (one byte each); floats are computed in
    bf16."""
    one_byte = dtype.startswith("F8") or dtype in ("U8", "I8")
    numel = 1
    for side in shape:
        numel *= side
    return Tensor(name, shape, numel if one_byte else None)


def gguf_tensor(name: str, shape: tuple[int, ...], kind: str, nbytes: int) -> Tensor:
    """A GGUF header entry: block types stay as stored in linear layers; plain types are decoded to bf16."""
    return Tensor(name, shape, nbytes if kind in BLOCKS else None, kind)


def dominant_gguf_type(tensors: Iterable[Tensor]) -> str:
    """The block type holding most of a file's bytes (``Q4_K`` for a Q4_K_M file that keeps some in ``Q6_K``)."""
    blocks: dict[str, int] = defaultdict(int)
    for tensor in tensors:
        if tensor.kind in BLOCKS and tensor.stored is not None:
            blocks[tensor.kind] += tensor.stored
    return max(blocks, key=blocks.get) if blocks else "F16"


def dit_record(source: str, tensors: list[Tensor], *, gguf_type: str | None, fp8_matmul: bool, runs: int,
               working: int, fixed: str | None = None, fixed_by: str = SET, compute_scale: float = 1.0,
               compiles: bool = False) -> LoadRecord:
    """The DiT: as stored (bf16, or a GGUF file's types), fp8 storage cast per layer, and, where the GPU has FP8
    matmul and torchao, ``fp8_per_row`` (loaded whole). ``fixed``: the loader's explicit ``quantization/weight_dtype``
    setting, or the one its loader made already (``fixed_by``), None: ``auto``. Settings are
    ``quantization/weight_dtype`` pairs as the loader takes them. ``compiles``: the loader compiles the blocks on this
    GPU (``COMPILED``)."""
    s = sizes(tensors)

    def speedup(kind: str) -> float:
        return COMPILED.get(kind, 1.0) if compiles else 1.0

    if gguf_type is not None:
        forms = (Form(f"GGUF {gguf_type}", "none/default", f"dit:gguf:{gguf_type}", s.total, s.block,
                      speedup("gguf"), gguf_type=gguf_type),)
    else:
        forms = (Form("bf16", "none/default", "dit:bf16", s.total, s.block, speedup("bf16")),
                 Form("fp8", "none/fp8_e4m3fn", "dit:fp8_cast", s.total_fp8, s.block_fp8, speedup("fp8_cast")))
        if fp8_matmul:
            forms += (Form("FP8 (torchao)", "fp8_per_row/default", "dit:fp8_matmul", s.total_fp8, 0,
                           speedup("fp8_matmul"), keeps_host_copy=True),)
    if fixed is not None and all(f.setting != fixed for f in forms):  # a method the plan has no costs of
        quantization = fixed.split("/")[0]
        forms += (Form(quantization, fixed, f"dit:{quantization}", s.total_fp8 if quantization != "none" else s.total,
                       s.block if quantization == "none" else 0),)
    return LoadRecord(DIT, source, forms, (RESIDENT, PARTIAL, PER_PROMPT), working, runs, fixed_form=fixed,
                      fixed_by=fixed_by if fixed is not None else "", first_read_bytes=s.total,
                      compute_scale=compute_scale)


def language_model_record(role: str, source: str, tensors: list[Tensor], *, runs: int, working: int,
                          fixed_form: str | None = None, places: tuple[str, ...] | None = None,
                          streams: bool = True, graphed: frozenset[str] = frozenset()) -> LoadRecord:
    """The text encoder or the PE (Ministral 3): bf16 (``default``) or its decoder linears in fp8 (``fp8_e4m3fn``),
    or a GGUF file as it is; resident, loaded per prompt, on the CPU, and (the text encoder, one pass per prompt)
    streamed layer by layer, its embedding table staying on the host. ``graphed``: the forms whose PE decode runs
    in CUDA graphs on this GPU (``GRAPHED_PE``)."""
    s = sizes(tensors)
    streamed = (s.block, s.block_fp8) if streams else (0, 0)
    gguf = dominant_gguf_type(tensors) if any(t.kind is not None for t in tensors) else None

    def speedup(name: str) -> float:
        return GRAPHED_PE.get(name, 1.0) if _kind(role) == "pe" and name in graphed else 1.0

    if gguf is not None:
        forms = (Form(f"GGUF {gguf}", "default", f"{_kind(role)}:gguf:{gguf}", s.total, streamed[0],
                      keeps_host_copy=True, gguf_type=gguf),)
    else:
        forms = (Form("bf16", "default", f"{_kind(role)}:bf16", s.total, streamed[0], speedup("bf16"),
                      keeps_host_copy=True),
                 Form("fp8", "fp8_e4m3fn", f"{_kind(role)}:fp8", s.total_fp8, streamed[1], speedup("fp8"),
                      keeps_host_copy=True))
    possible = (RESIDENT, STREAMED, PER_PROMPT, CPU) if streams else (RESIDENT, PER_PROMPT, CPU)
    if all(f.setting != fixed_form for f in forms):
        fixed_form = None  # a setting this file has no form of (fp8 of a GGUF file): its loader refuses it in words
    return LoadRecord(role, source, forms, tuple(p for p in possible if places is None or p in places), working, runs,
                      fixed_form=fixed_form, fixed_by=SET if fixed_form is not None else "",
                      places_set=places is not None, first_read_bytes=s.total)


def _kind(role: str) -> str:
    return "pe" if role != "text encoder" else "text"


def vae_record(source: str, tensors: list[Tensor], working: int, compute_scale: float = 1.0) -> LoadRecord:
    """The VAE: its decode on the GPU (``compute_scale``: the images' pixels / 1024², as the DiT's), then its image
    saved as a PNG on the CPU."""
    s = sizes(tensors)
    return LoadRecord(VAE, source, (Form("as stored", "default", "vae", s.total, keeps_host_copy=True),),
                      (RESIDENT, PER_PROMPT), working, 1, first_read_bytes=s.total, compute_scale=compute_scale,
                      host_work=IMAGE_PNG)


def lora_set(sources: list[str], tensors: list[Tensor]) -> LoraSet:
    """The LoRAs on the DiT: their patches in the compute dtype, and the layers they patch."""
    layers = {t.name.rsplit(".lora_", 1)[0].rsplit(".", 2)[0] for t in tensors}
    return LoraSet(tuple(sources), sum(t.computed for t in tensors), len(layers))

