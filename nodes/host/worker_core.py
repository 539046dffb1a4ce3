"""The ComfyUI core of a parallel worker process: the same core as this process, started with the same arguments.

A worker imports ComfyUI's modules itself (it is a fresh Python, ``parallel/pool.py``), and core reads its
arguments when ``comfy.model_management`` and ``folder_paths`` are first imported (the devices, the VRAM mode,
the attention switches, the base directory). So the worker copies this process's arguments into
``comfy.cli_args.args`` before anything else of the core is imported: this module imports nothing more, and
nothing of the pack (the worker loads it by its file, before the host package, which imports model management).

The arguments travel as JSON (the worker unpickles nothing): core's enums (``--preview-method``, ``--fast``'s
features) by their class in ``comfy.cli_args`` and their value, sets as lists.
"""

from __future__ import annotations

import enum
import os

import comfy.cli_args


def core_setup() -> dict:
    """What a worker needs to start this process's core: the core's folder and its parsed arguments (JSON)."""
    return {"folder": os.path.dirname(os.path.dirname(os.path.abspath(comfy.cli_args.__file__))),
            "args": {name: _encode(name, value) for name, value in vars(comfy.cli_args.args).items()}}


def configure_core(setup: dict) -> None:
    """In a worker, before any other core module is imported: this process's arguments as ``setup`` gives them.
    The worker sees only its own GPU (the launcher sets ``CUDA_VISIBLE_DEVICES``), so no device id is copied."""
    args = {name: _decode(value) for name, value in setup["args"].items()}
    vars(comfy.cli_args.args).update(args, cuda_device=None)


def _encode(name: str, value):
    if isinstance(value, enum.Enum):
        return {"enum": type(value).__name__, "value": value.value}
    if isinstance(value, (set, frozenset)):
        return {"set": [_encode(name, item) for item in value]}
    if isinstance(value, (list, tuple)):
        return [_encode(name, item) for item in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"ComfyUI's argument {name} ({type(value).__name__}) cannot be passed to the parallel workers")


def _decode(value):
    if isinstance(value, list):
        return [_decode(item) for item in value]
    if not isinstance(value, dict):
        return value
    if "set" in value:
        return {_decode(item) for item in value["set"]}
    kind = getattr(comfy.cli_args, value["enum"], None)
    if not (isinstance(kind, type) and issubclass(kind, enum.Enum)):
        raise ValueError(f"{value['enum'][:200]!r} is not an enum of comfy.cli_args")
    return kind(value["value"])
