"""Where ERNIE-Image models live in ComfyUI's model folders (``folder_paths``).

Model names come from workflows, and workflows come from strangers (every PNG carries one), so a name is checked
before it is joined to a model folder, whatever checked it before (``validate_inputs`` sees only constant widget
values). The rule (``inside``):

- the NAME is a relative path of plain parts: not absolute, no drive (``C:``), no ``..``, ``.`` or empty parts
  (``/`` and ``\\`` both separate parts, as on Windows);
- the joined path lies inside the model folder, compared lexically (normalised, symlinks not resolved).

Symlinks are not resolved on purpose: users link model folders and files in from other disks
(``models/diffusers/ERNIE-Image -> /data/hf/...``), and resolve-then-compare would refuse every such link. A link the
user made inside their own models folder is theirs; what a workflow cannot do is name a path out of the folder.

Folder walks follow links too (as ComfyUI's own listings do) but walk into each real folder once, so that a link
loop (``models/diffusers/loop -> ..``) cannot make a listing endless; a folder reached again through another link is
still listed under that link's name (two names for one snapshot are the user's choice), only not walked again.
A damaged ``model_index.json`` (not an object, not JSON, huge, not a file) hides its folder from the list, never the
pack's nodes.
"""

from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath, PureWindowsPath

import folder_paths

from .errors import ErnieImageError
from .model_files import is_gguf, json_object

# The PE and the text encoder are both Ministral 3 files: under text_encoders, their names tell them apart.
_PE_FILE = re.compile(r"(enhancer|(^|[^a-z])pe([^a-z]|$))", re.IGNORECASE)


def is_prompt_enhancer_file(name: str) -> bool:
    """Whether a file under ``text_encoders`` is a Prompt Enhancer (by name; the architecture is the same)."""
    return _PE_FILE.search(Path(name).name) is not None


def _name_parts(name: str, folder_name: str) -> list[str]:
    """The parts of a model name that obeys the module's rule, or an error naming it."""
    parts = re.split(r"[/\\]", name) if isinstance(name, str) else []
    if (not parts or "\0" in name or PureWindowsPath(name).drive or PurePosixPath(name).is_absolute()
            or any(part in ("", ".", "..") for part in parts)):
        raise ErnieImageError(
            f"{repr(name)[:120]} is not a model name under ComfyUI's models/{folder_name}: a name is a path "
            "relative to that folder, without '..', '.' or empty parts, not absolute and without a drive. Pick a "
            "model from the node's list (a shared workflow may carry a name that points elsewhere)."
        )
    return parts


def inside(root: str | Path, name: str, folder_name: str) -> Path:
    """``root/name`` when ``name`` is a plain relative name that stays inside ``root`` (the module's rule), or an
    error naming it; ``folder_name`` is the model folder's name for the message."""
    parts = _name_parts(name, folder_name)
    base = os.path.normpath(root)
    joined = os.path.normpath(os.path.join(base, *parts))
    if os.path.commonpath([base, joined]) != base:  # the parts rule keeps it inside; this says so independently
        raise ErnieImageError(f"{repr(name)[:120]} would lie outside ComfyUI's models/{folder_name}: pick a model "
                              "from the node's list.")
    return Path(joined)


def walk(root: str | Path) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk(root, followlinks=True)`` that walks into each real folder once: a folder whose real path was seen
    already is yielded (under the name that reached it) with no ``dirs``, so that a link loop ends there and links
    that fan out cannot multiply the walk. Clearing the yielded ``dirs`` prunes, as with ``os.walk``."""
    seen: set[str] = set()
    for current, dirs, files in os.walk(root, followlinks=True):
        real = os.path.realpath(current)
        if real in seen:
            dirs.clear()
        seen.add(real)
        yield current, dirs, files


@functools.cache  # once per file and reason: model lists are made again at every schema request
def _say_unlisted(path: str, reason: str) -> None:
    logging.warning("ERNIE-Image: %s %s, so its folder is not listed; download that model again.", path, reason)


def read_small_json(path: Path) -> dict | None:
    """A small JSON object from ``path`` (a model folder's index or config), or None when there is none, or it is
    not a regular file, larger than ``CONFIG_LIMIT_BYTES``, not JSON or not an object (said once in the log)."""
    if not path.exists():
        return None
    try:
        return json_object(path)
    except (OSError, ValueError) as error:
        _say_unlisted(str(path), f"is {error}")
        return None


def _is_ernie_snapshot(folder: Path) -> bool:
    index = read_small_json(folder / "model_index.json")
    return index is not None and index.get("_class_name") == "ErnieImagePipeline"


def model_folders(folder_name: str, is_model: Callable[[Path], bool]) -> list[str]:
    """The folders under ComfyUI's ``folder_name`` folders that ``is_model`` accepts, as relative paths (``/``), and
    nothing inside them: a model lives in a folder of its own, so a folder is not searched below one it accepts.
    A model folder itself is no model name (a name has no '.' part)."""
    names = set()
    for root in folder_paths.get_folder_paths(folder_name):
        for current, dirs, _ in walk(root):
            if current != root and is_model(Path(current)):
                names.add(os.path.relpath(current, root).replace(os.sep, "/"))
                dirs.clear()
    return sorted(names)


def snapshot_names() -> list[str]:
    """ERNIE-Image Hugging Face snapshots under ComfyUI's ``diffusers`` folders, as relative paths."""
    return model_folders("diffusers", _is_ernie_snapshot)


def snapshot_path(name: str) -> Path:
    """The folder of snapshot ``name`` (a value from ``snapshot_names``)."""
    for root in folder_paths.get_folder_paths("diffusers"):
        folder = inside(root, name, "diffusers")
        if (folder / "model_index.json").is_file():
            return folder
    raise ErnieImageError(
        f"Snapshot folder '{name}' was not found under ComfyUI's models/diffusers. "
        "Download baidu/ERNIE-Image-Turbo (or baidu/ERNIE-Image) into models/diffusers/<name>/."
    )


def safetensors_names(folder_name: str) -> list[str]:
    """The ``.safetensors`` files of one ComfyUI model folder (only safetensors are ever loaded)."""
    return [n for n in folder_paths.get_filename_list(folder_name) if n.endswith(".safetensors")]


def gguf_names(folder_name: str) -> list[str]:
    """The ``.gguf`` files under ComfyUI's ``folder_name`` folders, as relative paths (``/``). ComfyUI's own file
    lists leave them out (``.gguf`` is none of its model extensions), so the folders are walked here."""
    names = set()
    for root in folder_paths.get_folder_paths(folder_name):
        for current, _, found in walk(root):
            names.update(os.path.relpath(os.path.join(current, name), root).replace(os.sep, "/")
                         for name in found if is_gguf(name))
    return sorted(names)


def model_file_path(folder_name: str, name: str) -> Path:
    """The full path of ``name`` in ComfyUI's ``folder_name`` folders, or a clear error."""
    # Checked here: ComfyUI's get_full_path would quietly read '../x' as 'x', another file than the one named.
    _name_parts(name, folder_name)
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
