"""Reading a LoRA file (engine: no ComfyUI): its header first, so that a file of more tensors than any ERNIE-Image
LoRA has is refused before one of them is read."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ErnieImageError
from ..model_files import read_safetensors, safetensors_keys

# A LoRA on every layer of the DiT (36 blocks of 7 linear layers, and a few more) and of the text encoder, in the
# layout with the most tensors per layer (LoKr: up to 9), holds some 4 000 tensors.
MAX_TENSORS = 20_000


def read_lora(path: Path, name: str) -> dict[str, torch.Tensor]:
    """The tensors of the LoRA file at ``path`` (``name``: as the user picked it), its header parsed once; a file
    of more than ``MAX_TENSORS`` tensors is refused in words before any is read."""
    count = len(safetensors_keys(path))
    if count > MAX_TENSORS:
        raise ErnieImageError(
            f"LoRA {name} holds {count} tensors; a LoRA for every layer of ERNIE-Image's DiT and text encoder has "
            f"some 4 000, so this file is not an ERNIE-Image LoRA (at most {MAX_TENSORS} are read). Pick another "
            "LoRA.")
    return read_safetensors(path)
