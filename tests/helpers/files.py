"""Damaged copies of the tiny models, for the tests of error messages.

The copies are hard links (the tiny snapshot holds a true-size 320 MB VAE, and a dozen tests copy it), so a file is
unlinked before it is changed: writing through a link would damage the session's shared tiny models.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, destination)


def linked_copy(source: Path, destination: Path, ignore: Callable | None = None) -> Path:
    """A copy of the folder or file ``source`` at ``destination`` that writes no bytes: change its files only
    through ``replace_bytes``."""
    if source.is_dir():
        shutil.copytree(source, destination, copy_function=_link_or_copy, ignore=ignore)
    else:
        _link_or_copy(str(source), str(destination))
    return destination


def replace_bytes(file: Path, data: bytes) -> None:
    """Gives ``file`` new contents without touching the file it may be linked to."""
    file.unlink()
    file.write_bytes(data)


def snapshot_with_truncated_file(snapshot: Path, tmp_path: Path, relative: str, keep_bytes: int = 1000) -> Path:
    """A copy of ``snapshot`` in ``tmp_path`` whose file ``relative`` keeps only its first ``keep_bytes`` bytes."""
    copy = linked_copy(snapshot, tmp_path / "snapshot")
    damaged = copy / relative
    assert damaged.stat().st_size > keep_bytes, f"{relative} is too short to truncate to {keep_bytes} bytes"
    replace_bytes(damaged, damaged.read_bytes()[:keep_bytes])
    return copy


def rewrite_safetensors(file: Path, change: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    """Gives the safetensors ``file`` the tensors ``change`` makes of its own (through ``replace_bytes``)."""
    replace_bytes(file, save(change(load_file(file))))


@contextlib.contextmanager
def in_model_folder(models_dir: Path, folder: str, name: str) -> Iterator[Path]:
    """The path ``models_dir/folder/name`` for a file or folder a test puts among ComfyUI's models, removed when
    the test ends: other tests list these folders."""
    path = models_dir / folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

