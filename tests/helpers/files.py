"""Damaged copies of the tiny models, for the tests of error messages."""

from __future__ import annotations

import shutil
from pathlib import Path


def snapshot_with_truncated_file(snapshot: Path, tmp_path: Path, relative: str) -> Path:
    """A copy of ``snapshot`` in ``tmp_path`` whose file ``relative`` keeps only its first 1000 bytes."""
    copy = tmp_path / "snapshot"
    shutil.copytree(snapshot, copy)
    damaged = copy / relative
    damaged.write_bytes(damaged.read_bytes()[:1000])
    return copy
