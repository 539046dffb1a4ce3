"""The GPU end-to-end check (``checks/gpu/gpu_e2e.py``) itself, on tiny models and the CPU: it must keep working between
GPU runs. A real ComfyUI executor in a process of its own runs the Turbo, local-PE and LoRA workflows twice, then
/free, then Turbo again; the table says so."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_the_check_runs_the_workflows_through_comfyuis_executor(tmp_path):
    out = tmp_path / "out"
    finished = subprocess.run(
        [sys.executable, str(REPO / "checks" / "gpu" / "gpu_e2e.py"), "--tiny", "--cpu", "--modes", "default",
         "--workflows", "ernie_image_turbo,ernie_image_pe_local,ernie_image_turbo_lora",
         "--work", str(tmp_path / "work"), "--out", str(out), "--pe-tokens", "8"],
        capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    table = (out / "e2e.md").read_text().splitlines()
    turbo = next(line for line in table if line.startswith("| default | ernie_image_turbo | "))
    pe = next(line for line in table if line.startswith("| default | ernie_image_pe_local | "))
    assert turbo.split(" | ")[2] == "ok" and "(after /free " in turbo
    assert pe.split(" | ")[2].startswith("ok; /free: ")
    lora = next(line for line in table if line.startswith("| default | ernie_image_turbo_lora | "))
    assert lora.split(" | ")[2] == "ok" and "applied 70 of its 70 diffusion-model layers" in lora  # 10 tiny blocks x 7
    assert "| - | ernie_image_turbo_native | not run: needs ComfyUI >= 0.19" in "\n".join(table)


def test_fresh_process_runs_each_workflow_in_a_process_of_its_own(tmp_path):
    """``--fresh-process`` (host RAM per recipe): one ComfyUI process per workflow, each row still ok."""
    out = tmp_path / "out"
    finished = subprocess.run(
        [sys.executable, str(REPO / "checks" / "gpu" / "gpu_e2e.py"), "--tiny", "--cpu", "--modes", "default",
         "--workflows", "ernie_image_turbo,ernie_image_turbo_single_files", "--fresh-process",
         "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    log = (out / "e2e.log").read_text()
    starts = [line for line in log.splitlines() if line.startswith("===== default: ")]
    assert len(starts) == 2 and "ernie_image_turbo.json" in starts[0] and "single_files" in starts[1]
    table = (out / "e2e.md").read_text()
    for workflow in ("ernie_image_turbo", "ernie_image_turbo_single_files"):
        assert f"| default | {workflow} | ok |" in table
