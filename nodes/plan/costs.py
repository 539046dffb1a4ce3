"""What things cost on this machine, measured by the probe (``host/probe.py``) and kept in ComfyUI's user folder.

``seconds`` maps a form's ``compute`` key (``records.Form.compute``) to the seconds of one run with its weights on the
GPU: one DiT forward pass at 1024² (``dit:bf16``, ``dit:fp8_cast``, ``dit:fp8_matmul``, ``dit:gguf:Q4_K``, …), one
text-encoder encode of a 128-token prompt (``text:bf16``, ``text:fp8``), one PE token (``pe:bf16``, ``pe:fp8``), one
1024² VAE decode (``vae``); ``cpu_seconds`` the same runs on the CPU where they can run there. A file is read only as
JSON, bounded in size, every number finite and positive: it is a file another process can write.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

MAX_FILE_BYTES = 1 << 16


@dataclass(frozen=True)
class Costs:
    """``key``: the GPU's name, its driver and torch's version (measured again when any changes);
    ``pinned`` / ``pageable``: host → GPU bytes per second from pinned and from pageable memory."""

    key: str
    pinned: float
    pageable: float
    seconds: Mapping[str, float] = field(default_factory=dict)
    cpu_seconds: Mapping[str, float] = field(default_factory=dict)

    def run(self, compute: str) -> float | None:
        return self.seconds.get(compute)

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"seconds": dict(self.seconds), "cpu_seconds": dict(self.cpu_seconds)},
                          indent=1, sort_keys=True)


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _table(value: object) -> dict[str, float] | None:
    if not isinstance(value, dict) or len(value) > 256:
        return None
    if not all(isinstance(k, str) and len(k) <= 64 and _positive(v) for k, v in value.items()):
        return None
    return {k: float(v) for k, v in value.items()}


def read_costs(path: Path, key: str) -> Costs | None:
    """The costs kept at ``path`` for ``key``; None when the file is missing, another key's, too large or not
    exactly what ``Costs.to_json`` writes (then the probe measures again and writes it anew)."""
    try:
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    seconds, cpu = _table(data.get("seconds")), _table(data.get("cpu_seconds"))
    if seconds is None or cpu is None or not _positive(data.get("pinned")) or not _positive(data.get("pageable")):
        return None
    return Costs(key, float(data["pinned"]), float(data["pageable"]), seconds, cpu)


def write_costs(path: Path, costs: Costs) -> None:
    """Keep ``costs`` at ``path`` (written whole, then renamed into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(costs.to_json(), encoding="utf-8")
    partial.replace(path)
