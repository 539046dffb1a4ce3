"""A whole-loaded model that ComfyUI unloads between prompts keeps its weights' host copy, pinned (its buffers too,
unpinned: they are small).

Core unloads a model by copying its weights back to the offload device (``ModelPatcher.unpatch_model``:
``self.model.to(offload_device)``, 0.3.75 and upstream model_patcher.py @08d0e510) into new pageable memory, and
loads it again from there: both ways over the link at the pageable rate (on the H200 5.5 GB/s against 52 pinned).
The PE, the text encoder and a torchao DiT without LoRA patches hold the same weights for their whole life, so once
core has unloaded one of them (it is loaded per prompt), its host tensors stay: pinned within core's bound
(``model_management.pin_memory``), the next load copies from them at the pinned rate, and each later unload points
the weights at them again instead of copying back. A model core never unloads keeps no second copy, nor does one
while the host RAM left is what the pack leaves to the system (``memory.spare_host_memory``). A GGUF DiT, which core
loads in part, does this per layer (``before_layer_move``): its blocks, norms and plain weights never change
either.

torchao's weights are tensor subclasses: their inner tensors are what is copied and pinned, and the weight is made
again around them (``__tensor_unflatten__``, as torch's tracing does).

The pack's models are tracked here while they live (``track``), so that the host RAM they hold, kept copies and the
originals of LoRA-patched weights included, can be counted (``held_on_host``): the memory plan may place those bytes
anew (``plan.host_room``).
"""

from __future__ import annotations

import logging
import weakref

import comfy.model_management as mm
import comfy.utils
import psutil
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.weak import WeakIdKeyDictionary

from .memory import ModelPatcher, spare_host_memory
from .sizes import plain_tensors
from .streaming import clear_registration_error, in_own_pages

_KEPT: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()
_UNLOADED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # unloaded by core once: loaded per prompt
_LOADED_ONCE: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # layers core has moved off the host once
_PINNED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a LoRA factor on the host -> its pinned copy (``pinned_copy``)
# The pack's models alive in this process, each with its patcher's backups: the original of each weight a LoRA
# patches, which core keeps on the offload device while the patched one is loaded (``patch_weight_to_device``; a
# patcher's clones share its ``backup``: 0.3.75 and upstream model_patcher.py @08d0e510).
_MODELS: weakref.WeakKeyDictionary[torch.nn.Module, dict] = weakref.WeakKeyDictionary()


def track(patcher: ModelPatcher) -> ModelPatcher:
    """Count ``patcher``'s model (a DiT, text encoder or PE the pack made) in ``held_on_host`` while it lives, with
    the originals its LoRA patches keep on the host."""
    _MODELS[patcher.model] = patcher.backup
    return patcher


def held_on_host() -> int:
    """Host RAM the pack's models hold now: their tensors on the CPU, their kept host copies, the originals of their
    LoRA-patched weights and the pinned copies of LoRA factors, each storage once (a tensor subclass counted by its
    inner tensors)."""
    seen: set[int] = set()
    held = 0
    tensors = list(_PINNED.values())
    for model, backup in list(_MODELS.items()):
        kept = (t for module in model.modules() for t in _KEPT.get(module, {}).values())  # its layers' too
        tensors += [*model.parameters(), *model.buffers(), *kept, *(saved.weight for saved in list(backup.values()))]
    for tensor in (inner for t in tensors for inner in plain_tensors(t)):
        if tensor.device.type != "cpu" or tensor.untyped_storage().data_ptr() in seen:
            continue
        seen.add(tensor.untyped_storage().data_ptr())
        held += tensor.untyped_storage().nbytes()
    return held


def before_unload(model: torch.nn.Module, device: torch.device) -> None:
    """Before core unloads ``model`` to ``device`` (its offload device): the weights whose host copy is kept point
    at it again, so core's move has nothing left to copy for them; a model without one is marked to keep it from
    its next load on."""
    kept = _KEPT.get(model)
    if kept is None:
        _UNLOADED.add(model)
        return
    with torch.inference_mode(False):
        for name, buffer in list(model.named_buffers()):
            host = kept.get(name)
            if host is not None and buffer.device != host.device and host.device == torch.device(device):
                comfy.utils.set_attr(model, name, host)
        for name, parameter in list(model.named_parameters()):
            host = kept.get(name)
            if host is None or parameter.device == host.device or host.device != torch.device(device):
                continue
            if type(parameter.data) is torch.Tensor and torch._has_compatible_shallow_copy_type(parameter, host):
                parameter.data = host  # the same Parameter: what holds it (a compiled PE step) sees the move
            else:  # a new Parameter around it, as torch's own moves make for a tensor subclass or the meta device
                comfy.utils.set_attr_param(model, name, host)


def before_load(model: torch.nn.Module) -> int:
    """Before core loads ``model`` (its weights on the host) again after an unload: keep its host tensors from now
    on, pinned where core's bound allows; the bytes pinned. A model dropped after its unload (read again in another
    form) never pays for this."""
    if model not in _UNLOADED or model in _KEPT:
        return 0
    if spare_host_memory() < 0:  # the host RAM left to the system: the model moves as core moves it
        logging.info("ERNIE-Image: %s keeps no host copy: the host RAM left (%.1f GiB) is the system's",
                     type(model).__name__, psutil.virtual_memory().available / 2**30)
        return 0
    return _keep(model)


def before_layer_move(layer: torch.nn.Module, device: torch.device) -> None:
    """Before core moves ``layer`` to ``device`` by itself: one layer of a model core loads in part, whose host tensors
    never change (a GGUF DiT's layers: a LoRA is added beside the blocks, and core patches a plain weight into a new
    tensor on the device). Where core takes a layer's room for another model and gives it back each prompt
    (``partially_unload`` before the VAE's decode on a small card, then a whole load for sampling), the layer keeps its
    host copy as a whole model does here: from its second load on, pinned, and its later unloads point at it instead of
    copying back (a LoRA-patched GGUF layer's unloads from its third: until then core's backup of the weight holds the
    blocks it loaded before, ``GGUFModelPatcher``). A layer that stays loaded keeps no second copy. Quiet (a model has
    hundreds of layers); where the host RAM left is the system's, it moves as core moves it."""
    if device.type == "cpu":
        before_unload(layer, device)
    elif layer not in _LOADED_ONCE:
        _LOADED_ONCE.add(layer)
    elif layer not in _KEPT and spare_host_memory() >= 0:
        _keep(layer)  # loaded again: core unloaded it in between


def kept_tensor(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """The host copy ``module`` keeps of its tensor ``name``, or None."""
    return _KEPT.get(module, {}).get(name)


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (on the host, never changed: a LoRA's factor) from memory pinned within core's bound, copied
    once and kept while ``tensor`` lives, for a layer that loads it again each prompt; ``tensor`` itself where it
    cannot be (on the GPU, pinned already, not contiguous, past core's bound, or the host RAM left is the
    system's)."""
    copy = _PINNED.get(tensor)
    if copy is not None:
        return copy
    if (tensor.device.type != "cpu" or tensor.is_pinned() or not tensor.is_contiguous()
            or getattr(mm, "MAX_PINNED_MEMORY", 0) <= 0 or spare_host_memory() < 0):
        return tensor
    copy = in_own_pages(tensor)
    if not _core_pins(copy):
        clear_registration_error()
        return tensor
    _PINNED[tensor] = copy
    weakref.finalize(tensor, _unpin, [copy]).atexit = False  # the copy goes with ``tensor``
    return copy


def _keep(model: torch.nn.Module) -> int:
    """Keep ``model``'s host tensors from now on, pinned where core's bound allows; the bytes pinned."""
    kept, pinned = {}, []
    pins = getattr(mm, "MAX_PINNED_MEMORY", 0) > 0
    with torch.inference_mode(False):
        for name, buffer in list(model.named_buffers()):  # a norm's statistics, a rotary table: small, kept as is
            if buffer.device.type == "cpu":
                kept[name] = buffer
        for name, parameter in list(model.named_parameters()):
            if parameter.device.type != "cpu":
                continue
            wrapper = is_traceable_wrapper_subclass(parameter)
            if not pins or not wrapper and parameter.is_pinned():
                kept[name] = parameter.detach()  # another object: core's move may swap the Parameter's contents
                continue
            host, inner = _in_own_pages(parameter.detach())
            pinned += [t for t in inner if _core_pins(t)]
            if wrapper:
                comfy.utils.set_attr_param(model, name, host)
            else:
                parameter.data = host  # the same Parameter
            kept[name] = host
    clear_registration_error()
    _KEPT[model] = kept
    if pinned:
        weakref.finalize(model, _unpin, pinned).atexit = False
    return sum(t.nbytes for t in pinned)


def _core_pins(tensor: torch.Tensor) -> bool:
    """Whether core pinned ``tensor`` (in pages of its own) within its bound. Core registers memory in place, whole
    pages (a tensor sharing a page with another is refused), and in 0.3.75 only what it types as a Parameter."""
    return mm.pin_memory(torch.nn.Parameter(tensor, requires_grad=False))


def _in_own_pages(tensor: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``tensor`` copied into pages of its own, and the plain tensors that hold it (a tensor subclass's inner ones,
    its wrapper made again around their copies)."""
    if not is_traceable_wrapper_subclass(tensor):
        if not tensor.is_contiguous():  # its strides are its layout (a transposed inner weight): kept, not pinned
            return tensor, []
        copy = in_own_pages(tensor)
        return copy, [copy]
    names, context = tensor.__tensor_flatten__()
    inner, plain = {}, []
    for name in names:
        inner[name], held = _in_own_pages(getattr(tensor, name))
        plain += held
    return type(tensor).__tensor_unflatten__(inner, context, tensor.size(), tensor.stride()), plain


def _unpin(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        mm.unpin_memory(tensor)
