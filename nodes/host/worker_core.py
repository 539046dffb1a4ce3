"""The ComfyUI core of a parallel worker process: the same core as this process, started with the same arguments.

A worker imports ComfyUI's modules itself (it is a fresh Python, ``parallel/pool.py``), and core reads its
arguments when ``comfy.model_management`` and ``folder_paths`` are first imported (the devices, the VRAM mode,
the attention switches, the base directory). So the worker copies this process's arguments into
``comfy.cli_args.args`` before anything else of the core is imported: this module imports nothing more.
"""

from __future__ import annotations

import os

import comfy.cli_args


def core_setup() -> dict:
    """What a worker needs to start this process's core: the core's folder and its parsed arguments."""
    return {"folder": os.path.dirname(os.path.dirname(os.path.abspath(comfy.cli_args.__file__))),
            "args": dict(vars(comfy.cli_args.args))}


def configure_core(setup: dict) -> None:
    """In a worker, before any other core module is imported: this process's arguments as ``setup`` gives them.
    The worker sees only its own GPU (the launcher sets ``CUDA_VISIBLE_DEVICES``), so no device id is copied."""
    vars(comfy.cli_args.args).update(setup["args"], cuda_device=None)
