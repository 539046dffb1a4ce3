"""Where ERNIE-Image models live in ComfyUI's model folders (``folder_paths``)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import folder_paths

from .errors import ErnieImageError

SNAPSHOT_PREFIX = "diffusers/"  # how a snapshot folder is named among single files in a model list
TEXT_ENCODERS_PREFIX = "text_encoders/"  # how a file or folder of models/text_encoders is named in a model list
# The PE and the text encoder are both Ministral 3 files: under text_encoders, their names tell them apart.
_PE_FILE = re.compile(r"(enhancer|(^|[^a-z])pe([^a-z]|$))", re.IGNORECASE)


def is_prompt_enhancer_file(name: str) -> bool:
    """Whether a file under ``text_encoders`` is a Prompt Enhancer (by name; the architecture is the same)."""
    return _PE_FILE.search(Path(name).name) is not None


def _is_ernie_snapshot(folder: Path) -> bool:
    try:
        index = json.loads((folder / "model_index.json").read_text())
    except (OSError, ValueError):
        return False
    return index.get("_class_name") == "ErnieImagePipeline"


def snapshot_names() -> list[str]:
    """ERNIE-Image Hugging Face snapshots under ComfyUI's ``diffusers`` folders, as relative paths."""
    names = set()
    for root in folder_paths.get_folder_paths("diffusers"):
        for current, dirs, files in os.walk(root, followlinks=True):
            if "model_index.json" in files and _is_ernie_snapshot(Path(current)):
                names.add(os.path.relpath(current, root).replace(os.sep, "/"))
                dirs.clear()
    return sorted(names)


def snapshot_path(name: str) -> Path:
    """The folder of snapshot ``name`` (a value from ``snapshot_names``)."""
    for root in folder_paths.get_folder_paths("diffusers"):
        folder = Path(root) / name
        if (folder / "model_index.json").is_file():
            return folder
    raise ErnieImageError(
        f"Snapshot folder '{name}' was not found under ComfyUI's models/diffusers. "
        "Download baidu/ERNIE-Image-Turbo (or baidu/ERNIE-Image) into models/diffusers/<name>/."
    )


def safetensors_names(folder_name: str) -> list[str]:
    """The ``.safetensors`` files of one ComfyUI model folder (only safetensors are ever loaded)."""
    return [n for n in folder_paths.get_filename_list(folder_name) if n.endswith(".safetensors")]


def model_file_path(folder_name: str, name: str) -> Path:
    """The full path of ``name`` in ComfyUI's ``folder_name`` folders, or a clear error."""
    path = folder_paths.get_full_path(folder_name, name)
    if path is None:
        raise ErnieImageError(f"'{name}' was not found in ComfyUI's models/{folder_name} folder.")
    return Path(path)


def check_choice(value: str, options: list[str], folder_name: str) -> bool | str:
    """A node's ``validate_inputs`` answer for a model list: True, or the words of a validation error."""
    if value in options:
        return True
    found = ", ".join(options[:10]) or "nothing"
    return (
        f"'{value}' was not found in ComfyUI's models/{folder_name} folder (found: {found}). "
        "Download the model there (see the pack's README) or pick another."
    )
