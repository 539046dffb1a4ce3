"""Where local Prompt Enhancers are in ComfyUI's model folders (ComfyUI adapter: ``folder_paths``).

Names obey ``paths``' rule (plain relative names, inside the model folder) and the walks visit each real folder once
(``paths.walk``)."""

from __future__ import annotations

import os
from pathlib import Path

import folder_paths

from ..paths import (
    SNAPSHOT_PREFIX,
    TEXT_ENCODERS_PREFIX,
    inside,
    is_prompt_enhancer_file,
    read_small_json,
    snapshot_names,
    snapshot_path,
    walk,
)
from .protocol import EnhancerError


def _is_pe_folder(folder: Path) -> bool:
    config = read_small_json(folder / "config.json")
    if config is None:
        return (folder / "pe" / "config.json").is_file()
    return config.get("model_type") == "ministral3" and any(
        (folder / name).is_file() for name in ("tokenizer.json", "tekken.json")
    )


def _text_encoder_pe_names() -> list[str]:
    names = {n for n in folder_paths.get_filename_list("text_encoders")
             if n.endswith(".safetensors") and is_prompt_enhancer_file(n)}
    for root in folder_paths.get_folder_paths("text_encoders"):
        for current, dirs, _ in walk(root):
            if _is_pe_folder(Path(current)) and Path(current) != Path(root):
                names.add(os.path.relpath(current, root).replace(os.sep, "/"))
                dirs.clear()
    return sorted(names)


def pe_choices() -> list[str]:
    """Snapshots with a ``pe/`` (``diffusers/<name>``) and PE folders or files under ``text_encoders``."""
    snapshots = [SNAPSHOT_PREFIX + n for n in snapshot_names() if _is_pe_folder(snapshot_path(n))]
    return snapshots + [TEXT_ENCODERS_PREFIX + n for n in _text_encoder_pe_names()]


def pe_path(name: str) -> Path:
    """The folder or file of a ``pe_choices`` value."""
    if name.startswith(SNAPSHOT_PREFIX):
        return snapshot_path(name[len(SNAPSHOT_PREFIX):])
    relative = name.removeprefix(TEXT_ENCODERS_PREFIX)
    for root in folder_paths.get_folder_paths("text_encoders"):
        if (path := inside(root, relative, "text_encoders")).exists():
            return path
    raise EnhancerError(f"'{name}' was not found under ComfyUI's models/text_encoders or models/diffusers")
