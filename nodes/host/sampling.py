"""Core's hooks around a sampling run, its node text, progress and interrupt, as the running core calls them.

Wrappers get ``(executor, *args, **kwargs)`` and pass everything on: core adds keywords across versions (since
v0.6.0 ``prepare_sampling`` hands PREPARE_SAMPLING wrappers ``force_full_load=`` and later ``force_offload=``,
comfy/sampler_helpers.py @53757775), and a wrapper that names its parameters breaks on the next one. A memory
estimate wrapped for a run forwards only the keywords the model's own estimate takes (``memory_efficient_attention``
is new in current cores, whose ``call_model_memory_required`` passes it where the signature allows).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import sys
from collections.abc import Callable, Iterator

import comfy.model_management as mm
import comfy.patcher_extension
import comfy.utils
import torch

from ..errors import ErnieImageError

WrappersMP = comfy.patcher_extension.WrappersMP
SAMPLER_SAMPLE = WrappersMP.SAMPLER_SAMPLE
APPLY_MODEL = WrappersMP.APPLY_MODEL
PREPARE_SAMPLING = WrappersMP.PREPARE_SAMPLING
DIFFUSION_MODEL = WrappersMP.DIFFUSION_MODEL
# What core raises when the user cancels: an Exception on 0.3.75, a BaseException on current cores
# (model_management.py @02b2b388), so generic handlers never swallow it there.
Interrupted = mm.InterruptProcessingException


# Where each wrapper's arguments are, as core calls it: positions (core passes them so today) and names (should a
# core pass one by keyword). KSAMPLER.sample (samplers.py), BaseModel.apply_model (model_base.py) and
# prepare_sampling (sampler_helpers.py), 0.3.75 and @53757775 alike.
SAMPLER_SAMPLE_ARGS = ("guider", "sigmas", "extra_args")
APPLY_MODEL_ARGS = ("x", "t", "c_concat", "c_crossattn", "control", "transformer_options")
PREPARE_SAMPLING_ARGS = ("model", "noise_shape", "conds", "model_options")

# What per-run accelerators keep on the device across steps, for the out-of-memory advice (``oom.sampling_advice``):
# ``{node name: estimate(input_shape, text_tokens) -> bytes}`` in a run's own transformer_options, which core copies
# (shallowly) into every model call's.
RUN_MEMORY = "ernie_image_run_memory"


def wrapper_arguments(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict:
    """A wrapper's arguments by name (after the executor), from positions or keywords."""
    found = dict(zip(names, args, strict=False))
    found.update((name, kwargs[name]) for name in names if name in kwargs)
    return found


def set_wrapper(model, kind: str, key: str, wrapper: Callable | None) -> None:
    """Replace the wrapper of ``kind`` under ``key`` on the patcher ``model`` (None: remove it)."""
    model.remove_wrappers_with_key(kind, key)
    if wrapper is not None:
        model.add_wrapper_with_key(kind, key, wrapper)


def run_diffusion_model(forward: Callable, module: torch.nn.Module, transformer_options: dict, *args, **kwargs):
    """``forward(*args, **kwargs)`` through the DIFFUSION_MODEL wrappers in ``transformer_options``, as core's
    own models run their forward."""
    executor = comfy.patcher_extension.WrapperExecutor.new_class_executor(
        forward, module,
        comfy.patcher_extension.get_all_wrappers(WrappersMP.DIFFUSION_MODEL, transformer_options))
    return executor.execute(*args, **kwargs)


def wrapped_options(kind: str, key: str, wrapper: Callable) -> dict:
    """A model call's transformer_options with ``wrapper`` alone as its ``kind`` wrapper, for a forward run outside
    ComfyUI's sampling (a parallel worker's)."""
    options: dict = {}
    comfy.patcher_extension.add_wrapper_with_key(kind, key, wrapper, options)
    return options


def note_run_memory(transformer_options: dict, name: str, estimate: Callable[[list[int], int], int]) -> None:
    """Say, for this run, that the node ``name`` keeps ``estimate(input_shape, text_tokens)`` bytes across steps.
    A new dict, never the one a copy of the options may share."""
    transformer_options[RUN_MEMORY] = {**transformer_options.get(RUN_MEMORY, {}), name: estimate}


def run_memory(transformer_options: dict) -> dict[str, Callable[[list[int], int], int]]:
    """The estimates ``note_run_memory`` left in a model call's ``transformer_options``, by node name."""
    return dict(transformer_options.get(RUN_MEMORY, {}))


# Per-run changes of the DiT's blocks that the other ranks of a parallel MODEL (``parallel/``) make too, in step
# with this process: cache-dit's cache decision is an all-reduce over the process group, which every rank must
# join. The other ranks are other processes, and only a name and JSON arguments reach them (nothing is unpickled
# there): the feature that owns a change registers its maker under a name when it is imported
# (``register_mirrored_run``; a worker imports the pack's nodes as ComfyUI does, so it has the same makers), and
# ``make(holder, blocks_name, arguments)`` gives an object with ``install()``, ``activate(call, step)`` and
# ``remove()`` (``accel.cache.CacheRun``). In a run's transformer_options, ``{name: arguments}``; and the
# ``(call, step)`` that each model call activated. The key is there from the parallel node on: a run without it
# has no other ranks.
MIRRORED_RUNS, MIRRORED_CALL = "ernie_image_mirrored_runs", "ernie_image_mirrored_call"
_MIRRORED_MAKERS: dict[str, Callable[[torch.nn.Module, str, dict], object]] = {}


def register_mirrored_run(name: str, make: Callable[[torch.nn.Module, str, dict], object]) -> None:
    """Let the other ranks make the per-run change ``name`` as ``make(holder, blocks_name, arguments)``."""
    _MIRRORED_MAKERS[name] = make


def make_mirrored_run(name: str, holder: torch.nn.Module, blocks_name: str, arguments: dict) -> object:
    """On another rank: the per-run change ``name`` that rank 0 noted (``mirror_run``), made by its registered
    maker; an error in words for a name no feature registered here."""
    make = _MIRRORED_MAKERS.get(name)
    if make is None:
        raise ErnieImageError(f"ERNIE-Image Parallel: rank 0 asked for the per-run change {name[:200]!r}, which no "
                              f"feature registered in this worker (known: {sorted(_MIRRORED_MAKERS)}).")
    return make(holder, blocks_name, arguments)


def mirror_runs(transformer_options: dict) -> None:
    """Say that this MODEL's runs have other ranks, which make what ``mirror_run`` notes too."""
    transformer_options[MIRRORED_RUNS] = {}


def mirrored(transformer_options: dict) -> bool:
    """Whether the run has other ranks (``mirror_runs``)."""
    return MIRRORED_RUNS in transformer_options


def mirror_run(transformer_options: dict, name: str, arguments: dict) -> None:
    """Note for the other ranks, if there are any, that this run makes the registered change ``name`` with
    ``arguments`` (JSON: a copy is kept, and what JSON cannot hold fails here). A new dict, never the one a copy
    of the options may share."""
    if mirrored(transformer_options):
        if name not in _MIRRORED_MAKERS:
            raise KeyError(f"no per-run change {name!r} is registered (register_mirrored_run)")
        arguments = json.loads(json.dumps(arguments, allow_nan=False))
        transformer_options[MIRRORED_RUNS] = {**transformer_options[MIRRORED_RUNS], name: arguments}


def mirror_call(transformer_options: dict, call: tuple[int, ...], step: int) -> None:
    """Note, in a model call's own options, the ``(call, step)`` the other ranks activate for it."""
    if mirrored(transformer_options):
        transformer_options[MIRRORED_CALL] = (call, step)


def mirrored_runs(transformer_options: dict) -> tuple[dict, tuple | None]:
    """What ``mirror_run`` and ``mirror_call`` noted in a model call's options."""
    return dict(transformer_options.get(MIRRORED_RUNS, {})), transformer_options.get(MIRRORED_CALL)


def call_accepting(function: Callable, *args, **kwargs):
    """``function(*args, **kwargs)`` without the keywords its signature does not take."""
    parameters = inspect.signature(function).parameters
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        kwargs = {name: value for name, value in kwargs.items() if name in parameters}
    return function(*args, **kwargs)


@contextlib.contextmanager
def memory_estimate_plus(base_model, extra: Callable[[list[int]], int]) -> Iterator[None]:
    """While the block runs, ``base_model``'s memory estimate for an input shape is its own plus ``extra(shape)``
    (the estimate ComfyUI frees memory by before sampling, and reads again for each batch of conds)."""
    estimate = base_model.memory_required

    def with_extra(input_shape, *args, **kwargs):
        return call_accepting(estimate, input_shape, *args, **kwargs) + extra(input_shape)

    base_model.memory_required = with_extra
    try:
        yield
    finally:
        del base_model.memory_required  # the class's own again


def show_on_node(node_id: str | None, text: str) -> None:
    """Show ``text`` on the node in the ComfyUI frontend (when a ComfyUI server runs this process)."""
    server = sys.modules.get("server")  # ComfyUI's server module; absent when the core runs without a server
    instance = getattr(getattr(server, "PromptServer", None), "instance", None)
    if instance is not None and node_id is not None:
        instance.send_progress_text(text, node_id, sid=instance.client_id)  # the client that queued the prompt


def interrupted() -> bool:
    """Whether the user asked ComfyUI to stop the running prompt."""
    return bool(mm.processing_interrupted())


def raise_if_interrupted() -> None:
    """Raise core's interrupt when the user asked to stop."""
    mm.throw_exception_if_processing_interrupted()


def progress_bar(total: int) -> comfy.utils.ProgressBar:
    """Core's progress bar on the running node."""
    return comfy.utils.ProgressBar(total)
