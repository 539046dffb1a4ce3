"""The moment memory ran out, gathered from ComfyUI's model management for the advice (``memory_advice``).

- Free memory: as ComfyUI counts it (``memory.usable_memory``), plus what the failed load or step had itself taken
  on the device (freed once the error is handled), so that it is what was free as the load or step began.
- Models: every one ComfyUI holds (``model_management.current_loaded_models``). The pack's describe their loaders'
  choices themselves (``memory_choices()`` on the module a patcher manages: the DiT's BaseModel, the text encoder's
  and PE's containers); here are added their device and the bytes they hold on the failing device, counted from
  their tensors (core's own count reads a torchao weight at its original dtype). Other models count as one sum.
- A sampling step: ComfyUI's own estimate for its batch (``BaseModel.memory_required``) and what each per-run
  accelerator keeps (``sampling.run_memory``).

This runs while an out-of-memory error is raised, which it must not replace: a fact that cannot be read (the free
memory of a device core cannot count) is left out and the advice says so; should the advice itself fail, its words
say that instead, and the log why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

import comfy.model_management as mm
import torch

from ..memory_advice import PackModel, Shortage, advice
from .memory import allocated_memory, usable_memory
from .sampling import call_accepting, run_memory
from .sizes import tensor_bytes


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` and ``cuda:0`` alike where one has no index (core names devices with one, torch at times not)."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _bytes_on(module: torch.nn.Module, device: torch.device) -> int:
    return sum(tensor_bytes(t) for t in (*module.parameters(), *module.buffers()) if _same_device(t.device, device))


def _free(device: torch.device) -> int | None:
    try:
        return usable_memory(device)
    except Exception:  # a device core cannot count (the tests' meta GPU, a backend it does not know): unknown
        logging.debug("ERNIE-Image: cannot read the free memory on %s", device, exc_info=True)
        return None


def _described(patcher, held: int) -> PackModel | None:
    """The pack's model that ``patcher`` manages, as it describes itself; None for any other model."""
    describe = getattr(patcher.model, "memory_choices", None)
    if describe is None:
        return None
    # WholeModelPatcher says it loads whole (``loads_whole``); core's patchers load in part.
    return replace(describe(), device=str(patcher.load_device), held=held, name=type(patcher.model).__name__,
                   loads_in_part=not getattr(patcher, "loads_whole", False))


def _loaded(device: torch.device, skip: torch.nn.Module | None = None) -> tuple[tuple[PackModel, ...], int]:
    """The pack's models ComfyUI holds (on any device) with their bytes on ``device``, and the bytes of the other
    models there; ``skip``: the model whose load failed."""
    pack, others, seen = [], 0, {id(skip)}
    for loaded in list(mm.current_loaded_models):
        patcher = loaded.model  # a weak reference: None once the patcher is gone
        if patcher is None or id(patcher.model) in seen:
            continue
        seen.add(id(patcher.model))  # clones share their model
        held = _bytes_on(patcher.model, device) if _same_device(loaded.device, device) else 0
        described = _described(patcher, held)
        if described is None:
            others += held
        else:
            pack.append(described)
    return tuple(pack), others


def _advice(device: torch.device, gather: Callable[[], Shortage]) -> str:
    """The advice for what ``gather()`` finds; should that fail (a model describing itself wrongly), words that say
    so: the out-of-memory error it explains must stay what is raised."""
    try:
        return advice(gather())
    except Exception:
        logging.exception("ERNIE-Image: the out-of-memory advice could not be worked out")
        return f"ran out of memory on {device}; which step would fit could not be worked out (the log says why)."


def load_advice(patcher, device: torch.device) -> str:
    """The advice when ``patcher``'s model could not be loaded whole on ``device``."""
    device = torch.device(device)

    def gather() -> Shortage:
        need = patcher.model_size()
        failed = _described(patcher, need) or PackModel("model", need, "", str(device), need,
                                                       name=type(patcher.model).__name__)
        free = _free(device)
        if free is not None:
            free += _bytes_on(patcher.model, device)  # what the failed load had moved there already
        held, others = _loaded(device, skip=patcher.model)
        return Shortage(str(device), free, need, failed, held, others)

    return _advice(device, gather)


def sampling_advice(diffusion_model: torch.nn.Module, input_shape: list[int], text_tokens: int, device: torch.device,
                    image: tuple[int, int], multiple: int, transformer_options: dict, started: int) -> str:
    """The advice when a sampling step of ``diffusion_model`` (latent ``input_shape``, ``text_tokens`` long text,
    an ``image`` of that many pixels whose sides are multiples of ``multiple``) ran out of memory on ``device``;
    ``started``: ``memory.allocated_memory(device)`` as the step began."""

    def gather() -> Shortage:
        held, others = _loaded(device)
        base = next((loaded.model.model for loaded in mm.current_loaded_models if loaded.model is not None
                     and getattr(loaded.model.model, "diffusion_model", None) is diffusion_model), None)
        estimate = int(call_accepting(base.memory_required, input_shape)) if base is not None else 0
        accelerators = tuple((name, int(kept(input_shape, text_tokens)))
                             for name, kept in run_memory(transformer_options).items())
        free = _free(device)
        if free is not None:
            free += max(allocated_memory(device) - started, 0)  # what the failed step itself held
        need = estimate + sum(kept for _, kept in accelerators)
        return Shortage(str(device), free, need, None, held, others, image, multiple, accelerators)

    return _advice(device, gather)
