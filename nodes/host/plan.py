"""What the memory plan needs from the core: the card as core would give it to models, the flags that fix placement,
core's working-memory rules, and the models core holds.

- Usable memory: what core counts free on the device (its driver view and torch's cache; on current cores also what
  idle dynamic-VRAM models hold), plus what the models it has loaded hold there (core unloads them on demand), less
  its reserve (``--reserve-vram``). Other programs' memory is not free, so it is not counted.
- Placement flags: under ``--gpu-only``, ``--highvram``, ``--lowvram`` or ``--novram`` (and on a device that is not a
  CUDA GPU) core's own placement applies and the pack makes no plan (``placement_fixed``).
- Working memory: core frees ``max(minimum_inference_memory, the step's estimate + reserve)`` before it samples or
  decodes (model_management.load_models_gpu, 0.3.75 and upstream @4e2cf6d6), so a stage's working memory is at least
  core's minimum less the reserve (the reserve is taken off the usable memory already).
"""

from __future__ import annotations

import comfy.cli_args
import comfy.model_management as mm
import torch

from . import host_copy
from .memory import spare_host_memory, usable_memory
from .patchers import core_has_dynamic_vram, is_dynamic

# Core's flags that fix where models go, as its VRAMState says (model_management.py).
PLACEMENT_FLAGS = {"gpu_only": "--gpu-only", "highvram": "--highvram", "lowvram": "--lowvram", "novram": "--novram",
                   "cpu": "--cpu"}


def placement_fixed(device: torch.device) -> str | None:
    """Why core's own placement applies here (a flag, or a device that is not a CUDA GPU); None: the pack plans.
    ``--lowvram`` changes nothing where core streams models with dynamic VRAM (its help says so; core then loads as in
    normal mode: docs/comfyui-compat.md), so the pack plans there."""
    for flag, words in PLACEMENT_FLAGS.items():
        if flag == "lowvram" and core_has_dynamic_vram():
            continue
        if getattr(comfy.cli_args.args, flag, False):
            return words
    if not mm.is_device_cuda(device):
        return f"{device} is not a CUDA GPU"
    return None


def _loaded_on(device: torch.device) -> int:
    """Bytes the models core has loaded hold on ``device`` (core unloads them when another model needs the room).
    Dynamic models' pages are left out: core's free memory counts them already (``ModelPatcher.get_free_memory``,
    model_patcher.py @08d0e510). So is a model whose patcher is gone (``loaded.model`` is a weak reference: None
    where another node leaked the model, which core then neither counts nor unloads: ``free_memory`` skips
    ``is_dead()`` models, model_management.py 0.3.75)."""
    held = 0
    for loaded in mm.current_loaded_models:
        if loaded.model is not None and loaded.device == device and not is_dynamic(loaded.model):
            held += int(loaded.model_loaded_memory())
    return held


def usable_for_models(device: torch.device) -> int:
    """The memory the pack's models and their working memory may take on ``device`` (see the module's words)."""
    return usable_memory(device) + _loaded_on(device)


def total_memory(device: torch.device) -> int:
    """The card's memory as core reads it."""
    return int(mm.get_total_memory(device))


def pinnable() -> int:
    """Host bytes core would still pin (its ``MAX_PINNED_MEMORY`` less what is pinned; 0 where the core does not
    pin, or ``--disable-pinned-memory``), within the host RAM the pack may still take (``spare_host_memory``)."""
    most = getattr(mm, "MAX_PINNED_MEMORY", 0)
    if not most or most <= 0:
        return 0
    return max(min(int(most) - int(getattr(mm, "TOTAL_PINNED_MEMORY", 0)), spare_host_memory()), 0)


def host_room() -> int:
    """Host RAM the graph's models may hold: what the pack may still take (``spare_host_memory``: available RAM less
    what it leaves to the system) and what the pack's models hold there now (a plan places them anew). Models of an
    earlier graph still alive count as room: ComfyUI frees them as its caches let them go."""
    return max(spare_host_memory() + host_copy.held_on_host(), 0)


def working_floor() -> int:
    """The least working memory core frees before a stage, less its reserve (taken off the usable memory already)."""
    return int(mm.minimum_inference_memory()) - int(mm.extra_reserved_memory())


def step_estimate(model_config, latent_shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Core's estimate of a sampling step's memory for a batch of cond and uncond (comfy/samplers.py estimates the
    step at twice the batch; ``BaseModel.memory_required``'s formula for a model without its own)."""
    area = 2 * latent_shape[0] * latent_shape[-2] * latent_shape[-1]
    return int(area * mm.dtype_size(dtype) * 0.01 * model_config.memory_usage_factor * 2**20)
