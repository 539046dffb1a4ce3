"""Where local Prompt Enhancers are in ComfyUI's model folders (ComfyUI adapter: ``folder_paths``).

Listed and resolved in the pack's one model grammar (``choices``); names obey ``paths``' rule (plain relative names,
inside the model folder) and the walks visit each real folder once (``paths.walk``)."""

from __future__ import annotations

from pathlib import Path

import folder_paths

from ..choices import SNAPSHOTS, ModelList, Source
from ..model_files import is_gguf
from ..paths import (
    gguf_names,
    inside,
    is_prompt_enhancer_file,
    model_folders,
    read_small_json,
    snapshot_names,
    snapshot_path,
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
    files = {n for n in [*folder_paths.get_filename_list("text_encoders"), *gguf_names("text_encoders")]
             if (n.endswith(".safetensors") or is_gguf(n)) and is_prompt_enhancer_file(n)}
    return sorted(files.union(model_folders("text_encoders", _is_pe_folder)))


def _text_encoder_pe_path(name: str) -> Path:
    for root in folder_paths.get_folder_paths("text_encoders"):
        if (path := inside(root, name, "text_encoders")).exists():
            return path
    raise EnhancerError(f"'text_encoders/{name}' was not found under ComfyUI's models/text_encoders or "
                        "models/diffusers")


PE_FILES = Source("text_encoders", _text_encoder_pe_names, _text_encoder_pe_path)
# Snapshots with a pe/, then PE folders or files under text_encoders: both were always listed with their folder.
PE_MODELS = ModelList((
    Source(SNAPSHOTS.folder, lambda: [n for n in snapshot_names() if _is_pe_folder(snapshot_path(n))], snapshot_path),
    PE_FILES,
))
# The all-in-one loader's PE instead of its snapshot's: a folder or file under text_encoders (a GGUF for small cards).
PE_FILE_MODELS = ModelList((PE_FILES,))


def pe_choices() -> list[str]:
    """Snapshots with a ``pe/`` (``diffusers/<name>``) and PE folders or files under ``text_encoders``."""
    return PE_MODELS.options()


def pe_path(name: str) -> Path:
    """The folder or file of a ``pe_choices`` value."""
    return PE_MODELS.resolve(name).path
