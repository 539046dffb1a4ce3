"""A whole-loaded model that ComfyUI unloads between prompts keeps its weights' host copy, pinned.

Core unloads a model by copying its weights back to the offload device (``ModelPatcher.unpatch_model``:
``self.model.to(offload_device)``, 0.3.75 and upstream model_patcher.py @08d0e510) into new pageable memory, and
loads it again from there: both ways over the link at the pageable rate (on the H200 5.5 GB/s against 52 pinned).
The PE and the text encoder hold the same weights for their whole life (no patches: ``WholeModelPatcher`` refuses
them), so once core has unloaded one of them (it is loaded per prompt), its host tensors stay: pinned within core's
bound (``model_management.pin_memory``), the next load copies from them at the pinned rate, and each later unload
points the weights at them again instead of copying back. A model core never unloads keeps no second copy.
"""

from __future__ import annotations

import weakref

import comfy.model_management as mm
import comfy.utils
import torch

from .streaming import clear_registration_error, in_own_pages

_KEPT: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()
_UNLOADED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # unloaded by core once: loaded per prompt


def _plain(model: torch.nn.Module):
    """The parameters a host copy can stand in for: plain tensors (a tensor subclass moves as core moves it)."""
    return ((name, p) for name, p in model.named_parameters() if type(p.data) is torch.Tensor)


def before_unload(model: torch.nn.Module, device: torch.device) -> None:
    """Before core unloads ``model`` to ``device`` (its offload device): the weights whose host copy is kept point
    at it again, so core's move has nothing left to copy for them; a model without one is marked to keep it from
    its next load on."""
    kept = _KEPT.get(model)
    if kept is None:
        _UNLOADED.add(model)
        return
    with torch.inference_mode(False):
        for name, parameter in _plain(model):
            host = kept.get(name)
            if host is None or parameter.device == host.device or host.device != torch.device(device):
                continue
            if torch._has_compatible_shallow_copy_type(parameter, host):
                parameter.data = host  # the same Parameter: what holds it (a compiled PE step) sees the move
            else:  # as torch's own moves do between such types (the meta device)
                comfy.utils.set_attr_param(model, name, host)


def before_load(model: torch.nn.Module) -> int:
    """Before core loads ``model`` (its weights on the host) again after an unload: keep its host tensors from now
    on, pinned where core's bound allows; the bytes pinned. A model dropped after its unload (read again in another
    form) never pays for this."""
    if model not in _UNLOADED or model in _KEPT:
        return 0
    kept, pinned = {}, []
    with torch.inference_mode(False):
        for name, parameter in _plain(model):
            if parameter.device.type != "cpu":
                continue
            if getattr(mm, "MAX_PINNED_MEMORY", 0) > 0 and not parameter.is_pinned():
                # Core registers memory in place, whole pages: a tensor sharing a page with another is refused.
                parameter.data = in_own_pages(parameter.data)
                if mm.pin_memory(parameter):
                    pinned.append(parameter.data)
            kept[name] = parameter.data
    clear_registration_error()
    _KEPT[model] = kept
    if pinned:
        weakref.finalize(model, _unpin, pinned).atexit = False
    return sum(t.nbytes for t in pinned)


def _unpin(tensors: list[torch.Tensor]) -> None:
    for tensor in tensors:
        mm.unpin_memory(tensor)
