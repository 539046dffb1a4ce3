"""A parallel DiT on a ComfyUI MODEL (ComfyUI adapter): rank 0's wrappers, and the one pool of workers.

The node clones the MODEL and records what it asked for in the clone's ``model_options``, with two wrappers:

- ``SAMPLER_SAMPLE`` (around one sampling run, after ComfyUI loaded the model): starts the workers when none run for
  this MODEL (its loader's recipe, its LoRA patches and the GPU count) and tells them when the run ends;
- ``DIFFUSION_MODEL`` (around each DiT forward): sends the workers the inputs and runs this rank's share
  (``split.split_forward``); the workers run the same wrapper function around their own DiT (``worker.py``).

The workers are a resource of the process, like the GPUs they hold, so one pool serves whichever MODEL samples
(a MODEL with another recipe, patches or GPU count replaces it). It stops on ``/free`` or when ComfyUI unloads the
DiT, when ComfyUI unloads a worker's memory entry (``host.parallel.WorkerMemory``) to make room, when no parallel
MODEL is left (ComfyUI dropped the node's output: the next prompt does not use it), and after a failure. A graph
without the node has no wrapper; a worker pool left from an earlier prompt stops with the node's MODEL.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from dataclasses import dataclass

import torch

from ..errors import ErnieImageError
from ..host.model import dit_blocks
from ..host.parallel import WorkerMemory, load_for_run, loader_recipe, on_unload
from ..host.sampling import (
    DIFFUSION_MODEL,
    SAMPLER_SAMPLE,
    SAMPLER_SAMPLE_ARGS,
    interrupted,
    mirror_runs,
    mirrored_runs,
    raise_if_interrupted,
    set_wrapper,
    wrapper_arguments,
)
from ..host.sizes import module_bytes
from ..host.worker_core import core_setup
from .messages import END_RUN, encode, forward_job
from .pool import WorkerPool, worker_gpus
from .split import Split, split_forward

log = logging.getLogger(__name__)
KEY = "ernie_image_parallel"
RUN_KEY = "ernie_image_parallel_run"  # which sampling run a forward belongs to (the workers follow its changes)


@dataclass(frozen=True)
class ParallelJob:
    """What an ErnieImageParallel node asked for (kept in the clone's model_options, copied with it)."""

    mode: str
    gpus: int


@dataclass
class _Workers:
    key: tuple
    pool: WorkerPool
    memory: list[WorkerMemory]


_current: _Workers | None = None
_users = 0  # parallel MODELs alive: the workers stop when the last is gone
_runs = itertools.count(1)


def split_call(split: Split, executor, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
               text_lens: list[int], transformer_options: dict, **kwargs) -> torch.Tensor:
    """A DIFFUSION_MODEL wrapper's body on every rank: this rank's share of the forward, the whole output back."""
    forward = functools.partial(_call_on, executor, transformer_options, kwargs)
    return split_forward(forward, executor.class_obj, split, x, timestep, context, text_lens)


def _call_on(executor, transformer_options, kwargs, x, timestep, context, text_lens):
    return executor(x, timestep, context, text_lens, transformer_options, **kwargs)


def _parallel_diffusion_model(executor, x, timestep, context, text_lens, transformer_options, **kwargs):
    if RUN_KEY not in transformer_options:  # a forward outside a sampling run (no workers started for it)
        return executor(x, timestep, context, text_lens, transformer_options, **kwargs)
    job: ParallelJob = transformer_options[KEY]
    runs, call = mirrored_runs(transformer_options)
    tensors = [x, timestep, context]
    message = forward_job(job.mode, tensors, text_lens, transformer_options[RUN_KEY], runs, call)
    pool = _current.pool
    try:
        pool.share(message, tensors)
        return split_call(Split(job.mode, 0, job.gpus), executor, x, timestep, context, text_lens,
                          transformer_options, **kwargs)
    except BaseException as error:
        worker_error = pool.failure()
        if worker_error is not None:
            raise worker_error from error
        raise


def _parallel_sampler_sample(executor, *args, **kwargs):
    call = wrapper_arguments(SAMPLER_SAMPLE_ARGS, args, kwargs)
    transformer_options = call["extra_args"]["model_options"]["transformer_options"]  # this run's own copy
    pool = _workers(call["guider"].model_patcher, transformer_options[KEY])
    transformer_options[RUN_KEY] = next(_runs)
    try:
        return executor(*args, **kwargs)
    finally:
        if pool.alive:
            pool.share(encode({"kind": END_RUN}), [])


def _workers(patcher, job: ParallelJob) -> WorkerPool:
    """The running pool for ``patcher`` and ``job``, started (after the one before it stopped) where none runs."""
    global _current
    recipe = loader_recipe(patcher)
    key = (recipe, patcher.patches_uuid, job.gpus)
    if _current is not None and _current.key == key and _current.pool.alive:
        load_for_run(_current.memory)
        return _current.pool
    if _current is not None and _current.pool.exits("since the last run"):
        log.warning("%s", _current.pool.exits("since the last run"))
    stop_workers()
    device = torch.device(patcher.load_device)
    gpus = worker_gpus(device, job.gpus, torch.cuda.device_count())
    pool = WorkerPool(job.gpus, device, gpus, core_setup(), {"recipe": recipe, "patches": patcher.patches})
    size = module_bytes(dit_blocks(patcher)[0])
    memory = [WorkerMemory(size, device if gpu is None else torch.device("cuda", gpu), stop_workers) for gpu in gpus]
    _current = _Workers(key, pool, memory)  # the entries of the pool before are dropped here, outside core's unloading
    load_for_run(memory)  # ComfyUI makes room on the workers' GPUs before they load
    try:
        started = pool.start(interrupted)
    finally:
        if not pool.alive:
            stop_workers()
    if not started:
        raise_if_interrupted()
    return pool


def stop_workers() -> None:
    """Stop the running workers, if any (their memory entries then count nothing)."""
    if _current is not None:
        _current.pool.stop()
        for entry in _current.memory:
            entry.release()


def _user_gone() -> None:
    global _users
    _users -= 1
    if _users == 0:
        stop_workers()


def apply_parallel(model, mode: str, gpus: int):
    """A clone of ``model`` whose DiT forwards run on ``gpus`` ranks in ``mode`` (``split.MODES``); a clear error
    for a MODEL no ERNIE-Image loader made, and for GPUs or heads that do not fit."""
    global _users
    holder, _ = dit_blocks(model)
    if loader_recipe(model) is None:
        raise ErnieImageError("ERNIE-Image Parallel starts its workers from the loader's recipe: connect the MODEL "
                              "of an ERNIE-Image loader (ErnieImageLoader or ErnieImageDiTLoader); LoRA loaders "
                              "between them are fine.")
    worker_gpus(torch.device(model.load_device), gpus, torch.cuda.device_count())
    heads = holder.layers[0].self_attention.heads
    if heads % gpus:
        raise ErnieImageError(f"ERNIE-Image Parallel splits the DiT's {heads} attention heads evenly across the GPUs: "
                              f"use a GPU count that divides {heads}.")
    model = model.clone()
    transformer_options = model.model_options.setdefault("transformer_options", {})
    transformer_options[KEY] = ParallelJob(mode, gpus)
    mirror_runs(transformer_options)
    set_wrapper(model, SAMPLER_SAMPLE, KEY, _parallel_sampler_sample)
    set_wrapper(model, DIFFUSION_MODEL, KEY, _parallel_diffusion_model)
    on_unload(model, stop_workers)
    _users += 1
    weakref.finalize(model, _user_gone)
    return model
