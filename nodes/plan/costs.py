"""What things cost on this machine, measured by the probe (``host/probe.py``) and kept in ComfyUI's user folder.

``seconds`` maps a form's ``compute`` key (``records.Form.compute``) to the seconds of one run with its weights on the
GPU: one DiT forward pass at 1024² (``dit:bf16``, ``dit:fp8_cast``, ``dit:fp8_matmul``, ``dit:gguf:Q4_K``, …), one
text-encoder encode of a 128-token prompt (``text:bf16``, ``text:fp8``, ``text:gguf:Q4_K``, …), one PE token
(``pe:bf16``, ``pe:fp8``, ``pe:gguf:Q4_K``, …), one 1024² VAE decode (``vae``), what a plain LoRA adds to one DiT
forward pass where its layers add its outputs at each call, per GB of its factors (``lora:dit_per_gb``: a GGUF DiT's;
other forms have it merged at load); ``cpu_seconds`` the same runs on the CPU
where they can run there, and the CPU work after a decode: its 1024² image saved as a PNG (``image:png``). A file is
read only as JSON, bounded in size, every number finite and within what a machine can measure (a second's billionth to a
day; a kilobyte to 100 TB per second): it is a file another process can write, and a cost of 1e-300 s would make a form
look free to the planner.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import bounded_json

IMAGE_PNG = "image:png"
LORA_PER_GB = "lora:dit_per_gb"
MAX_FILE_BYTES = 1 << 16
SECONDS_RANGE = (1e-9, 86400.0)
BYTES_PER_SECOND_RANGE = (1e3, 1e14)


@dataclass(frozen=True)
class Costs:
    """``key``: the GPU's name, its driver and torch's version (measured again when any changes);
    ``pinned`` / ``pageable``: host → GPU bytes per second from pinned and from pageable memory."""

    key: str
    pinned: float
    pageable: float
    seconds: Mapping[str, float] = field(default_factory=dict)
    cpu_seconds: Mapping[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"seconds": dict(self.seconds), "cpu_seconds": dict(self.cpu_seconds)},
                          indent=1, sort_keys=True)


def _within(value: object, bounds: tuple[float, float]) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            and bounds[0] <= value <= bounds[1])


def _table(value: object) -> dict[str, float] | None:
    if not isinstance(value, dict) or len(value) > 256:
        return None
    if not all(isinstance(k, str) and len(k) <= 64 and _within(v, SECONDS_RANGE) for k, v in value.items()):
        return None
    return {k: float(v) for k, v in value.items()}


def _read_bounded(path: Path) -> str | None:
    """The text of the regular file at ``path`` when it holds at most ``MAX_FILE_BYTES`` (read no further: it may
    grow while read, or be a link to an endless device)."""
    if not path.is_file():
        return None
    with path.open("rb") as file:
        data = file.read(MAX_FILE_BYTES + 1)
    return data.decode("utf-8") if len(data) <= MAX_FILE_BYTES else None


def read_costs(path: Path, key: str) -> Costs | None:
    """The costs kept at ``path`` for ``key``; None when the file is missing, another key's, too large or not
    exactly what ``Costs.to_json`` writes (then the probe measures again and writes it anew)."""
    try:
        text = _read_bounded(path)
        data = None if text is None else bounded_json.loads(text)
    except (OSError, ValueError):  # unreadable, not UTF-8 (UnicodeDecodeError is a ValueError), not JSON
        return None
    if not isinstance(data, dict) or data.get("key") != key:
        return None
    seconds, cpu = _table(data.get("seconds")), _table(data.get("cpu_seconds"))
    if seconds is None or cpu is None or not all(_within(data.get(name), BYTES_PER_SECOND_RANGE)
                                                 for name in ("pinned", "pageable")):
        return None
    return Costs(key, float(data["pinned"]), float(data["pageable"]), seconds, cpu)


def write_costs(path: Path, costs: Costs) -> None:
    """Keep ``costs`` at ``path``: written whole to a new file of its own (a name created here, so that no link
    planted in the folder is followed), then renamed into place (replacing a link at ``path``, not its target)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(costs.to_json())
        os.replace(partial, path)
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
