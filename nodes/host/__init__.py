"""The host layer: every use of ComfyUI's internals, adapting to the running core by feature detection.

The rest of the pack reaches ComfyUI only through these modules or through the V3 API (``comfy_api``) and
``folder_paths``. What each module adapts (0.3.75 against current cores) is listed in ``docs/comfyui-compat.md``;
versions are never parsed, only features looked up (``hasattr``, signatures).

- ``patchers``: the ModelPatcher classes (core's dynamic one where the core has it, whole-model loading for foreign
  modules), device moves outside inference mode, the out-of-memory error;
- ``oom``: the state at an out-of-memory error (free memory, the models ComfyUI holds and their choices), for the
  advice ``memory_advice`` words;
- ``memory``: free memory, dtypes and devices as ComfyUI counts and chooses them, the RAM-pressure cache's sizes;
- ``sampling``: wrappers and the memory estimate around sampling runs, the node text, progress and interrupts;
- ``ops``: which ``comfy.ops`` layers hold the DiT's weights, quantized file layouts included;
- ``model``: the core base classes the DiT's MODEL is made of (``model_base.ErnieImage`` where it exists), and
  the DiT's blocks inside a MODEL;
- ``attention``: which of core's attention switches the DiT follows;
- ``vae``, ``lora``: core's VAE and LoRA machinery.
- ``probe``: what each model's forms cost on this GPU, measured once on synthetic layers and kept in ComfyUI's
  user folder (``plan/costs``).
"""

import sys

from .. import cancel


def _interrupt_if_asked() -> None:
    # Core's model management, where this process has imported it (a ComfyUI), raises its interrupt when the user
    # pressed Cancel. It is looked up, not imported: engines import this package (``sizes``) without a core, and a
    # parallel worker must set core's arguments before core's modules are first imported (``worker_core``).
    model_management = sys.modules.get("comfy.model_management")
    if model_management is not None:
        model_management.throw_exception_if_processing_interrupted()


cancel.install(_interrupt_if_asked)  # the engine's loops stop on Cancel
