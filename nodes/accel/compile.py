"""Regional ``torch.compile`` of a DiT's repeated blocks, for one sampling run (engine: no ComfyUI here).

Like diffusers' ``compile_repeated_blocks``: each block's call is compiled, and since the blocks are alike, one
compiled graph serves all of them (one compiled function takes the block as an input, so installing again on the
next run compiles nothing new). The sequence length (image tokens + text tokens) is marked dynamic before each
call, so a new prompt length or image size does not recompile; the batch size stays static (one graph for a
single pass, one for batched CFG). Installing sets the blocks' ``_compiled_call_impl`` (what
``nn.Module.compile`` sets); removing deletes it, which leaves the blocks exactly as they were.

ComfyUI's partial loading (a card too small for the DiT) leaves some layers' weights off the GPU, cast per call.
Those blocks run eager: they wait on the copies anyway, and each pattern of streamed layers would be a graph of its
own, compiled again whenever a new prompt loads a different part (seconds per prompt on a 16 GB card). A GGUF DiT's
blocks compile with their decode (inductor fuses it), and with a plain LoRA added to the decoded weight: its factors
and its scale are tensors the layer holds on the device, inputs to the graph, so a new strength, or another LoRA of
the same ranks, compiles nothing. Blocks with other adapters (LoHa, LoKr, DoRA, diffs), which core's
``calculate_weight`` applies at each call with the strength a Python number, run eager (``patches_per_call``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator

import torch

MODES = ("default", "max-autotune-no-cudagraphs")
DEFAULT_MIN_CAPABILITY = (8, 0)  # Ampere and later: bf16 tensor cores, where Triton's kernels are at home
# Triton converts float8_e4m3fn only from Ada on: a compiled fp8 -> bf16 cast fails to build on RTX 30 and A100
# ("fp8e4nv data type is not supported on CUDA arch < 89": triton-lang/triton#4319, pytorch/pytorch#167082).
FP8_CAST_MIN_CAPABILITY = (8, 9)
FP8_STORAGE = (torch.float8_e4m3fn, torch.float8_e5m2)
# The compiled variants one ComfyUI process may meet: weight dtypes (bf16, fp32, torchao's FP8 and INT8 weights) x
# batch (1, or cond and uncond batched) x attention mask (none, or texts of other lengths padded), with room to spare.
# dynamo's default (8) would run the rest eager, silently.
RECOMPILE_LIMIT = 64

# What ComfyUI's layers (``comfy.ops``) choose their weights by at each call: their own, or cast or patched on the
# fly. Core's loading sets them per layer, as instance attributes or not, and dynamo guards on both.
LAYER_SWITCHES = ("comfy_cast_weights", "weight_function", "bias_function")

log = logging.getLogger(__name__)


def compile_problem(device: torch.device) -> str | None:
    """Why ``torch.compile`` (inductor) cannot run on ``device`` here, or None when it can."""
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception:  # inductor raises its own InvalidCxxCompiler, or OSError/RuntimeError on Windows
            return ("torch.compile cannot run on the CPU here: it needs a C++ compiler and none was found "
                    "(g++ or clang on Linux and macOS, the MSVC Build Tools' cl.exe on Windows). "
                    "Install one, or bypass ErnieImageCompile.")
    elif device.type in ("cuda", "xpu"):
        from torch.utils._triton import has_triton_package

        if not has_triton_package():
            return (f"torch.compile needs Triton on {device.type.upper()} GPUs and it is not installed "
                    "(on Windows: pip install triton-windows). Install it, or bypass ErnieImageCompile.")
        if sys.platform.startswith("linux") and not (os.environ.get("CC") or shutil.which("gcc")
                                                     or shutil.which("clang")):
            # Triton builds its kernel launchers with the C compiler it finds this way (triton-windows brings its
            # own); without one, the first compiled call fails deep inside inductor.
            return ("torch.compile needs a C compiler for Triton and none was found (no gcc or clang on PATH, "
                    "CC not set). Install gcc (e.g. apt install gcc), or bypass ErnieImageCompile.")
    return None


def compiles_by_default(device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """Whether the pack's MODEL compiles its blocks without being asked: on CUDA GPUs of compute capability 8.0
    or later where compile can run (``capability`` is read from the device when not given)."""
    if device.type != "cuda" or compile_problem(device) is not None:
        return False
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    return tuple(capability) >= DEFAULT_MIN_CAPABILITY


def fp8_cast_problem(blocks: torch.nn.Module, device: torch.device,
                     capability: tuple[int, int] | None = None) -> str | None:
    """Why ``blocks`` cannot be compiled on ``device``: their weights are stored in fp8 (cast to the compute dtype
    per layer) on a GPU where Triton cannot convert fp8; None where they can (``capability`` read from the device
    when not given). torchao's FP8 weights are not meant: they run only on sm89+ anyway."""
    if device.type != "cuda" or not any(p.dtype in FP8_STORAGE for p in blocks.parameters()):
        return None
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability) >= FP8_CAST_MIN_CAPABILITY:
        return None
    return (f"their weights are stored in fp8, which Triton converts only on sm89 or newer (RTX 40/50, H100), not "
            f"on this sm{capability[0]}{capability[1]} GPU: they run eager, cast per layer as core's fp8 models do")


def _tensors(values) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _mark_sequence_dynamic(args: tuple, kwargs: dict) -> None:
    """Mark the token axis dynamic in every block input. The hidden states are ``[S, B, H]`` (diffusers) or
    ``[B, S, H]`` (ComfyUI's native ERNIE): the sequence is the longer of the first two axes. Float tensors carry
    features last, so their last axis is never the sequence; a boolean attention mask has no feature axis."""
    x = args[0]
    length = max(x.shape[:-1])
    for t in _tensors((*args, *kwargs.values())):
        axes = range(t.ndim) if t.dtype == torch.bool else range(t.ndim - 1)
        for axis in axes:
            if t.shape[axis] == length:
                torch._dynamo.maybe_mark_dynamic(t, axis)


def _call_block(block: torch.nn.Module, *args, **kwargs):
    return block._call_impl(*args, **kwargs)


@functools.cache
def _compiled_block_call(mode: str) -> Callable:
    """``_call_block`` compiled, once per mode and process. Made again at every run, as ``torch.compile`` per block
    was, it cost 12 ms of idle GPU per run for the 36 blocks (``torch.compile`` copies inductor's config on each
    call). Dynamo's cache lives with ``_call_block``'s code and the block is an input, so alike blocks share graphs."""
    return torch.compile(_call_block, mode=None if mode == "default" else mode)


def compile_settings() -> contextlib.AbstractContextManager:
    """dynamo's settings while a run's blocks are compiled (only then: nothing process-wide stays behind): enough
    recompiles for the variants, and an exception rather than a silent eager run when they run out."""
    limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True)


@functools.cache  # once per process
def _say_eager_fallback() -> None:
    log.warning("ERNIE-Image: the DiT's blocks were compiled for %d variants (models, dtypes, batch sizes, text "
                "masks) in this process, dynamo's limit: others run eager, slower. Restart ComfyUI to compile "
                "afresh.", torch._dynamo.config.recompile_limit)


def _call_with_dynamic_sequence(compiled: Callable, block: torch.nn.Module, *args, **kwargs):
    _mark_sequence_dynamic(args, kwargs)
    try:
        return compiled(block, *args, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        _say_eager_fallback()
        return block._call_impl(*args, **kwargs)


def _on(tensor: torch.Tensor, device: torch.device) -> bool:
    """Whether ``tensor`` is on ``device``; ``cuda`` without an index (a load device may be named so) is any GPU."""
    index = tensor.device.index
    return tensor.device.type == device.type and (index is None or device.index is None or index == device.index)


def streams_weights(block: torch.nn.Module, device: torch.device) -> bool:
    """Whether some layer of ``block`` has its weight off ``device`` or patched per call (ComfyUI's partial loading,
    or an adapter core applies per call to a layer that decodes its weight: a GGUF layer's ``patches_per_call``)."""
    return not all(_on(t, device) for t in block.parameters()) or any(
        getattr(m, "weight_function", None) or getattr(m, "bias_function", None)
        or getattr(m, "patches_per_call", False) for m in block.modules())


class RegionalCompile:
    """Compiles each block of ``blocks`` that runs on ``device`` with its weights there, for one run: ``install``
    before it, ``remove`` after (always)."""

    def __init__(self, blocks: torch.nn.ModuleList, mode: str = "default", device: torch.device | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.blocks, self.mode = blocks, mode
        self.device = device or next(blocks.parameters()).device
        self._previous: list = []
        self._switches_set: list[tuple[torch.nn.Module, str, object]] = []

    def install(self) -> int:
        """Compile the blocks whose weights are on the device; how many those are."""
        self._previous = [vars(block).get("_compiled_call_impl") for block in self.blocks]
        compiled = _compiled_block_call(self.mode)
        count = 0
        for block in self.blocks:
            if not streams_weights(block, self.device):
                self._pin_switches(block)
                block._compiled_call_impl = functools.partial(_call_with_dynamic_sequence, compiled, block)
                count += 1
        return count

    def _pin_switches(self, block: torch.nn.Module) -> None:
        """Every layer holds its switches as instance attributes for the run, so that blocks alike in what they
        compute are alike to dynamo's guards too, whatever core's loading left behind before."""
        for layer in block.modules():
            for name in LAYER_SWITCHES:
                if hasattr(layer, name) and name not in vars(layer):
                    value = getattr(layer, name)
                    value = list(value) if isinstance(value, list) else value  # not the class's shared list
                    setattr(layer, name, value)
                    self._switches_set.append((layer, name, value))

    def remove(self) -> None:
        for layer, name, value in self._switches_set:
            if vars(layer).get(name) is value and not (isinstance(value, list) and value):
                del vars(layer)[name]  # unchanged since install: the class attribute again (core's own change stays)
        self._switches_set = []
        for block, previous in zip(self.blocks, self._previous, strict=False):
            if previous is None:
                vars(block).pop("_compiled_call_impl", None)
            else:  # compiled by someone else before this run: theirs again
                block._compiled_call_impl = previous
