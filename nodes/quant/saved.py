"""Saved quantized DiTs, reused while their source weights and the quantizing libraries stay the same (engine: no
ComfyUI here).

SVDQuant takes minutes and torchao's FP8 a whole bf16 read and seconds of GPU time, so each result is kept in one
folder per (source weights, method): ``<root>/<source name>-<hash of its path>-<method>/`` holds
``<method>.safetensors``, the files a method keeps beside it (``beside``: cache-dit's SVDQuant ``serialize_to``
writes ``quant_config.json``, read back by ``cache_dit.load``; torchao's FP8 weights need none: ``torchao_file.py``)
and ``ernie_image_entry.json``, the record of what it was made from: the source's path and each weight file's name,
size and modification time, the method and the versions. An entry whose record does not match, or whose files are
missing or damaged, is removed and built again. A new entry is written in a ``.partial`` folder and renamed into
place when complete, so an interrupted build (Cancel too) never looks finished.

The folder lies among the models, so an entry is read as a downloaded file is, untrusted: a symbolic link in place
of an entry or of one of its files is not followed (the link alone is removed, and the entry made again), and the
weights' values are checked before they are used (``non_finite`` here; the torchao file's scales in
``torchao_file``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .. import bounded_json
from ..cancel import check_cancel
from ..errors import ErnieImageError
from ..model_files import dit_folder, file_stamps, json_object, read_header, read_safetensors

FORMAT = 1  # of this folder layout and record
RECORD = "ernie_image_entry.json"
_ABANDONED_S = 3600  # a partial folder unchanged this long was left by a build that stopped (SVDQuant: minutes)
QUANT_CONFIG = "quant_config.json"  # cache-dit's SVDQuant writes it beside the checkpoint


def weight_files(source: Path) -> list[Path]:
    """The files the DiT is read from: one safetensors file, or a diffusers folder's (a snapshot's ``transformer/``)
    config and shards."""
    if source.is_file():
        return [source]
    folder = dit_folder(source)
    return sorted(p for p in folder.iterdir() if p.suffix == ".safetensors" or p.name == "config.json")


def source_identity(source: Path) -> dict:
    """The source's absolute path and each weight file's name, size and modification time (ns)."""
    return {"path": str(source.resolve()), "files": file_stamps(weight_files(source), name=lambda f: f.name)}


def _newest_change(folder: Path) -> float:
    """When ``folder`` or a file in it last changed (a build writing its checkpoint keeps this recent)."""
    try:
        return max([folder.stat().st_mtime, *(p.stat().st_mtime for p in folder.iterdir())])
    except OSError:
        return time.time()  # removed or being written by another build just now: not abandoned


def _read_record(path: Path) -> dict | None:
    try:
        record = json_object(path)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "checkpoint_bytes" in record else None


class SavedDiTs:
    """The folder ``root`` of saved quantized DiTs; ``beside``: the JSON files an entry holds beside its
    checkpoint."""

    def __init__(self, root: Path, beside: tuple[str, ...] = ()):
        self.root, self.beside = root, beside

    def entry(self, source: Path, method: str) -> Path:
        """The folder of ``source`` quantized with ``method`` (whether it exists or not)."""
        digest = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:10]
        name = source.stem if source.is_file() else source.name
        return self.root / f"{name}-{digest}-{method}"

    def record(self, source: Path, method: str, versions: dict[str, str]) -> dict:
        """What an entry usable for this source, method and versions records."""
        return {"format": FORMAT, "method": method, "source": source_identity(source), "versions": versions}

    def problem(self, source: Path, method: str, versions: dict[str, str]) -> str | None:
        """Why the saved entry cannot be used (there is none, stale, damaged), or None when it can."""
        entry = self.entry(source, method)
        if entry.is_symlink():
            return f"it is a symbolic link, which the pack does not follow in {self.root}"
        if not entry.is_dir():
            return "there is no saved copy"
        checkpoint = entry / f"{method}.safetensors"
        files = (entry / RECORD, checkpoint, *(entry / name for name in self.beside))
        linked = [f.name for f in files if f.is_symlink()]
        if linked:
            return f"{linked[0]} is a symbolic link, which the pack does not follow there"
        saved = _read_record(entry / RECORD)
        if saved is None:
            return f"its record {RECORD} is missing or unreadable"
        checkpoint_bytes = saved.pop("checkpoint_bytes")
        expected = self.record(source, method, versions)
        if saved.get("source") != expected["source"]:
            return "the source weights changed since it was made"
        if saved != expected:
            return f"it was made for {saved.get('method')} with {saved.get('versions')}, not {versions}"
        for needed in (checkpoint, *(entry / name for name in self.beside)):
            if not needed.is_file():
                return f"{needed.name} is missing"
        if checkpoint.stat().st_size != checkpoint_bytes:
            return f"{checkpoint.name} is damaged (its size changed)"
        try:
            with safe_open(str(checkpoint), framework="pt"):
                pass
            for name in self.beside:
                bounded_json.loads((entry / name).read_text())
        except (SafetensorError, OSError, ValueError) as e:
            return f"it is damaged ({str(e)[:200]})"
        return None

    def lookup(self, source: Path, method: str, versions: dict[str, str]) -> Path | None:
        """The usable saved entry, or None, after removing an entry that is stale or damaged."""
        reason = self.problem(source, method, versions)
        if reason is None:
            return self.entry(source, method)
        if self.entry(source, method).exists() or self.entry(source, method).is_symlink():
            logging.warning("ERNIE-Image: the saved quantized DiT %s cannot be used (%s); quantizing again",
                            self.entry(source, method), reason)
            self.discard(source, method)
        return None

    def discard(self, source: Path, method: str) -> None:
        """Remove the entry of ``source`` and ``method``, if any (a link in its place: the link, not what it points
        to)."""
        entry = self.entry(source, method)
        if entry.is_symlink():
            entry.unlink(missing_ok=True)
        else:
            shutil.rmtree(entry, ignore_errors=True)

    @contextmanager
    def build(self, source: Path, method: str, versions: dict[str, str]) -> Iterator[Path]:
        """A fresh folder to ``serialize_to``; when the block ends without error, it becomes the entry."""
        entry = self.entry(source, method)
        # A folder of this build's own: two ComfyUI processes sharing the models folder may build one entry at once.
        partial = entry.with_name(f".{entry.name}.{os.getpid()}-{time.time_ns()}.partial")
        record = self.record(source, method, versions)  # the source as it is read now
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            for left in self.root.glob(f".{entry.name}.*.partial"):  # left by an interrupted build, not a running one
                if time.time() - _newest_change(left) > _ABANDONED_S:
                    shutil.rmtree(left, ignore_errors=True)
            partial.mkdir()
        except OSError as e:
            raise ErnieImageError(
                f"Cannot write the quantized DiT to {self.root} ({e}). Make that folder writable, or free space "
                "on its disk."
            ) from e
        try:
            yield partial
            checkpoint = partial / f"{method}.safetensors"
            if not checkpoint.is_file():
                raise ErnieImageError(f"No {checkpoint.name} was written into {partial}: cannot save this DiT.")
            record["checkpoint_bytes"] = checkpoint.stat().st_size
            (partial / RECORD).write_text(json.dumps(record, indent=1))
            self.discard(source, method)
            partial.rename(entry)
        finally:
            shutil.rmtree(partial, ignore_errors=True)


def non_finite(checkpoint: Path) -> str | None:
    """The first floating-point tensor of a saved checkpoint that holds a NaN or an infinity, or None; read one
    tensor at a time (Cancel between them)."""
    for name in read_header(checkpoint):
        check_cancel()
        (tensor,) = read_safetensors(checkpoint, [name]).values()
        if tensor.is_floating_point() and tensor.dtype.itemsize > 1 and not bool(torch.isfinite(tensor).all()):
            return name
    return None
