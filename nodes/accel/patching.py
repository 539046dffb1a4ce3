"""The accelerators on a ComfyUI MODEL, per sampling run (ComfyUI adapter).

A MODEL→MODEL node clones the ModelPatcher, but a clone shares the torch module, so nothing may stay patched
into it between runs. The nodes therefore only record their settings in the clone's ``model_options`` and add
wrappers (the pattern of core's EasyCache node):

- ``SAMPLER_SAMPLE`` (around one sampling run's loop, after ComfyUI loaded the model): installs cache-dit's hooks
  or the compiled blocks, with that run's real step count (from its sigmas), and removes them in ``finally`` —
  after success, error or interrupt;
- ``APPLY_MODEL`` (around each model call, cache only): selects the cache context for the call's
  ``cond_or_uncond`` at the step that the call's sigma belongs to;
- ``PREPARE_SAMPLING`` (around ComfyUI's loading for a run, cache only): adds what cache-dit keeps across steps
  to the memory ComfyUI frees for sampling (where that exceeds ComfyUI's own floor for it, 1.2 GiB).

A graph without the node has neither wrapper, so a bypassed or deleted node leaves nothing behind. No state
lives outside the clone's options and the run's own objects.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..compile_clock import CompileClock
from ..errors import ErnieImageError
from ..host.memory import dtype_size
from ..host.model import dit_blocks
from ..host.patchers import can_demote, is_dynamic
from ..host.sampling import (
    APPLY_MODEL,
    APPLY_MODEL_ARGS,
    PREPARE_SAMPLING,
    PREPARE_SAMPLING_ARGS,
    SAMPLER_SAMPLE,
    SAMPLER_SAMPLE_ARGS,
    memory_estimate_plus,
    mirror_call,
    mirror_run,
    mirrored,
    note_run_memory,
    register_mirrored_run,
    set_wrapper,
    show_on_node,
    wrapper_arguments,
)
from .cache import CacheRun, check_block_count, step_index, stored_streams
from .cache_presets import CacheSettings
from .compile import RegionalCompile, compile_problem, compile_settings, compiles_by_default, fp8_cast_problem

log = logging.getLogger(__name__)
CACHE_KEY, COMPILE_KEY = "ernie_image_cache_dit", "ernie_image_compile"
RUN_KEY = "ernie_image_cache_dit_run"
OFF = "off"  # the compile node's mode that turns compilation off


@dataclass(frozen=True)
class CacheJob:
    """What an ErnieImageCacheDiT node asked for (kept in the clone's model_options, copied with it)."""

    settings: CacheSettings
    label: str  # the preset's name, for the summary
    node_id: str | None  # where the summary is shown in the UI


def _cache_sampler_sample(executor, *args, **kwargs):
    # KSAMPLER.sample(guider, sigmas, extra_args, callback, noise, ...), after the model was loaded
    call = wrapper_arguments(SAMPLER_SAMPLE_ARGS, args, kwargs)
    guider, sigmas = call["guider"], call["sigmas"]
    transformer_options = call["extra_args"]["model_options"]["transformer_options"]  # this run's own copy
    job: CacheJob = transformer_options[CACHE_KEY]
    if dist.is_available() and dist.is_initialized() and not mirrored(transformer_options):
        # cache-dit takes its decision with every rank of the process group (an all-reduce), which would wait
        # forever for ranks that do not run this MODEL.
        raise ErnieImageError(
            "This Cache-DiT run would wait forever: ERNIE-Image Parallel's workers are running in this ComfyUI, and "
            "cache-dit takes its cache decision with them. Put the same ERNIE-Image Parallel node on this MODEL "
            "too, or free the workers first (ComfyUI's Unload Models, or a prompt without the Parallel node)."
        )
    holder, blocks_name = dit_blocks(guider.model_patcher)
    run = CacheRun(holder, blocks_name, job.settings, steps=len(sigmas) - 1)
    transformer_options[RUN_KEY] = run  # reached by _cache_apply_model at each model call
    mirror_run(transformer_options, CACHE_KEY, {"settings": dataclasses.asdict(job.settings),  # for a parallel MODEL
                                                 "steps": len(sigmas) - 1})
    # What a step that runs out of memory counts as freed by bypassing the node (host/oom.py).
    note_run_memory(transformer_options, "ERNIE-Image Cache-DiT",
                    functools.partial(cache_store_bytes, holder, guider.model_patcher.model, job.settings))
    try:
        run.install()
        return executor(*args, **kwargs)
    finally:
        run.remove()
        summary = f"Cache-DiT [{job.label}] {run.summary()}"
        log.info("ERNIE-Image %s", summary)
        show_on_node(job.node_id, summary)


def _mirrored_cache_run(holder: torch.nn.Module, blocks_name: str, arguments: dict) -> CacheRun:
    """On a parallel worker: the CacheRun that rank 0's run made, from the JSON arguments ``mirror_run`` sent. Every
    field of CacheSettings is given with its own type (a float field may arrive as a whole number)."""
    fields = {field.name: field.type for field in dataclasses.fields(CacheSettings)}
    given, steps = arguments.get("settings"), arguments.get("steps")
    kinds = {"int": (int,), "float": (int, float), "str": (str,)}
    if (set(arguments) != {"settings", "steps"} or not isinstance(given, dict) or set(given) != set(fields)
            or any(isinstance(v, bool) or not isinstance(v, kinds.get(fields[k], ())) for k, v in given.items())
            or isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ErnieImageError(f"ERNIE-Image Parallel: the Cache-DiT settings from rank 0 are not CacheSettings' "
                              f"fields {sorted(fields)} and a step count: {str(arguments)[:200]}")
    return CacheRun(holder, blocks_name, CacheSettings(**given), steps=steps)


register_mirrored_run(CACHE_KEY, _mirrored_cache_run)  # what a parallel worker makes for a Cache-DiT run


def _cache_apply_model(executor, *args, **kwargs):
    # BaseModel.apply_model(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs)
    call = wrapper_arguments(APPLY_MODEL_ARGS, args, kwargs)
    sigma, transformer_options = call["t"], call["transformer_options"]
    run: CacheRun | None = transformer_options.get(RUN_KEY)
    if run is not None:
        step = step_index(transformer_options["sample_sigmas"], float(sigma[0]))
        call = tuple(transformer_options.get("cond_or_uncond", ()))
        run.activate(call, step)
        mirror_call(transformer_options, call, step)
    return executor(*args, **kwargs)


def _cache_prepare_sampling(executor, *args, **kwargs):
    # ComfyUI frees room for sampling by the model's memory_required, which knows nothing of cache-dit's stores
    # (0.33 GiB for a CFG step at 1024² with TaylorSeer 1). For this load only, they count: ComfyUI's cond batching
    # reads the estimate again at every step, when the stores already hold their memory. Core's own arguments
    # (model_options=, and force_full_load= / force_offload= since v0.6.0) pass through as they came.
    call = wrapper_arguments(PREPARE_SAMPLING_ARGS, args, kwargs)
    model, conds = call["model"], call["conds"]
    job: CacheJob = call["model_options"]["transformer_options"][CACHE_KEY]
    holder, _ = dit_blocks(model)
    text = max((c["cross_attn"].shape[1] for cs in conds.values() for c in cs if "cross_attn" in c), default=0)
    with memory_estimate_plus(model.model, lambda shape: cache_store_bytes(holder, model.model, job.settings,
                                                                            shape, text)):
        return executor(*args, **kwargs)


def cache_store_bytes(holder: torch.nn.Module, base, settings: CacheSettings, input_shape: list[int],
                       text_tokens: int) -> int:
    """The bytes cache-dit keeps across steps for a batch of latent ``input_shape`` with ``text_tokens`` of text:
    ``stored_streams`` tensors shaped like the blocks' stream, in the dtype the DiT computes in (``base``: its
    BaseModel)."""
    embedder = holder.x_embedder.proj  # the pack's DiT and ComfyUI's native one: a patch_size conv to the width
    tokens = math.prod(input_shape[2:]) // math.prod(embedder.kernel_size) + text_tokens
    element = dtype_size(base.manual_cast_dtype or base.get_dtype())
    return stored_streams(settings) * input_shape[0] * tokens * embedder.out_channels * element


def apply_cache(model, job: CacheJob):
    """A clone of ``model`` that samples with Cache-DiT (a later cache node in a chain replaces an earlier one)."""
    holder, blocks_name = dit_blocks(model)
    check_block_count(job.settings, len(getattr(holder, blocks_name)))
    model = model.clone()
    model.model_options.setdefault("transformer_options", {})[CACHE_KEY] = job
    wrappers = ((SAMPLER_SAMPLE, _cache_sampler_sample), (APPLY_MODEL, _cache_apply_model),
                (PREPARE_SAMPLING, _cache_prepare_sampling))
    for wrapper_type, wrapper in wrappers:
        set_wrapper(model, wrapper_type, CACHE_KEY, wrapper)
    return model


def _compile_sampler_sample(executor, *args, **kwargs):
    call = wrapper_arguments(SAMPLER_SAMPLE_ARGS, args, kwargs)
    patcher, extra_args = call["guider"].model_patcher, call["extra_args"]
    holder, blocks_name = dit_blocks(patcher)
    blocks = getattr(holder, blocks_name)
    mode = extra_args["model_options"]["transformer_options"][COMPILE_KEY]
    device = torch.device(patcher.load_device)
    regional = RegionalCompile(blocks, mode, device)
    fp8 = fp8_cast_problem(blocks, device)
    _announce_compile()
    try:
        compiled = 0 if is_dynamic(patcher) or fp8 else regional.install()
        _say_compiled(compiled, len(blocks), is_dynamic(patcher), fp8)
        with compile_settings(), CompileClock() as clock:
            result = executor(*args, **kwargs)
    finally:
        regional.remove()
    if clock.new_graphs:
        log.info("ERNIE-Image: this sampling run compiled %d new graph(s) of the DiT's blocks and took %.1f s with "
                 "them (once per process and shape; inductor's cache on disk shortens it after a restart)",
                 clock.new_graphs, clock.seconds)
    return result


def _say_compiled(compiled: int, blocks: int, dynamic: bool, fp8: str | None = None) -> None:
    if fp8:
        why = fp8
    elif dynamic:
        why = ("ComfyUI's dynamic VRAM streams this MODEL's weights layer by layer. An ERNIE-Image Compile node "
               "before the sampler gives it a copy ComfyUI keeps on the GPU (as ComfyUI's own compile node does), "
               "or start ComfyUI with --disable-dynamic-vram")
    elif compiled < blocks:
        why = ("the others run eager: their weights stream from the CPU (ComfyUI loaded the DiT in part), or a GGUF "
               "layer of theirs takes a LoRA adapter core applies at each call (LoHa, LoKr, DoRA, a diff)")
    else:
        why = ""
    level = logging.WARNING if dynamic or fp8 else logging.INFO
    log.log(level, "ERNIE-Image: compiled %d of %d DiT blocks%s", compiled, blocks, f": {why}" if why else "")


@functools.cache  # once per process
def _announce_compile() -> None:
    log.info("ERNIE-Image: compiling the DiT's blocks on this first run (once per process and batch size); "
             "an ERNIE-Image Compile node with mode 'off' turns compilation off")


def _set_compile(model, mode: str) -> None:
    options = model.model_options.setdefault("transformer_options", {})
    if mode == OFF:
        options.pop(COMPILE_KEY, None)
    else:
        options[COMPILE_KEY] = mode
    set_wrapper(model, SAMPLER_SAMPLE, COMPILE_KEY, None if mode == OFF else _compile_sampler_sample)


def apply_compile(model, mode: str):
    """A clone of ``model`` whose blocks are compiled for each sampling run in ``mode`` (``off``: not compiled,
    also where the loader compiles by default); a clear error where compile cannot run on the model's device.

    A MODEL that ComfyUI streams with dynamic VRAM is demoted first, as core's own compile node does
    (``clone(disable_dynamic=True)``: core loads the model again for a patcher that keeps it on the GPU)."""
    dit_blocks(model)
    problem = None if mode == OFF else compile_problem(torch.device(model.load_device))
    if problem is not None:
        raise ErnieImageError(problem)
    demote = mode != OFF and can_demote(model)
    model = model.clone(disable_dynamic=True) if demote else model.clone()
    _set_compile(model, mode)
    return model


def compile_by_default(model):
    """The pack's default fast path: a freshly loaded ``model`` (changed in place) compiles its blocks for each run
    where ``compiles_by_default`` says it is safe; elsewhere it stays eager."""
    if compiles_by_default(torch.device(model.load_device)):
        _set_compile(model, "default")
    return model
