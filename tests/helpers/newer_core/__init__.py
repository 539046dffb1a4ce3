"""Drives the real ComfyUI 0.3.75 core the way current cores call custom nodes (a test tool).

Loaded as a custom node into a test server beside the pack (``tests/test_newer_cores.py``): at import it changes
what ``ERNIE_TEST_NEWER_CORE`` (comma-separated) names, each to what current upstream does, read at the commit
cited (Comfy-Org/ComfyUI). In-process tests apply one change with ``APPLY[name](set_attr)``, ``set_attr`` a monkeypatch
(undone after the test). Nothing here is the pack's; nothing of upstream is copied beyond the calling
conventions a custom node meets.

- ``prepare_sampling``: PREPARE_SAMPLING wrappers get ``force_full_load=`` and ``force_offload=`` keywords
  (comfy/sampler_helpers.py @53757775 ``prepare_sampling``; since v0.6.0).
- ``memory_required``: the sampler asks a model's ``memory_required(shape, cond_shapes=…,
  memory_efficient_attention=…)`` where its signature takes the keyword (comfy/model_patcher.py @53757775
  ``call_model_memory_required``, called by sampler_helpers.py @53757775 ``estimate_memory``), as it does once a
  node set an optimized attention with ``memory_efficient=True``.
- ``no_scaled_fp8``: ``comfy.ops.scaled_fp8_ops`` is gone (comfy/ops.py @0271a469).
- ``dynamic``: loaders build models on ``comfy.model_patcher.CoreModelPatcher``, which current cores' ``main.py``
  makes ``ModelPatcherDynamic`` on NVIDIA GPUs (main.py @02018c7e): ``is_dynamic()`` is true, and
  ``clone(disable_dynamic=True)`` gives a classic ModelPatcher over the model loaded again through
  ``cached_patcher_init`` (model_patcher.py @08d0e510). The weights' streaming itself (comfy-aimdo) needs a GPU
  and is not reproduced.
- ``ernie_image``: ``comfy.model_base.ErnieImage`` exists (model_base.py @53757775) and core's LoRA key map adds
  ``transformer.<layer>`` names for its instances (comfy/lora.py @17358c8f ``model_lora_keys_unet``).
"""

from __future__ import annotations

import inspect
import math
import os

import comfy.lora
import comfy.model_base
import comfy.model_patcher
import comfy.ops
import comfy.patcher_extension
import comfy.sampler_helpers

NODE_CLASS_MAPPINGS: dict = {}
CHANGES = {name.strip() for name in os.environ.get("ERNIE_TEST_NEWER_CORE", "").split(",") if name.strip()}


def _prepare_sampling_with_flags(set_attr=setattr) -> None:
    helpers = comfy.sampler_helpers
    inner = helpers._prepare_sampling

    def _prepare_sampling(model, noise_shape, conds, model_options=None, force_full_load=False,
                          force_offload=False):
        return inner(model, noise_shape, conds, model_options=model_options)

    def prepare_sampling(model, noise_shape, conds, model_options=None, force_full_load=False, force_offload=False):
        executor = comfy.patcher_extension.WrapperExecutor.new_executor(
            _prepare_sampling, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.PREPARE_SAMPLING, model_options, is_model_options=True))
        return executor.execute(model, noise_shape, conds, model_options=model_options,
                                force_full_load=force_full_load, force_offload=force_offload)

    set_attr(helpers, "_prepare_sampling", _prepare_sampling)
    set_attr(helpers, "prepare_sampling", prepare_sampling)


def _memory_required_with_attention_profile(set_attr=setattr) -> None:
    base = comfy.model_base.BaseModel
    legacy = base.memory_required

    def memory_required(self, input_shape, cond_shapes={}, memory_efficient_attention=None):
        PROFILES_SEEN.append(memory_efficient_attention)  # upstream picks its formula by it
        return legacy(self, input_shape, cond_shapes=cond_shapes)

    def call_model_memory_required(model, *args, memory_efficient_attention=None, **kwargs):
        parameters = inspect.signature(model.memory_required).parameters
        takes = "memory_efficient_attention" in parameters or any(
            p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        if memory_efficient_attention is not None and takes:
            kwargs["memory_efficient_attention"] = memory_efficient_attention
        return model.memory_required(*args, **kwargs)

    def estimate_memory(model, noise_shape, conds):
        cond_shapes, cond_shapes_min = {}, {}
        for _, cs in conds.items():
            for cond in cs:
                for k, v in model.model.extra_conds_shapes(**cond).items():
                    cond_shapes.setdefault(k, []).append(v)
                    if cond_shapes_min.get(k, None) is None:
                        cond_shapes_min[k] = [v]
                    elif math.prod(v) > math.prod(cond_shapes_min[k][0]):
                        cond_shapes_min[k] = [v]
        shape = list(noise_shape)
        needed = call_model_memory_required(model.model, [shape[0] * 2, *shape[1:]], cond_shapes=cond_shapes,
                                            memory_efficient_attention=True)
        minimum = call_model_memory_required(model.model, shape, cond_shapes=cond_shapes_min,
                                             memory_efficient_attention=True)
        return needed, minimum

    set_attr(base, "memory_required", memory_required)
    set_attr(comfy.model_patcher, "call_model_memory_required", call_model_memory_required)
    set_attr(comfy.sampler_helpers, "estimate_memory", estimate_memory)


class DynamicStandIn(comfy.model_patcher.ModelPatcher):
    """Current cores' dynamic patcher as a custom node meets it: ``is_dynamic()`` and the demoting clone."""

    def is_dynamic(self) -> bool:
        return True

    def clone(self, disable_dynamic=False, model_override=None, force_deepcopy=False):
        n = super().clone()
        if disable_dynamic:
            if self.cached_patcher_init is None:
                raise RuntimeError("Cannot create non-dynamic delegate: cached_patcher_init is not initialized.")
            fresh = self.cached_patcher_init[0](*self.cached_patcher_init[1], disable_dynamic=True)
            n.__class__ = comfy.model_patcher.ModelPatcher
            n.model, n.size = fresh.model, 0
        return n


def _dynamic_patcher(set_attr=setattr) -> None:
    set_attr(comfy.model_patcher.ModelPatcher, "cached_patcher_init", None)  # upstream sets it in __init__
    set_attr(comfy.model_patcher, "CoreModelPatcher", DynamicStandIn)


def _native_ernie_image(set_attr=setattr) -> None:
    class ErnieImage(comfy.model_base.BaseModel):
        def __init__(self, model_config, model_type=comfy.model_base.ModelType.FLOW, device=None):
            super().__init__(model_config, model_type, device=device)

    set_attr(comfy.model_base, "ErnieImage", ErnieImage)
    keys_unet = comfy.lora.model_lora_keys_unet

    def model_lora_keys_unet(model, key_map={}):
        key_map = keys_unet(model, key_map)
        if isinstance(model, comfy.model_base.ErnieImage):
            for k in model.state_dict().keys():
                if k.startswith("diffusion_model.") and k.endswith(".weight"):
                    key_map["transformer.{}".format(k[len("diffusion_model."):-len(".weight")])] = k
        return key_map

    set_attr(comfy.lora, "model_lora_keys_unet", model_lora_keys_unet)


def _no_scaled_fp8(set_attr=setattr) -> None:
    set_attr(comfy.ops, "scaled_fp8_ops", None)  # what a lookup of the removed name finds, to the pack


PROFILES_SEEN: list = []  # the attention profiles the model's own estimate was given (``memory_required``)
APPLY = {"prepare_sampling": _prepare_sampling_with_flags, "memory_required": _memory_required_with_attention_profile,
         "no_scaled_fp8": _no_scaled_fp8, "dynamic": _dynamic_patcher, "ernie_image": _native_ernie_image}
unknown = CHANGES - set(APPLY)
if unknown:
    raise ValueError(f"ERNIE_TEST_NEWER_CORE names {sorted(unknown)}; known: {sorted(APPLY)}")
for change in sorted(CHANGES):
    APPLY[change]()
