"""The probe: what each form of each model costs on this GPU, measured once and kept in ComfyUI's user folder.

Measured on synthetic layers of the real shapes (random weights made on the device; no model file is read): one DiT
block's linears in each form the pack holds the DiT in, and its attention and element-wise work (norms, RoPE,
activations, adaLN, residuals) once, times its 36 blocks, and a rank-64 LoRA's outputs on those linears (as a GGUF
DiT adds them), per GB of its factors; one text-encoder layer for a 128-token encode and for one PE
token after 512, times its 26 layers, on the GPU and (the encode) on the CPU; one 1024² decode by the Flux.2 VAE's
decoder (core's, in row slabs as the pack decodes); its image saved as a PNG on the CPU, as core's SaveImage does;
host-to-GPU copies, pinned and pageable. Everything runs eager but a PE token's work on a CUDA GPU, which is captured
in a CUDA graph and replayed, as the PE decodes (``pe/local/decode``): launched one by one from Python, a token's few
hundred small kernels wait for their launches (a Triton kernel's the longest), which the PE's tokens never do. GGUF
blocks are decoded by the pack's own ``dequantize`` before each matmul: where the pack holds a GGUF DiT whole it
compiles the blocks and inductor fuses the decode, which would take longer to compile than the whole probe may take;
the eager figure ranks the GGUF types against each other and against the other forms, and the GPU check prints
measured beside predicted.

Warm-up once, then up to three timings (CUDA events), their median; a repetition beyond the first is skipped once
``budget_s`` has passed, so the probe stays near its budget on a slow GPU (about 15 s; on an H200 a few); the VAE's
decode, long enough to time once, is timed once. Its peak on the GPU is the decode (its 0.16 GB of weights and 1.2
GiB working), one DiT block in one form (436 MB in bf16) with its activations, or the 256 MiB copy.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import comfy.ldm.modules.diffusionmodules.model as vae_model
import comfy.model_management
import folder_paths
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from ..cancel import check_cancel
from ..fp8_linear import FP8, FP8_MAX, Fp8Linear, quantize_rows
from ..gguf.dequant import BLOCKS, SCALE_OFFSETS, dequantize
from ..plan.costs import IMAGE_PNG, LORA_PER_GB, Costs, read_costs, write_costs
from .gguf_layers import LoraFactors, lora_output
from .sampling import progress_bar
from .vae import decode_in_row_slabs

log = logging.getLogger(__name__)

COSTS_FILE = ("ernie-image", "costs.json")  # under ComfyUI's user folder
# In the key: a probe that measures differently (another form or shape; v8: PE tokens graphed) measures again.
PROBE_VERSION = 8
NVIDIA_VERSION_FILE = Path("/proc/driver/nvidia/version")
REPEATS = 3
HEAD_ROWS = 16384  # the PE's vocabulary head is timed on this many rows and scaled (all of it: 805 MB more)
LORA_RANK = 64  # the probe's LoRA (the GPU check's): its cost per GB of factors is what the plan scales


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The models' shapes as the probe builds them: the DiT (``dit_tokens``: a 1024² image's 4096 tokens and 128 of
    text), the Ministral 3 3B text encoder, whose architecture the PE shares (``vocab``: the PE's head), the
    bytes of one host → GPU copy."""

    dit_hidden: int = 4096
    dit_heads: int = 32
    dit_ffn: int = 12288
    dit_blocks: int = 36
    dit_tokens: int = 4096 + 128
    text_hidden: int = 3072
    text_heads: int = 32
    text_kv_heads: int = 8
    text_head_dim: int = 128
    text_ffn: int = 9216
    text_layers: int = 26
    text_tokens: int = 128
    pe_cached_tokens: int = 512
    vocab: int = 131072
    vae_channels: int = 128  # the Flux.2 VAE decoder's: its widths are these times ``vae_mult``
    vae_mult: tuple[int, ...] = (1, 2, 4, 4)
    vae_latent_channels: int = 32
    vae_latent: int = 128  # a 1024² image's side in the decoder's input (16 × 8 in the sampler's latent)
    copy_bytes: int = 256 << 20

    def dit_linears(self) -> list[tuple[int, int]]:
        """One block's linears as ``(in, out)``: q, k, v, out; the FFN's gate, up and down."""
        hidden, ffn = self.dit_hidden, self.dit_ffn
        return [(hidden, hidden)] * 4 + [(hidden, ffn)] * 2 + [(ffn, hidden)]

    def text_linears(self) -> list[tuple[int, int]]:
        """One decoder layer's linears as ``(in, out)``: q, k, v, o; the MLP's gate, up and down."""
        hidden, ffn = self.text_hidden, self.text_ffn
        query, kv = self.text_heads * self.text_head_dim, self.text_kv_heads * self.text_head_dim
        return [(hidden, query), (hidden, kv), (hidden, kv), (query, hidden)] + [(hidden, ffn)] * 2 + [(ffn, hidden)]


TRUE_SHAPES = Shapes()
Linear = Callable[[torch.Tensor], torch.Tensor]


def _random(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, scale: float = 0.02) -> torch.Tensor:
    """Random numbers, fast on any device: a random tile of at most 1M values repeated (matmul time does not depend
    on the values, only on there being no zeros or subnormals)."""
    count = 1
    for size in shape:
        count *= size
    tile = torch.randn(min(count, 1 << 20), device=device) * scale
    return tile.repeat(-(-count // tile.numel()))[:count].view(shape).to(dtype)


def _bf16(inputs: int, outputs: int, device: torch.device) -> Linear:
    weight = _random((outputs, inputs), torch.bfloat16, device)
    return lambda x: F.linear(x, weight)


def _fp8_cast(inputs: int, outputs: int, device: torch.device) -> Linear:
    """The pack's fp8 storage (``Fp8Linear``, as core's fp8 weights): cast to bf16 per layer, then the matmul; a PE
    token's single row in one kernel on a CUDA GPU (``fp8_gemv``)."""
    layer = Fp8Linear(inputs, outputs, bias=False, device=device)
    layer.weight.data, layer.weight_scale = quantize_rows(_random((outputs, inputs), torch.float32, device))
    return layer


def _fp8_matmul(inputs: int, outputs: int, device: torch.device) -> Linear:
    """FP8 compute as ``fp8_per_row`` runs it: the input quantized per row, then ``torch._scaled_mm`` rowwise."""
    weight, scale = quantize_rows(_random((outputs, inputs), torch.float32, device))
    weight_t, scale_t = weight.t(), scale.t().contiguous()

    def run(x: torch.Tensor) -> torch.Tensor:
        x_scale = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
        x8 = (x / x_scale).to(FP8)
        return torch._scaled_mm(x8, weight_t, scale_a=x_scale, scale_b=scale_t, out_dtype=torch.bfloat16)
    return run


def _gguf(kind: str) -> Callable[[int, int, torch.device], Linear]:
    def build(inputs: int, outputs: int, device: torch.device) -> Linear:
        """Random valid ``kind`` blocks (small finite fp16 scales), decoded by the pack per layer, then the matmul."""
        values, size = BLOCKS[kind]
        blocks = torch.randint(0, 256, (inputs * outputs // values, size), dtype=torch.uint8, device=device)
        for offset in SCALE_OFFSETS[kind]:
            scales = torch.empty(blocks.shape[0], 1, dtype=torch.float16, device=device).uniform_(-1e-3, 1e-3)
            blocks[:, offset:offset + 2] = scales.view(torch.uint8)
        return lambda x: F.linear(x, dequantize(blocks, kind, (outputs, inputs), torch.bfloat16))
    return build


def _lora(inputs: int, outputs: int, device: torch.device) -> Linear:
    """A rank-``LORA_RANK`` LoRA's outputs alone, as a GGUF layer adds them to its own (``gguf_layers.lora_output``)."""
    factors = (LoraFactors(_random((outputs, LORA_RANK), torch.bfloat16, device),
                           _random((LORA_RANK, inputs), torch.bfloat16, device),
                           torch.tensor(1.0, dtype=torch.float32, device=device)),)
    return lambda x: lora_output(x, factors)


def _lora_bytes(linears: list[tuple[int, int]]) -> int:
    """The bf16 factors of ``_lora`` on ``linears``."""
    return sum(LORA_RANK * (inputs + outputs) * 2 for inputs, outputs in linears)


def fp8_matmul_runs(device: torch.device) -> bool:
    """Whether ``device`` has FP8 matmul: on a GPU, as core judges it (sm89 or newer with a torch that has it, or
    ``--supports-fp8-compute``), and where this torch's rowwise ``_scaled_mm`` runs there (core's judgement does not
    ask it, and a probe that raised there would leave no plan at all); on the CPU, where it runs (the tests'
    device)."""
    if device.type == "cuda" and not comfy.model_management.supports_fp8_compute(device):
        return False
    try:
        _fp8_matmul(16, 16, device)(torch.ones(16, 16, dtype=torch.bfloat16, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def dit_forms(device: torch.device) -> dict[str, Callable[[int, int, torch.device], Linear]]:
    """The DiT's forms here, by their ``compute`` key (``plan/records.Form.compute``)."""
    forms = {"dit:bf16": _bf16, "dit:fp8_cast": _fp8_cast}
    if fp8_matmul_runs(device):
        forms["dit:fp8_matmul"] = _fp8_matmul
    return forms | {f"dit:gguf:{kind}": _gguf(kind) for kind in BLOCKS}


# The text encoder's and the PE's (fp8: the pack's fp8 storage; a GGUF file's type, its layers decoded per use). A
# GGUF text encoder's encode is not the fp8 one: its layers are small, so each type's decode, many kernels a layer,
# sets its time (Q4_K_M 166 ms, Q8_0 44 ms, fp8 44 ms on the H200, bench/RESULTS.md, session 30).
TEXT_FORMS = {"bf16": _bf16, "fp8": _fp8_cast} | {f"gguf:{kind}": _gguf(kind) for kind in BLOCKS}


class _Timer:
    """Times runs within one deadline, checks Cancel before each and reports progress."""

    def __init__(self, budget_s: float, total: int, progress: Callable[[int, int], None] | None):
        self.deadline, self.total, self.progress, self.done = time.monotonic() + budget_s, total, progress, 0

    @staticmethod
    def _once(run: Callable[[], object], device: torch.device) -> float:
        if device.type != "cuda":
            start = time.perf_counter()
            run()
            return time.perf_counter() - start
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000

    def seconds(self, run: Callable[[], object], device: torch.device, repeats: int = REPEATS) -> float:
        """The median of up to ``repeats`` timings of ``run`` on ``device`` after a warm-up (kernels chosen, memory
        allocated); one only, once past the deadline."""
        check_cancel()
        with torch.inference_mode():
            run()
            times = [self._once(run, device)]
            while len(times) < repeats and time.monotonic() < self.deadline:
                times.append(self._once(run, device))
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)
        return statistics.median(times)


def _graphed(run: Callable[[], object], device: torch.device) -> Callable[[], object]:
    """``run`` captured in a CUDA graph on a CUDA device, replayed by the call returned, as the PE's decode step is
    (``pe/local/decode._GraphedStep``); ``run`` itself on another device or where its capture fails."""
    if device.type != "cuda":
        return run
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        run()  # outside the capture: kernels built (Triton's too), cuBLAS's workspace allocated
        try:
            with torch.cuda.graph(graph):
                run()
        except RuntimeError as error:  # a form whose kernels cannot be captured: timed as launched
            log.info("ERNIE-Image probe: a PE token's work timed eager (no CUDA graph: %s)", str(error)[:200])
            return run
    return graph.replay


def _layers(build: Callable[[int, int, torch.device], Linear], linears: list[tuple[int, int]],
            device: torch.device, tokens: int) -> Callable[[], None]:
    """One block's ``linears`` in one form, run on ``tokens`` tokens (an input of each width made once)."""
    layers = [(build(inputs, outputs, device), inputs) for inputs, outputs in linears]
    x = {inputs: _random((tokens, inputs), torch.bfloat16, device, 1.0) for inputs in {i for i, _ in linears}}

    def run() -> None:
        for layer, inputs in layers:
            layer(x[inputs])
    return run


def _attention(heads: int, kv_heads: int, head_dim: int, queries: int, keys: int, device: torch.device,
               causal: bool) -> Callable[[], object]:
    q = _random((1, heads, queries, head_dim), torch.bfloat16, device, 1.0)
    k, v = (_random((1, kv_heads, keys, head_dim), torch.bfloat16, device, 1.0) for _ in range(2))
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != heads)


def _pointwise(tokens: int, hidden: int, heads: int, kv_heads: int, head_dim: int, ffn: int, device: torch.device,
               dit: bool) -> Callable[[], None]:
    """One block's element-wise work beside its linears and attention, eager as the models run it: two RMSNorms,
    RoPE on q and k, the FFN's activation times its up projection, two residual sums; the DiT also normalises q and
    k and modulates and gates each half with its timestep's fp32 shift, scale and gate. Weights take no part in
    it: the same for every form."""
    x, norm = _random((1, tokens, hidden), torch.bfloat16, device, 1.0), torch.ones(hidden, dtype=torch.bfloat16,
                                                                                   device=device)
    q, k = _random((1, tokens, heads, head_dim), torch.bfloat16, device), _random((1, tokens, kv_heads, head_dim),
                                                                                   torch.bfloat16, device)
    head_norm, half = torch.ones(head_dim, dtype=torch.bfloat16, device=device), head_dim // 2
    cos, sin = (_random((1, tokens, 1, head_dim), torch.bfloat16, device) for _ in range(2))
    gate, up = (_random((1, tokens, ffn), torch.bfloat16, device) for _ in range(2))
    timestep = _random((1, 1, hidden), torch.float32, device)

    def rope(t: torch.Tensor) -> None:
        out = t * cos
        out[..., :half].addcmul_(t[..., half:], sin[..., :half])
        out[..., half:].addcmul_(t[..., :half], sin[..., half:])

    def run() -> None:
        for _ in range(2):  # attention's half, then the FFN's
            normed = F.rms_norm(x, (hidden,), norm)
            if dit:
                torch.addcmul(timestep, normed, 1 + timestep, out=torch.empty_like(normed))
                x + torch.mul(timestep, normed, out=torch.empty_like(x))
            else:
                x + normed
        for t in (q, k):
            rope(F.rms_norm(t, (head_dim,), head_norm) if dit else t)
        (F.gelu if dit else F.silu)(gate) * up
    return run


def _vae_decode(s: Shapes, device: torch.device) -> Callable[[], object]:
    """One image's decode by core's Flux.2 VAE decoder (``comfy.sd.VAE`` builds the same from the weights), its
    blocks in row slabs as the pack decodes (``host/vae.py``), bf16, random weights made on ``device``."""
    with torch.device(device):
        decoder = vae_model.Decoder(ch=s.vae_channels, out_ch=3, ch_mult=s.vae_mult, num_res_blocks=2,
                                    attn_resolutions=[], in_channels=3, resolution=256,
                                    z_channels=s.vae_latent_channels)
    decode_in_row_slabs(decoder)
    for parameter in decoder.parameters():  # core's layers leave their weights uninitialised
        parameter.data = _random(tuple(parameter.shape), torch.bfloat16, device)
    latent = _random((1, s.vae_latent_channels, s.vae_latent, s.vae_latent), torch.bfloat16, device, 1.0)
    return lambda: decoder(latent)


def _image_png(side: int) -> Callable[[], object]:
    """What core's SaveImage does with one decoded image (nodes.py ``SaveImage.save_images``: scaled to 0-255,
    clipped, made bytes and written as a PNG at compress level 4), into memory. The image is photo-like, smooth with
    a little noise (1.9 MB as a PNG): a PNG's time follows what it shows (on one CPU a flat image 0.02 s, noise
    0.11 s, this one 0.17 s), and a generated image is smooth and detailed."""
    y, x = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    smooth = torch.stack([(x / 4) % 256, (y / 4) % 256, ((x + y) / 8) % 256], dim=-1) / 255
    image = (smooth + (torch.rand(side, side, 3) - 0.5) / 16).numpy()

    def run() -> None:
        pixels = np.clip(255.0 * image, 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(io.BytesIO(), format="PNG", compress_level=4)
    return run


def _copy_speed(timer: _Timer, device: torch.device, size: int, pinned: bool) -> float:
    """Host → ``device`` bytes per second of one ``size``-byte copy (on the CPU device: a host copy; nothing pins)."""
    source = torch.zeros(size, dtype=torch.uint8, pin_memory=pinned and device.type == "cuda")
    target = torch.empty(size, dtype=torch.uint8, device=device)
    return size / timer.seconds(lambda: target.copy_(source, non_blocking=source.is_pinned()), device)


def measure(device: torch.device | str, shapes: Shapes = TRUE_SHAPES,
            progress: Callable[[int, int], None] | None = None, budget_s: float = 15.0) -> Costs:
    """What each form costs on ``device``, measured now (see the module's docstring): ``seconds`` of one DiT forward
    (batch 1, ``shapes.dit_tokens``) per form (``dit:bf16``, ``dit:fp8_cast``, ``dit:fp8_matmul`` where the device
    has FP8 matmul, ``dit:gguf:<type>`` for each GGUF block type the pack reads), of one encode of
    ``shapes.text_tokens`` (``text:bf16``, ``text:fp8``, ``text:gguf:<type>``) and of one PE token (``pe:bf16``,
    ``pe:fp8``, ``pe:gguf:<type>``), of one 1024² decode (``vae``), of a LoRA's outputs in one DiT forward per GB of
    its factors (``lora:dit_per_gb``); ``cpu_seconds["text:bf16"]``: the encode on the
    CPU (one layer timed once after a warm-up, times the layers), ``cpu_seconds["image:png"]``: the decode's image
    saved as a PNG. ``progress(done, total)`` after each measurement;
    Cancel (``check_cancel``) before each."""
    device, s = torch.device(device), shapes
    forms = dit_forms(device)
    # Measurements: two copies; the DiT's attention and element-wise rest, then each form; the text encoder's and
    # the PE's rest (two each) and the PE's head; each text form for an encode and a token; the VAE's decode; the
    # encode and the PNG on the CPU.
    timer = _Timer(budget_s, 2 + 2 + len(forms) + 1 + 5 + 2 * len(TEXT_FORMS) + 1 + 2, progress)
    pinned = _copy_speed(timer, device, s.copy_bytes, pinned=True)
    pageable = _copy_speed(timer, device, s.copy_bytes, pinned=False)

    def dit(build: Callable[[int, int, torch.device], Linear]) -> float:
        return timer.seconds(_layers(build, s.dit_linears(), device, s.dit_tokens), device)

    dit_heads = (s.dit_heads, s.dit_heads, s.dit_hidden // s.dit_heads)
    dit_rest = timer.seconds(_attention(*dit_heads, s.dit_tokens, s.dit_tokens, device, causal=False), device) \
        + timer.seconds(_pointwise(s.dit_tokens, s.dit_hidden, *dit_heads, s.dit_ffn, device, dit=True), device)
    seconds = {key: s.dit_blocks * (dit(build) + dit_rest) for key, build in forms.items()}
    seconds[LORA_PER_GB] = dit(_lora) * 1e9 / _lora_bytes(s.dit_linears())

    heads = (s.text_heads, s.text_kv_heads, s.text_head_dim)
    text_rest = timer.seconds(_attention(*heads, s.text_tokens, s.text_tokens, device, causal=True), device) \
        + timer.seconds(_pointwise(s.text_tokens, s.text_hidden, *heads, s.text_ffn, device, dit=False), device)
    pe_rest = timer.seconds(_graphed(_attention(*heads, 1, s.pe_cached_tokens + 1, device, causal=False), device),
                            device) \
        + timer.seconds(_graphed(_pointwise(1, s.text_hidden, *heads, s.text_ffn, device, dit=False), device), device)
    head_rows = min(s.vocab, HEAD_ROWS)  # the head stays bf16 in every form
    pe_head = timer.seconds(_graphed(_layers(_bf16, [(s.text_hidden, head_rows)], device, 1), device),
                            device) * s.vocab / head_rows
    for name, build in TEXT_FORMS.items():
        layer = timer.seconds(_layers(build, s.text_linears(), device, s.text_tokens), device)
        seconds[f"text:{name}"] = s.text_layers * (layer + text_rest)
        token = timer.seconds(_graphed(_layers(build, s.text_linears(), device, 1), device), device)
        seconds[f"pe:{name}"] = s.text_layers * (token + pe_rest) + pe_head
    seconds["vae"] = timer.seconds(_vae_decode(s, device), device, repeats=1)

    cpu = torch.device("cpu")
    cpu_layer = _layers(_bf16, s.text_linears(), cpu, s.text_tokens)
    cpu_rest = (_attention(*heads, s.text_tokens, s.text_tokens, cpu, causal=True),
                _pointwise(s.text_tokens, s.text_hidden, *heads, s.text_ffn, cpu, dit=False))
    cpu_text = s.text_layers * timer.seconds(lambda: [run() for run in (cpu_layer, *cpu_rest)], cpu, repeats=1)
    png = timer.seconds(_image_png(s.vae_latent * 8), cpu, repeats=1)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give back what the probe's layers took (a DiT block, the copies)
    return Costs(machine_key(device), pinned, pageable, seconds, {"text:bf16": cpu_text, IMAGE_PNG: png})


@functools.cache  # asked at every plan request; a driver cannot change under a process that holds a CUDA context
def driver_version(version_file: Path = NVIDIA_VERSION_FILE) -> str:
    """The NVIDIA driver's version: NVML's answer where ``pynvml`` (nvidia-ml-py) imports, else the kernel module's
    own file, else ``unknown`` (torch cannot tell)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no pynvml, no NVML library, no driver (NVMLError): ask the next source
        pass
    try:
        with version_file.open("rb") as file:
            text = file.read(4096).decode("utf-8", "replace")
    except OSError:
        return "unknown"
    found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", text)
    return found.group(1) if found else "unknown"


def machine_key(device: torch.device | str) -> str:
    """What the costs depend on: the device's name, the driver, torch and its CUDA, and the probe's version."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or "CPU")
    return (f"{name}; driver {driver_version() if device.type == 'cuda' else 'none'}; torch {torch.__version__}; "
            f"CUDA {torch.version.cuda}; probe {PROBE_VERSION}")


def costs_path() -> Path:
    """Where the costs are kept: ``ernie-image/costs.json`` in ComfyUI's user folder."""
    return Path(folder_paths.get_user_directory()).joinpath(*COSTS_FILE)


def kept_or_measured(path: Path, key: str, device: torch.device, shapes: Shapes = TRUE_SHAPES) -> Costs:
    """The costs kept at ``path`` for ``key``; else measured now on ``device`` (with ComfyUI's progress bar) and kept
    there: a file that is damaged, another machine's or not what the probe writes is measured over and replaced."""
    kept = read_costs(path, key)
    if kept is not None:
        return kept
    started, bar = time.monotonic(), progress_bar(1)
    measured = measure(device, shapes, progress=lambda done, total: bar.update_absolute(done, total))
    costs = dataclasses.replace(measured, key=key)
    log.info("ERNIE-Image measured what each model's forms cost on this machine in %.1f s (kept in %s): %s",
             time.monotonic() - started, path, ", ".join(f"{k} {v:.3g} s" for k, v in sorted(costs.seconds.items())))
    try:
        write_costs(path, costs)
    except OSError as error:  # a read-only user folder: use them now, measure again next time
        log.warning("ERNIE-Image could not keep the measured costs in %s (%s): they will be measured again", path,
                    error)
    return costs


def costs_here(device: torch.device | str) -> Costs | None:
    """This GPU's costs, kept or measured now (under 15 s, with ComfyUI's progress bar and Cancel); None on a
    device that is not a CUDA GPU (placement then follows the device, as core's does)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return kept_or_measured(costs_path(), machine_key(device), device)
