"""How often the pack parses a safetensors file's header, counted on the real calls."""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def count_header_parses(monkeypatch, most: int = 1) -> Counter:
    """A count per file name of the header parses the pack makes: by its own reader (``model_files._parse``) or by a
    safetensors handle it opens (``safe_open``: each parses the whole header; main opened one per tensor). The
    ``most + 1``-th parse of one file fails the test at once (on main, a 10 000-tensor file would otherwise be parsed
    10 001 times, for minutes)."""
    from comfyui_ernie_image.nodes import model_files

    counts: Counter = Counter()

    def counting(real):
        def parse(path, *args, **kwargs):
            counts[Path(path).name] += 1
            assert counts[Path(path).name] <= most, f"the header of {Path(path).name} is parsed again"
            return real(path, *args, **kwargs)
        return parse

    for name in ("_parse", "safe_open"):
        if hasattr(model_files, name):
            monkeypatch.setattr(model_files, name, counting(getattr(model_files, name)))
    return counts
