"""The GPU end-to-end check (``checks/gpu/gpu_e2e.py``) itself, on tiny models and the CPU: it must keep working between
GPU runs. A real ComfyUI executor in a process of its own runs the Turbo, local-PE, LoRA and GGUF + LoRA workflows
twice, then /free, then Turbo again; the table says so. The GGUF of the DiT the check writes at true size is one the
pack reads."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import torch
from diffusers import ErnieImageTransformer2DModel

from checks.gpu.e2e_models import write_gguf_dit
from comfyui_ernie_image.nodes.dit.gguf import read_gguf_dit
from comfyui_ernie_image.nodes.gguf.reader import read_gguf
from conftest import REPO


def test_the_check_runs_the_workflows_through_comfyuis_executor(tmp_path):
    out = tmp_path / "out"
    finished = subprocess.run(
        [sys.executable, str(REPO / "checks" / "gpu" / "gpu_e2e.py"), "--tiny", "--cpu", "--modes", "default",
         "--workflows", "ernie_image_turbo,ernie_image_pe_local,ernie_image_turbo_lora,ernie_image_gguf_lora",
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
    # The GGUF workflow (8 GB setting) with the Q4_K_M GGUF the check writes, recognised by its names under 'wan',
    # and the LoRA workflow's LoRA spliced in after its DiT loader (the table cuts the log lines short: the runs'
    # own rows hold them whole).
    gguf_row = next(line for line in table if line.startswith("| default | ernie_image_gguf_lora | "))
    assert gguf_row.split(" | ")[2] == "ok" and "GGUFModelPatcher" in gguf_row
    runs = [json.loads(line) for line in (out / "e2e.jsonl").read_text().splitlines()]
    notes = " ".join(next(r for r in runs if r["workflow"] == "ernie_image_gguf_lora" and r["run"] == "first")["notes"])
    assert "general.architecture 'wan'" in notes and "held as GGUF blocks (52 Q4_K, 1 Q5_K, 20 Q6_K)" in notes
    assert "applied 70 of its 70 diffusion-model layers" in notes
    assert "| - | ernie_image_turbo_native | not run: needs ComfyUI >= 0.19" in "\n".join(table)


def test_fresh_process_runs_each_workflow_in_a_process_of_its_own(tmp_path):
    """``--fresh-process`` (host RAM per recipe): one ComfyUI process per workflow, each row still ok; with
    ``--cold-disk`` the model files leave the page cache before each."""
    out = tmp_path / "out"
    finished = subprocess.run(
        [sys.executable, str(REPO / "checks" / "gpu" / "gpu_e2e.py"), "--tiny", "--cpu", "--modes", "default",
         "--workflows", "ernie_image_turbo,ernie_image_turbo_single_files", "--fresh-process",
         "--cold-disk", "--work", str(tmp_path / "work"), "--out", str(out)],
        capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    log = (out / "e2e.log").read_text()
    starts = [line for line in log.splitlines() if line.startswith("===== default: ")]
    assert len(starts) == 2 and "ernie_image_turbo.json" in starts[0] and "single_files" in starts[1]
    assert log.count("page cache dropped") == 2, log[:2000]
    table = (out / "e2e.md").read_text()
    for workflow in ("ernie_image_turbo", "ernie_image_turbo_single_files"):
        assert f"| default | {workflow} | ok |" in table


def test_the_checks_gguf_of_the_dit_is_one_the_pack_reads(tmp_path):
    """``write_gguf_dit`` (what writes the true-size file on the GPU machine) on a small DiT whose rows fill whole
    256-value blocks, as the released one's do (the tiny DiT's are all stored as rows of 256): the pack takes it as an
    ERNIE-Image DiT (names, shapes, types, every block scale finite) and the gguf package decodes every tensor of it
    to finite numbers."""
    config = dict(hidden_size=256, num_attention_heads=2, num_layers=2, ffn_hidden_size=512, in_channels=128,
                  out_channels=128, text_in_dim=512, rope_axes_dim=(32, 48, 48))
    state = {k: v.to(torch.bfloat16) for k, v in ErnieImageTransformer2DModel(**config).state_dict().items()}
    path = write_gguf_dit(state, tmp_path / "ernie-image-turbo-Q4_K_M.gguf")
    tensors, read_config = read_gguf_dit(path)
    assert read_gguf(path).architecture == "wan"
    assert {k: read_config[k] for k in config} == config
    kinds = {name: tensor.kind for name, tensor in tensors.items()}
    assert kinds["layers.0.self_attention.to_q.weight"] == "Q4_K" and kinds["layers.1.mlp.linear_fc2.weight"] == "Q6_K"
    assert set(kinds.values()) == {"Q4_K", "Q5_K", "Q6_K", "BF16", "F16", "F32"}
    assert tensors["layers.0.mlp.up_proj.weight"].shape == (512, 256)
    for tensor in gguf.GGUFReader(str(path)).tensors:
        values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type)
        assert np.isfinite(values).all() and values.size == np.prod(tensors[tensor.name].shape), tensor.name


def test_live_at_peak_reads_torchs_memory_history_format():
    """``--allocations`` on the GPU: a hand-written trace in the format of ``torch.cuda.memory._snapshot()``'s
    ``device_traces`` (innermost frame first; no CUDA here to record one). The peak is what the blocks allocated
    during the trace held at once, frees of blocks from before it are ignored, and refusals are counted."""
    from checks.gpu.e2e_worker import live_at_peak

    def frames(line):
        return [{"filename": "/x/torch/nn/modules/conv.py", "line": 1, "name": "forward"},
                {"filename": "/x/comfy/ldm/model.py", "line": line, "name": "decode"},
                {"filename": "/x/comfy/sd.py", "line": 9, "name": "decode"}]

    mib = 2**20
    trace = [dict(action="segment_alloc", addr=0, size=64 * mib),
             dict(action="alloc", addr=1, size=10 * mib, frames=frames(10)),
             dict(action="free_requested", addr=99, size=50 * mib),  # allocated before the trace
             dict(action="alloc", addr=2, size=20 * mib, frames=frames(20)),
             dict(action="oom", addr=0, size=512 * mib, device_free=0),
             dict(action="alloc", addr=3, size=30 * mib, frames=frames(20)),
             dict(action="free_requested", addr=2, size=20 * mib),
             dict(action="free_requested", addr=3, size=30 * mib),
             dict(action="alloc", addr=4, size=40 * mib, frames=frames(40))]
    peak = live_at_peak(trace)
    assert peak["peak_gib"] == round(60 * mib / 2**30, 3)
    assert peak["reached_by"] == "ldm/model.py:20 decode < comfy/sd.py:9 decode"
    assert peak["live"] == [dict(where="ldm/model.py:20 decode < comfy/sd.py:9 decode", mib=50.0, blocks=2),
                            dict(where="ldm/model.py:10 decode < comfy/sd.py:9 decode", mib=10.0, blocks=1)]
    assert peak["refusals"] == 1 and peak["refused_mib"] == [512]
    assert peak["peak_reserved_gib"] == round(64 * mib / 2**30, 3)
