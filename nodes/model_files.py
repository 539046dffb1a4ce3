"""Reading model files (safetensors weights, JSON configs) with errors that name the file and say what to do
(engine: no ComfyUI here).

Only safetensors are ever loaded by the pack: no pickles, no remote code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .errors import ErnieImageError

P = ParamSpec("P")
R = TypeVar("R")


def builds_weights(function: Callable[P, R]) -> Callable[P, R]:
    """Decorates a function that makes model weights: they are made as normal tensors even when it is called inside
    ``torch.inference_mode()``, as ComfyUI runs every node. A parameter made in inference mode whose data a device
    move outside it replaces breaks every later forward ("Inference tensors do not track version counter": every GPU
    user's first sampling step, 2026-12-01); ComfyUI moves models both inside and outside inference mode (``/free``
    between prompts). A normal tensor moves either way."""
    return torch.inference_mode(False)(function)


def _unreadable(path: Path, error: Exception) -> ErnieImageError:
    return ErnieImageError(
        f"Cannot read {path} ({error}). The file is damaged or incomplete (an interrupted download?): "
        "download it again."
    )


def _check_exists(path: Path) -> None:
    if not path.is_file():
        raise ErnieImageError(f"Model file not found: {path}. Put it there or pick another file.")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, or an error that names the file when it cannot be read."""
    _check_exists(path)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e) from e


def _header_keys(path: Path) -> list[str]:
    """The tensor names from the file's header; safetensors checks there that the file is as long as its header
    says, so a truncated file fails here, cheaply, with its name."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e) from e


def safetensors_keys(path: Path) -> list[str]:
    """The tensor names of one safetensors file, from its header alone: a wrong file is refused before gigabytes
    of it are read."""
    _check_exists(path)
    return _header_keys(path)


def read_json(path: Path) -> dict:
    """A JSON config file as a dict, or an error that names the file when it is damaged (a truncated download)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise _unreadable(path, e) from e
    if not isinstance(config, dict):
        raise _unreadable(path, ValueError(f"a JSON {type(config).__name__}, not an object"))
    return config


def check_safetensors_files(folder: Path) -> None:
    """Parse the header of every safetensors file in ``folder``, so that a truncated shard is named here."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ErnieImageError(
            f"No .safetensors weights in {folder}. Download the model's weights (only safetensors are loaded)."
        )
    for f in files:
        _header_keys(f)
