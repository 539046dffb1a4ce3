"""``bench/bench_gguf_text.py --tiny`` (issue 44's GPU benchmark, on tiny models and the CPU): it must keep running to
its table between GPU sessions. Each part's variants load through the pack's loaders and are measured on the same
input: the text encoders on the same tokens, the PEs on the same prompt ids and new tokens."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_the_tiny_benchmark_runs_every_part_to_its_table(tmp_path):
    out = tmp_path / "out"
    finished = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_gguf_text.py"), "--tiny", "--device", "cpu", "--no-compile",
         "--repeats", "1", "--pe-tokens", "4", "--models", str(tmp_path / "models"), "--work", str(tmp_path / "work"),
         "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    rows = json.loads((out / "bench_gguf_text.json").read_text())["rows"]
    assert [(r["part"], r["variant"]) for r in rows] == [
        ("te", "bf16 safetensors"), ("te", "fp8 safetensors"), ("te", "GGUF Q4_K_M"), ("te", "GGUF Q8_0"),
        ("pe", "bf16 safetensors"), ("pe", "fp8 safetensors"), ("pe", "GGUF Q4_K_M"),
        ("dit", "GGUF Q4_0"), ("dit", "GGUF Q4_K")]
    assert not [r for r in rows if "error" in r]
    assert len({r["tokens"] for r in rows if r["part"] == "te"}) == 1
    assert len({(r["prompt_tokens"], r["new_tokens"]) for r in rows if r["part"] == "pe"}) == 1
    assert all(r["warm_encode_ms"] > 0 and r["held_mb"] > 0 for r in rows if r["part"] == "te")
    assert all(r["decode_tok_s"] > 0 for r in rows if r["part"] == "pe")
    assert all(r["eager_ms"] > 0 and r["compiled_ms"] == "not run: --no-compile" for r in rows if r["part"] == "dit")
    table = finished.stdout[finished.stdout.index("| te |"):]
    assert "| GGUF Q4_K_M |" in table and "| dit |" in table and "| GGUF Q4_0 |" in table
    assert not (tmp_path / "work" / "ernie-image-turbo-Q4_0.gguf").exists()  # deleted once loaded


def test_the_benchmark_stops_starting_parts_at_its_deadline(tmp_path):
    """A deadline already past: every variant listed as not run, nothing written or loaded."""
    out = tmp_path / "out"
    finished = subprocess.run(
        [sys.executable, str(REPO / "bench" / "bench_gguf_text.py"), "--tiny", "--device", "cpu", "--parts", "dit",
         "--deadline-s", "0", "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    rows = json.loads((out / "bench_gguf_text.json").read_text())["rows"]
    assert rows == [dict(part="dit", variant=f"GGUF {kind}", error="not run: deadline") for kind in ("Q4_0", "Q4_K")]
