"""Damaged copies of the tiny models, for the tests of error messages."""

from __future__ import annotations

import shutil
from pathlib import Path


def snapshot_with_truncated_file(snapshot: Path, tmp_path: Path, relative: str, keep_bytes: int = 1000) -> Path:
    """A copy of ``snapshot`` in ``tmp_path`` whose file ``relative`` keeps only its first ``keep_bytes`` bytes."""
    copy = tmp_path / "snapshot"
    shutil.copytree(snapshot, copy)
    damaged = copy / relative
    assert damaged.stat().st_size > keep_bytes, f"{relative} is too short to truncate to {keep_bytes} bytes"
    damaged.write_bytes(damaged.read_bytes()[:keep_bytes])
    return copy
