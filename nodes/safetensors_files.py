"""Reading safetensors files with errors that name the file and say what to do (engine: no ComfyUI here).

Only safetensors are ever loaded by the pack: no pickles, no remote code.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .errors import ErnieImageError


def _unreadable(path: Path, error: Exception) -> ErnieImageError:
    return ErnieImageError(
        f"Cannot read {path} ({error}). The file is damaged or incomplete (an interrupted download?): "
        "download it again."
    )


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, or an error that names the file when it cannot be read."""
    if not path.is_file():
        raise ErnieImageError(f"Model file not found: {path}. Put it there or pick another file.")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e) from e


def check_safetensors_files(folder: Path) -> None:
    """Parse the header of every safetensors file in ``folder``: safetensors checks there that the file is
    as long as its header says, so a truncated shard fails here, cheaply, with its name."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ErnieImageError(
            f"No .safetensors weights in {folder}. Download the model's weights (only safetensors are loaded)."
        )
    for f in files:
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except (SafetensorError, OSError) as e:
            raise _unreadable(f, e) from e
