"""What a model streamed through the GPU a layer at a time needs from core (``text/streaming.py`` runs it).

- Pinned host memory: core's ModelPatcher pins a weight in place (``pin_weight_to_device``: ``model_management.
  pin_memory``, ``cudaHostRegister``, within core's ``MAX_PINNED_MEMORY``, on NVIDIA and AMD GPUs only) and keeps the
  keys it pinned, unpinning them when it loads or unpatches the model and when the patcher is deleted (0.3.75 and
  upstream model_patcher.py @08d0e510). Core pins only ``Parameter``s (0.3.75; upstream plain tensors too); where a
  weight is not pinned, or a core has no pinning, its copies are pageable: slower, the same result.
- Room on the GPU: core's ``free_memory`` unloads models only until the bytes asked for are free (smart memory), so a
  resident DiT stays where the stream fits beside it (0.3.75; upstream model_management.py @02b2b388).
- Unloading one model: the streamed model must not stay loaded whole from before it was streamed; core's
  ``LoadedModel.model_unload`` is what ``free_memory`` calls on each model it unloads.
"""

from __future__ import annotations

import inspect
import mmap

import comfy.model_management as mm
import comfy.utils
import torch

from .memory import ModelPatcher
from .sizes import tensor_bytes


def pin_weights(patcher: ModelPatcher, keys: list[str]) -> int:
    """Pin the weights of ``patcher``'s model named by ``keys`` in host memory, as core pins offloaded weights; the
    bytes pinned now (0 where core pins nothing: no such GPU, ``--disable-pinned-memory``, its limit reached).

    A weight the pack read from a file is a private map of it (``model_files``). Each is first copied out of the map,
    one at a time, as ComfyUI-GGUF detaches mapped weights before core pins them (nodes.py @76908c11,
    ``GGUFModelPatcher.pin_weight_to_device``): core registers memory it owns, and a failed registration leaves a
    CUDA error that 0.3.75 does not clear (upstream does: ``discard_cuda_async_error``, model_management.py
    @02b2b388). The copy takes host pages of its own (``in_own_pages``), and where core does not clear a failed
    registration's error, it is cleared here before a kernel of the encode would raise it."""
    pin = getattr(patcher, "pin_weight_to_device", None)
    if pin is None or getattr(mm, "MAX_PINNED_MEMORY", 0) <= 0:
        return 0
    before = set(patcher.pinned)
    for key in set(keys) - before:
        weight = comfy.utils.get_attr(patcher.model, key)
        if weight.is_pinned():  # pinned already, as a host copy kept (``host_copy``): streamed from it as it is
            continue
        with torch.inference_mode(False):
            weight.data = in_own_pages(weight.data)
        pin(key)
    clear_registration_error()
    return sum(tensor_bytes(comfy.utils.get_attr(patcher.model, key)) for key in set(patcher.pinned) - before)


def in_own_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` in host pages of its own, its storage starting on the first. CUDA registers whole pages,
    and a range sharing a page with one registered before is refused (``cudaErrorHostMemoryAlreadyRegistered``);
    plain copies were heap neighbours sharing pages. torch's ``is_pinned`` (and with it core's guard against
    registering twice, and a non-blocking copy's choice) reads the storage's first byte: a copy whose storage began
    before its first page read as unpinned once registered (bench/RESULTS.md, session 29). An anonymous map is
    page-aligned and private; it is unmapped when the tensor is freed."""
    pages = torch.frombuffer(mmap.mmap(-1, max(tensor.nbytes, 1)), dtype=torch.uint8)
    return pages[:tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)


def clear_registration_error() -> None:
    """Take the error a refused ``cudaHostRegister`` leaves behind, as upstream's ``discard_cuda_async_error`` does
    after each failure (a kernel, which raises it, and a wait), where the core has none (0.3.75): else the next
    kernel raises it, in the encode."""
    device = mm.get_torch_device()
    if hasattr(mm, "discard_cuda_async_error") or device.type != "cuda":
        return
    try:
        torch.ones(1, dtype=torch.uint8, device=device).add_(1)
        torch.cuda.synchronize(device)
    except RuntimeError:  # the refused registration's error (torch.AcceleratorError is a RuntimeError)
        pass


def unpin_weights(patcher: ModelPatcher) -> None:
    """Unpin what ``pin_weights`` pinned."""
    unpin = getattr(patcher, "unpin_all_weights", None)
    if unpin is not None:
        unpin()


def make_room(size: int, device: torch.device) -> None:
    """Unload models from ``device`` until ``size`` bytes and core's reserve (``--reserve-vram``) are free there, as
    core makes room before a load; nothing on the CPU."""
    if device.type != "cpu":
        # Current cores count dynamic models' pages as room when asked (``for_dynamic``, model_management.py
        # @02b2b388): a resident classic model is then unloaded only when they are not enough.
        dynamic = {"for_dynamic": True} if "for_dynamic" in inspect.signature(mm.free_memory).parameters else {}
        mm.free_memory(size + mm.extra_reserved_memory(), device, **dynamic)


def unload(patcher: ModelPatcher) -> None:
    """Unload ``patcher``'s model from its device if ComfyUI holds it loaded (its weights go to the offload device)."""
    for index, loaded in reversed(list(enumerate(mm.current_loaded_models))):
        if loaded.model is patcher:
            loaded.model_unload()
            mm.current_loaded_models.pop(index)
