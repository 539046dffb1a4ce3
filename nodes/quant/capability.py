"""Which quantization methods can run here, decided before any work (engine: no ComfyUI here).

The facts about the machine (``probe``) and the rules (``problem``) are kept apart, so that every combination of
GPU architecture, installed kernels and torchao is testable on any machine.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import ErnieImageError

Arch = tuple[int, int]  # CUDA compute capability, e.g. (8, 9) for sm89

# cache-dit-cu13 builds its SVDQuant W4A4 kernels (cache_dit._C_svdquant) for sm80/86/89/120a/121a only:
# not for Hopper (sm90) nor data-center Blackwell (sm100/103).
SVDQ_INT4_ARCHS = frozenset({(8, 0), (8, 6), (8, 9), (12, 0), (12, 1)})
SVDQ_NVFP4_ARCHS = frozenset({(12, 0), (12, 1)})  # NVFP4 tensor cores: RTX 50-class Blackwell
FP8_MIN_ARCH = (8, 9)  # cache-dit's torchao path refuses FP8 below Ada


@dataclass(frozen=True)
class Method:
    """One choice of the loaders' ``quantization`` input: what it needs to run, and what it means for the loader
    (read there, never re-derived from the method's name)."""

    quant_type: str  # cache-dit's name for it ("" for none)
    backend: str  # "torchao", "svdquant", or "" for none
    runs_on: Callable[[Arch], bool] = lambda arch: True  # the CUDA architectures it runs on (any other device: none)
    hardware: str = "an NVIDIA GPU"  # what ``runs_on`` asks for, in words
    needs_bf16: bool = False
    # Where it quantizes: on the GPU in seconds, the whole DiT where it fits there, else one block at a time, and on
    # the CPU only where not even a block fits (True: ``quantize.quantization_device``); or one layer at a time on
    # the GPU, each result kept on the CPU (False: SVDQuant's own offloading).
    whole_on_gpu_if_it_fits: bool = True
    # Whether the loader compiles the quantized DiT's blocks by default. cache-dit's W4A4 kernels under
    # torch.compile are unverified (no GPU here runs them): those stay eager unless ErnieImageCompile asks.
    compiles: bool = True
    # Whether ComfyUI must load the DiT whole: core's partial loading neither moves nor casts quantized layers.
    loads_whole: bool = True

    @property
    def quantizes(self) -> bool:
        """Whether the loader quantizes at all (a method starts from plain weights in the compute dtype)."""
        return bool(self.backend)


_SVDQ = dict(backend="svdquant", needs_bf16=True, whole_on_gpu_if_it_fits=False, compiles=False)
_SVDQ_INT4 = dict(runs_on=SVDQ_INT4_ARCHS.__contains__, **_SVDQ,
                  hardware="the GPUs cache-dit builds SVDQuant INT4 kernels for: sm80/86/89/120/121 (A100, RTX 30, "
                  "RTX 40, RTX 50), not Hopper (sm90) nor B200-class Blackwell (sm100)")
_FP8 = dict(backend="torchao", runs_on=lambda arch: arch >= FP8_MIN_ARCH,
            hardware="FP8 tensor cores: sm89 or newer (RTX 40, L40, H100/H200, Blackwell)")

METHODS: dict[str, Method] = {
    "none": Method("", "", loads_whole=False),
    "fp8_per_row": Method("float8_per_row", needs_bf16=True, **_FP8),
    "fp8_weight_only": Method("float8_weight_only", **_FP8),
    "int8_weight_only": Method("int8_weight_only", "torchao"),
    "svdq_int4_r32_dq": Method("svdq_int4_r32_dq", **_SVDQ_INT4),
    "svdq_int4_r128_dq": Method("svdq_int4_r128_dq", **_SVDQ_INT4),
    "svdq_nvfp4_r32_dq": Method("svdq_nvfp4_r32_dq", runs_on=SVDQ_NVFP4_ARCHS.__contains__, **_SVDQ,
                                hardware="NVFP4 tensor cores with cache-dit's SVDQuant kernels: sm120/121 (RTX "
                                "50-class Blackwell)"),
}
# What to offer instead of a method that cannot run, best first.
FALLBACKS = ("svdq_int4_r32_dq", "fp8_per_row", "int8_weight_only")
# What the out-of-memory advice offers to halve a DiT, best first: torchao's methods, which hold each block weight in
# one byte, quantize in seconds at every load and take LoRAs (SVDQuant's W4A4 takes minutes the first time, no LoRAs,
# and its kernels are a separate build).
HALVING = ("fp8_per_row", "int8_weight_only")

_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Facts:
    """What the quantization methods depend on, for the device ComfyUI runs the DiT on."""

    device: str  # e.g. "cpu", "cuda:0"
    gpu: str = ""  # e.g. "NVIDIA H200"
    arch: Arch | None = None  # None: not an NVIDIA (CUDA) GPU
    torchao: bool = False
    svdq_kernels: bool = False  # cache_dit._C_svdquant imports
    svdq_error: str = ""  # why it does not
    cache_dit: str = ""  # the installed cache-dit version


def cuda_arch(device: torch.device) -> Arch | None:
    """The CUDA compute capability of ``device``; None for anything but an NVIDIA GPU (the CPU, ROCm's cuda)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    return torch.cuda.get_device_capability(device)


def halving_method(arch: Arch | None) -> str | None:
    """The first of ``HALVING`` that runs on a GPU of ``arch`` (None: none does, as on the CPU)."""
    return next((name for name in HALVING if arch is not None and METHODS[name].runs_on(arch)), None)


@functools.cache
def svdq_kernels() -> tuple[bool, str]:
    """Whether cache-dit's SVDQuant kernels load here, and why not.

    They are loaded first on a thread of their own: cache-dit keeps the exception of that first load for the
    process's life (``cache_dit.kernels.cuda._svdquant._cached_load_error``), and its traceback's frames keep their
    callers' frames and locals with them. Loaded from a loader, those were the DiT loader's frames, so the first DiT
    a process made was never freed (with cache-dit 1.5.3, on every machine without the kernels)."""
    found: dict = {}

    def load() -> None:
        try:
            from cache_dit.quantization import svdq_get_load_error, svdq_is_available

            found["kernels"] = (svdq_is_available(), str(svdq_get_load_error() or ""))
        except Exception as error:  # its words only: kept, the error would hold this thread's frames
            found["kernels"] = (False, f"its check failed: {type(error).__name__}: {str(error)[:300]}")

    thread = threading.Thread(target=load, name="ERNIE-Image: SVDQuant kernels", daemon=True)
    thread.start()
    thread.join()
    return found["kernels"]


def probe(device: torch.device) -> Facts:
    """The facts of this machine for ``device``."""
    import cache_dit

    kernels, error = svdq_kernels()
    common = dict(
        device=str(device),
        torchao=importlib.util.find_spec("torchao") is not None,
        svdq_kernels=kernels,
        svdq_error=error,
        cache_dit=cache_dit.__version__,
    )
    if device.type != "cuda":
        return Facts(**common)
    name = torch.cuda.get_device_name(device)
    if torch.version.hip is not None:  # an AMD GPU behind torch's cuda device type
        return Facts(**{**common, "device": f"{device} ({name}, ROCm)"})
    return Facts(gpu=name, arch=cuda_arch(device), **common)


def fallback(method: str, facts: Facts) -> str | None:
    """The best other method this GPU and the installed kernels can run (torchao may still need installing)."""
    if facts.arch is None:
        return None
    for name in FALLBACKS:
        other = METHODS[name]
        if name != method and other.runs_on(facts.arch) and (other.backend != "svdquant" or facts.svdq_kernels):
            return name
    return None


def _instead(method: str, facts: Facts, verb: str = "Use") -> str:
    name = fallback(method, facts)
    if name is None:
        return "Set quantization to 'none'."
    needs_torchao = METHODS[name].backend == "torchao" and not facts.torchao
    return f"{verb} '{name}' instead" + (" (after `pip install torchao`)." if needs_torchao else ".")


def problem(method: str, facts: Facts, dtype: torch.dtype) -> str | None:
    """Why ``method`` cannot quantize a ``dtype`` DiT with these facts, and what to do; None when it can."""
    spec = METHODS[method]
    if not spec.quantizes:
        return None
    if facts.arch is None:
        return (f"Quantization '{method}' needs an NVIDIA GPU (CUDA), but ComfyUI runs this model on {facts.device}. "
                "Set quantization to 'none'.")
    if not spec.runs_on(facts.arch):
        here = f"{facts.gpu or facts.device} (sm{facts.arch[0]}{facts.arch[1]})"
        return f"Quantization '{method}' cannot run on {here}: it needs {spec.hardware}. {_instead(method, facts)}"
    if spec.needs_bf16 and dtype != torch.bfloat16:
        return (f"Quantization '{method}' works on bf16 weights, but weight_dtype is "
                f"{_DTYPE_NAMES.get(dtype, dtype)}. Set weight_dtype to 'bf16' (or 'default').")
    if spec.backend == "svdquant" and not facts.svdq_kernels:
        return (f"Quantization '{method}' needs cache-dit's SVDQuant kernels (cache_dit._C_svdquant), which the "
                f"installed cache-dit {facts.cache_dit} does not have ({facts.svdq_error or 'not found'}). Install "
                "the build that carries them into ComfyUI's Python: `pip uninstall -y cache-dit && pip install "
                f"cache-dit-cu13` (CUDA 13, torch 2.11 or newer). {_instead(method, facts, 'Or use')}")
    if spec.backend == "torchao" and not facts.torchao:
        return (f"Quantization '{method}' uses torchao, which is not installed. Install it into ComfyUI's Python: "
                "`pip install torchao`, then restart ComfyUI.")
    return None


def require(method: str, facts: Facts, dtype: torch.dtype) -> None:
    """Raise the words of ``problem`` when ``method`` cannot run here."""
    reason = problem(method, facts, dtype)
    if reason is not None:
        raise ErnieImageError(reason)
