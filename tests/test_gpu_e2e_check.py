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
from helpers.loaded import hold


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
    # Core's model-management calls timed in each run: the first Turbo prompt loads its models through core.
    first_turbo = next(r for r in runs if r["workflow"] == "ernie_image_turbo" and r["run"] == "first")
    calls, seconds = first_turbo["core_s"]["load_models_gpu"]
    assert calls >= 2 and 0 < seconds < first_turbo["seconds"]
    assert "| - | ernie_image_turbo_native | not run: needs ComfyUI >= 0.19" in "\n".join(table)
    # The sweep table is written for every run, and prints without a plan (today's pack logs none).
    sweep = (out / "sweep.md").read_text().splitlines()
    turbo = next(line for line in sweep if line.startswith("| default (whole GPU) | ernie_image_turbo | ")).split(" | ")
    assert turbo[2:4] == ["no plan", "no plan"] and turbo[-1] == "ok |" and float(turbo[4]) > 0


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


PLAN_LINE = ("ERNIE-Image: plan for 10.9 GiB usable: DiT GGUF Q4_K resident (5.0 GiB), text encoder fp8 streamed "
             "(3.7 GB per prompt), VAE resident; predicted warm 2.0 s")


def test_cards_of_any_size_become_emulated_card_modes():
    """``--cards 6.5,10,11.2``: each size an emulated card (the card modes' flags), run after ``--modes``' modes (a
    size named twice runs once), five warm prompts unless told; ``card<N>`` names keep working, on the fork too."""
    from checks.gpu.gpu_e2e import mode_settings, parse_args

    args = parse_args(["--modes", "default,card10", "--cards", "6.5,10,11.2"])
    assert args.modes == ["default", "card10", "card6.5", "card11.2"] and args.warm_runs == 5
    assert [mode_settings(mode) for mode in args.modes] == [
        ("", None), ("--disable-cuda-malloc", 10.0), ("--disable-cuda-malloc", 6.5), ("--disable-cuda-malloc", 11.2)]
    assert parse_args(["--cards", "8", "--warm-runs", "3"]).modes == ["card8"]
    assert parse_args(["--cards", "8", "--warm-runs", "3"]).warm_runs == 3
    assert (parse_args([]).modes, parse_args([]).warm_runs) == (["default"], 1)
    assert [mode_settings(mode) for mode in parse_args(["--modes", "card24,card4"]).modes] == [
        ("--disable-cuda-malloc", 24.0), ("--disable-cuda-malloc", 4.0)]
    fork = parse_args(["--cards", "8,12", "--core", "fork", "--comfyui", str(REPO)])
    assert (fork.core, fork.modes) == ("fork", ["card8", "card12"])


def test_cards_that_cannot_be_emulated_are_refused_before_anything_runs(capsys):
    """A size that is no number, not finite, or not above a CUDA context's 0.5 GiB, and an unknown mode, stop the
    check at its arguments, naming what was given."""
    import pytest

    from checks.gpu.gpu_e2e import parse_args

    for cards in ("0.5", "-2", "nan", "inf", "6.5,,10", "ten"):
        with pytest.raises(SystemExit) as stopped:
            parse_args(["--cards", cards])
        error = capsys.readouterr().err
        assert stopped.value.code == 2 and "--cards takes card sizes in GiB, comma-separated" in error, error
        assert f"got {cards!r}" in error
    for mode, words in (("card0.4", "a card must be larger than the 0.5 GiB a CUDA context takes, got 0.4"),
                        ("cardX", "unknown mode 'cardX': one of default")):
        with pytest.raises(SystemExit):
            parse_args(["--modes", mode])
        assert f"--modes: {words}" in capsys.readouterr().err


def test_held_modes_leave_that_much_of_the_gpu_free_one_mode_at_a_time_on_a_gpu(capsys, tmp_path):
    """``held<GiB>``: ComfyUI's default flags on the whole GPU (no emulation in its process) while another process
    holds the rest; refused with modes at once or on the CPU, where the holder would take the others' memory or
    cannot run. On this machine, without CUDA, the holder's own failure comes back as an error, not a hang."""
    import pytest

    from checks.gpu.ballast import GIB, bytes_to_hold
    from checks.gpu.gpu_e2e import BallastError, ballast, held_gib, mode_settings, parse_args

    args = parse_args(["--modes", "held8,card8,held10.5"])
    assert [mode_settings(m) for m in args.modes] == [("", 8.0), ("--disable-cuda-malloc", 8.0), ("", 10.5)]
    assert [held_gib(m) for m in args.modes] == [8.0, None, 10.5]
    for extra in (["--parallel", "2"], ["--cpu"]):
        with pytest.raises(SystemExit):
            parse_args(["--modes", "default,held8", *extra])
        assert "--modes held8: another process holds the GPU's memory" in capsys.readouterr().err
    assert bytes_to_hold(20 * GIB, 8) == 12 * GIB
    with pytest.raises(ValueError, match="the GPU has 7.5 GiB free, not more than the 8 GiB to leave free"):
        bytes_to_hold(int(7.5 * GIB), 8)
    with (tmp_path / "e2e-held8.log").open("w") as log:
        with pytest.raises(BallastError, match="could not hold the GPU's memory: see .*e2e-held8.log"):
            with ballast(8.0, log):
                pass
    assert "Traceback" in (tmp_path / "e2e-held8.log").read_text()  # the holder's own error, in the mode's log


def test_the_plan_line_is_read_for_its_plan_and_predicted_warm_time():
    from checks.gpu.e2e_sweep import parse_plan

    plan = dict(usable_gib=10.9, predicted_s=2.0, plan="DiT GGUF Q4_K resident (5.0 GiB), text encoder fp8 streamed "
                "(3.7 GB per prompt), VAE resident", host_gib=None)
    assert parse_plan(PLAN_LINE) == plan
    assert parse_plan(PLAN_LINE + "; 3.6 GiB held in host RAM, more than the 2.0 GiB it has free: the system "
                      "swaps") == plan | dict(host_gib=3.6)
    assert parse_plan("INFO: " + PLAN_LINE) == plan  # as the check's notes hold it
    assert parse_plan(PLAN_LINE.replace("VAE resident;", "VAE resident; LoRA merged;"))["plan"].endswith(
        "VAE resident; LoRA merged")  # the plan's own semicolons stay in it
    assert parse_plan("ERNIE-Image: prompt took 2.1 s (predicted warm 2.0 s)") is None
    assert parse_plan(PLAN_LINE.replace("2.0 s", "? s")) is None


def test_the_worker_keeps_the_packs_plan_lines_and_counts_out_of_memory_retry_and_fallback():
    """What a run's row gets from the log (core's lines and the pack's, through logging as in the worker): each plan
    line whole, and how many lines spoke of out-of-memory, a retry or a fallback."""
    import logging

    from checks.gpu.e2e_worker import LogNotes

    notes, root = LogNotes(), logging.getLogger()
    pack = logging.getLogger("comfyui_ernie_image.nodes.test_plan")
    pack.setLevel(logging.DEBUG)
    root.addHandler(notes)
    try:
        pack.info("ERNIE-Image: plan for %.1f GiB usable: %s; predicted warm %.1f s", 10.9,
                  PLAN_LINE.split("usable: ")[1].split(";")[0], 2.0)
        pack.info("ERNIE-Image: prompt took 2.1 s (predicted warm 2.0 s)")
        pack.info("Requested to load ErnieImageModel")
        pack.warning("Warning: Ran out of memory when regular VAE decoding, retrying with tiled VAE decoding.")
        pack.error("!!! Exception during processing !!! CUDA out of memory. Tried to allocate 2.00 GiB\nTraceback")
        pack.info("ERNIE-Image: the text encoder falls back to the CPU")
        pack.info("ERNIE-Image: plan for 10.9 GiB usable: DiT GGUF Q4_K streamed; predicted warm 3.0 s")
    finally:
        root.removeHandler(notes)
    assert notes.plans == [PLAN_LINE, "ERNIE-Image: plan for 10.9 GiB usable: DiT GGUF Q4_K streamed; predicted warm "
                           "3.0 s"]
    assert notes.trouble == 3


def _runs(mode, card, workflow, warm, **first):
    """Rows as the worker records them (``e2e.jsonl``) for a first prompt and warm prompts ``warm``."""
    base = dict(mode=mode, card_gib=card, workflow=workflow, ok=True, oom_retry_fallback=0, plans=[],
                peak_allocated_gib=9.1, peak_reserved_gib=9.6, peak_rss_gib=11.7, peak_rss_anon_gib=5.6,
                peak_rss_file_gib=6.2)
    labels = ["warm", *(f"warm {n}" for n in range(2, len(warm) + 1))][:len(warm)]
    return [{**base, "run": "first", "seconds": 20.4, **first},
            *({**base, "run": label, "seconds": s} for label, s in zip(labels, warm, strict=True))]


def test_the_sweep_table_from_recorded_rows(tmp_path):
    """One line per card and workflow, by card size: the last plan logged and its predicted warm time next to the
    measured median and spread (a ratio outside ±30 % in bold), "no plan" where none was logged, the bytes copied
    host <-> GPU in the profiled prompt, peaks, host RAM, the out-of-memory / retry / fallback lines, and a failure;
    several runs' rows make one table, a card run again replacing the earlier rows."""
    from checks.gpu.e2e_sweep import sweep_table

    gguf = "ernie_image_turbo_gguf"
    card10 = _runs("card10", 10.0, gguf, [2.0, 2.4, 2.1, 1.9, 2.2], plans=["INFO: " + PLAN_LINE])
    card10[2]["oom_retry_fallback"] = 1
    card10.append({**card10[1], "run": "copies", "seconds": 9.0,
                   "copied_bytes": {"HtoD": 4_700_000_000, "DtoH": 10_000_000, "DtoD": 5_000_000_000,
                                    "HtoD pageable": 300_000_000, "HtoD pageable copies": 1200, "HtoD us": 251_600,
                                    "DtoH us": 900}})
    card8 = _runs("card8", 8.0, gguf, [2.0, 2.0], plans=[PLAN_LINE.replace("2.0 s", "1.0 s")])
    card9 = _runs("card9", 9.0, gguf, [])
    card9[0].update(ok=False, error="VAEDecode: OutOfMemoryError: CUDA out of memory |\n Tried to allocate 2 GiB")
    rows = [*_runs("card12", 12.0, gguf, [1.6, 1.5, 1.7]), *card10, *card8, *card9,
            *_runs("default", None, "ernie_image_turbo", [1.4])]
    lines = sweep_table(rows).splitlines()
    assert len(lines) == 2 + 5 and all(line.count(" | ") == 11 for line in lines[:1] + lines[2:])
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| 8 (10.9 usable)", "| 9", "| 10 (10.9 usable)", "| 12", "| default (whole GPU)"]
    assert lines[4] == (
        "| 10 (10.9 usable) | ernie_image_turbo_gguf | DiT GGUF Q4_K resident (5.0 GiB), text encoder fp8 streamed "
        "(3.7 GB per prompt), VAE resident | 2.00 | 2.10 (1.90–2.40, 5 prompts) | 1.05 | 20.4 | 4,710 MB (HtoD "
        "4,700 MB: 300 MB pageable in 1,200 copies, 252 ms, DtoH 10 MB: 0 MB pageable, 1 ms) | 9.1 / 9.6 "
        "| 11.7 (anon 5.6, file 6.2) | 1 | ok |")
    assert lines[2].split(" | ")[3:6] == ["1.00", "2.00 (2.00–2.00, 2 prompts)", "**2.00**"]
    assert lines[3].split(" | ")[4:] == ["-", "-", "20.4", "-", "9.1 / 9.6", "11.7 (anon 5.6, file 6.2)", "0",
                                         "**first: VAEDecode: OutOfMemoryError: CUDA out of memory / Tried to "
                                         "allocate 2 GiB** |"]
    assert lines[5].split(" | ")[1:6] == [gguf, "no plan", "no plan", "1.60 (1.50–1.70, 3 prompts)", "-"]
    assert lines[6].split(" | ")[4] == "1.40"

    first, again = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    stopped = dict(mode="card12", card_gib=12.0, workflow="(process)", run="end", ok=False, error="timed out")
    first.write_text("".join(json.dumps(r) + "\n" for r in [*rows, stopped]))
    again.write_text("".join(json.dumps(r) + "\n" for r in _runs("card12", 12.0, gguf, [1.2], plans=[PLAN_LINE])))
    merged = subprocess.run([sys.executable, "-m", "checks.gpu.e2e_sweep", str(first), str(again)], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    assert merged[:5] == lines[:5] and merged[6:] == lines[6:]  # card12's stopped process is gone with its rows
    assert merged[5].split(" | ")[:6] == ["| 12 (10.9 usable)", gguf, lines[4].split(" | ")[2], "2.00", "1.20",
                                          "**0.60**"]


def test_the_gguf_text_encoder_twins_read_the_files_the_check_writes_for_them_alone(tmp_path):
    """Issue 44's twins: the GGUF workflow (its Q4_K_M DiT) with the text encoder loader naming llama.cpp's Q4_K_M
    or Q8_0 text encoder; the models folder gets those files only when such a twin runs, and the pack's loader reads
    them (tiny: the tiny text encoder's weights, its tokenizer grown to the model's vocabulary)."""
    from checks.gpu.e2e_models import GGUF_TEXT_ENCODERS, write_gguf_text_encoders
    from checks.gpu.gpu_e2e import parse_args, twin_files, twin_path
    from comfyui_ernie_image.nodes.text.encoder import ErnieTextEncoder

    twins = {"ernie_image_gguf_te_q4": "Q4_K_M", "ernie_image_gguf_te_q8": "Q8_0"}
    args = parse_args(["--workflows", ",".join(["ernie_image_turbo", *twins]), "--work", str(tmp_path)])
    for twin, file_type in twins.items():
        graph = json.loads(twin_path(args, twin).read_text())
        assert graph["te"]["class_type"] == "ErnieImageTextEncoderLoader"
        assert graph["te"]["inputs"]["model_name"] == f"text_encoders/ernie-image-text-encoder-{file_type}.gguf"
        assert graph["dit"]["inputs"]["model_name"] == "diffusion_models/ernie-image-turbo-Q4_K_M.gguf"
        assert graph["positive"]["inputs"]["text_encoder"] == ["te", 0]
    names = twin_files(args)
    assert names == sorted(GGUF_TEXT_ENCODERS) and {GGUF_TEXT_ENCODERS[n] for n in names} == set(twins.values())
    others = parse_args(["--workflows", "ernie_image_turbo_gguf,ernie_image_gguf,ernie_image_pe_local,no_such_twin",
                         "--work", str(tmp_path)])
    assert twin_files(others) == []
    models = tmp_path / "models"
    write_gguf_text_encoders(models, names, true_size=False)
    for name in names:
        encoder = ErnieTextEncoder.from_gguf(models / name, torch.float32)
        assert gguf.GGUFReader(str(models / name)).fields["general.file_type"].contents() == (
            15 if "Q4_K_M" in name else 7)  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M, _Q8_0
        embedding = encoder.encode("A cozy reading nook", torch.device("cpu"))
        assert torch.isfinite(embedding).all() and embedding.abs().max() > 0


def test_the_worker_keeps_room_on_the_disk_by_removing_the_oldest_saved_quantized_dits(tmp_path):
    """The H200's disk filled with the quantized DiTs the pack saved for three sources (2026-12-05): before each
    workflow the worker removes the oldest saved ones until the disk has room (a disk that has room is the fault a
    test cannot make: ``free`` answers as that disk would)."""
    import os

    from checks.gpu.e2e_worker import keep_disk_for_a_workflow

    saved = tmp_path / "ernie_quantized"
    for age, name in enumerate(["newest", "middle", "oldest"]):
        (saved / name).mkdir(parents=True)
        (saved / name / "w.safetensors").write_bytes(b"x" * 10)
        os.utime(saved / name, (1e9 - age * 100, 1e9 - age * 100))
    free = iter([5, 8, 20, 20])  # bytes free before each check: room after two removals
    assert keep_disk_for_a_workflow(saved, free=lambda path: next(free), need=10) == ["oldest", "middle"]
    assert sorted(p.name for p in saved.iterdir()) == ["newest"]
    assert keep_disk_for_a_workflow(tmp_path / "none", free=lambda path: 0, need=10) == []


def test_the_worker_collects_garbage_after_a_prompt_as_comfyuis_server_does():
    """ComfyUI's server collects after a prompt once 10 s passed since the last collection (0.3.75 main.py
    ``prompt_worker``); the check's in-process executor does the same, so an earlier workflow's models held only in
    reference cycles do not stay loaded longer than in a server."""
    import gc
    import weakref

    from checks.gpu.e2e_worker import ServerCollection

    class Held:
        pass

    def cycle() -> weakref.ref:
        held = Held()
        held.self = held
        return weakref.ref(held)

    gc.disable()  # only the worker's collection runs here
    try:
        collection = ServerCollection()
        first = cycle()
        collection.after_prompt()  # the first prompt: collected
        assert first() is None
        second = cycle()
        collection.after_prompt()  # within 10 s of the last collection: not yet
        assert second() is not None
        collection.last -= ServerCollection.INTERVAL_S
        collection.after_prompt()
        assert second() is None
    finally:
        gc.enable()


def test_the_worker_counts_the_models_alive_after_a_collection_loaded_or_not():
    """A row's ``alive``: the pack's and core's VAE models left after a garbage collection, cycles collected (a
    model kept only by a cycle is not counted; one kept by a reference is)."""
    from checks.gpu.e2e_worker import alive_models

    class ErnieImageModel(torch.nn.Module):  # the DiT's class name, as the pack's model has it
        pass

    before = alive_models().get("ErnieImageModel", 0)
    kept, cycle = ErnieImageModel(), ErnieImageModel()
    cycle.itself = [cycle]
    del cycle
    assert alive_models().get("ErnieImageModel", 0) == before + 1
    del kept
    assert alive_models().get("ErnieImageModel", 0) == before


def test_the_table_notes_more_models_of_a_kind_alive_than_a_workflow_uses():
    from checks.gpu.gpu_e2e import table

    row = dict(mode="card24", workflow="ernie_image_turbo_single_files", ok=True, seconds=1.1)
    one = table([dict(row, run="warm", alive={"ErnieImageModel": 1, "TextEncoderModule": 1})])
    two = table([dict(row, run="warm", alive={"ErnieImageModel": 2, "TextEncoderModule": 1})])
    assert "alive after a collection" not in one
    assert "alive after a collection: 2 ErnieImageModel" in two


def test_the_table_notes_a_first_prompt_that_began_with_memory_no_loaded_model_holds():
    """Session 42: after ``ernie_image_turbo``, whose DiT torchao quantized at load, the next workflow's first node
    began with 7.35 GiB allocated that no loaded model held (a reference cycle kept it until a collection). Models
    ComfyUI still holds loaded (a workflow reusing the last one's loaders began with 11.4 GiB) are not noted."""
    from checks.gpu.gpu_e2e import table

    row = dict(mode="default", workflow="ernie_image_turbo_lora", ok=True, seconds=7.9, run="first")
    assert "first prompt began with 7.35 GiB allocated that no loaded model holds" in table(
        [dict(row, unowned_at_start_gib=7.35)])
    assert "began with" not in table([dict(row, unowned_at_start_gib=0.03)]) + table([row])


def test_the_worker_counts_what_loaded_models_hold_as_core_counts_it(loaded_models):
    """The worker's count of loaded models' memory, taken off what is allocated as a prompt starts, reads core's
    own list (here on the CPU device); a model whose patcher is gone counts nothing, as in core, nor one on another
    device."""
    import gc

    from checks.gpu.e2e_worker import loaded_models_gib

    live = hold(torch.nn.Linear(64, 64), loaded_models)
    hold(torch.nn.Linear(32, 32), loaded_models)  # its patcher dropped at once
    gc.collect()
    assert loaded_models_gib(torch.device("cpu")) * 2**30 == live.loaded_size() == 64 * 64 * 4 + 64 * 4
    assert loaded_models_gib(torch.device("meta")) == 0


def test_a_runs_row_lists_the_compile_phases_it_waited_for_and_none_when_nothing_compiled():
    import torch

    from checks.gpu.e2e_worker import compile_phases, compile_seconds

    compiled = torch.compile(lambda x: (x * 3).cos(), dynamic=False)
    before = compile_phases()
    with torch._inductor.config.patch(force_disable_caches=True):  # a first run: inductor's disk cache not read
        compiled(torch.randn(5))
    phases = compile_seconds(before)
    assert phases["_compile.compile_inner"][0] == 1 and phases["_compile.compile_inner"][1] > 0
    assert phases["compile_fx_inner"][0] == 1
    before = compile_phases()
    compiled(torch.randn(5))  # the same shape: no compile
    assert compile_seconds(before) == {}


def test_host_ram_names_the_shared_peak_and_what_the_last_prompt_left_resident():
    """A host-RAM peak above the anonymous and file-backed ones is shared pages (pinned host memory may count there),
    and a peak far above what the last prompt left resident is a transient copy (the PE workflow at 12 GB peaked at
    28.4 GiB, anon 16.0, file 1.3: the rest was not told apart)."""
    from checks.gpu.e2e_sweep import host_ram
    from checks.gpu.e2e_worker import HostMemoryPeaks

    runs = [dict(peak_rss_gib=28.4, peak_rss_anon_gib=16.0, peak_rss_file_gib=1.3, peak_rss_shmem_gib=11.0,
                 rss_now_gib=25.0),
            dict(peak_rss_gib=28.4, peak_rss_anon_gib=16.0, peak_rss_file_gib=1.3, peak_rss_shmem_gib=11.0,
                 rss_now_gib=21.2)]
    assert host_ram(runs, digits=1) == "28.4 (anon 16.0, file 1.3, shmem 11.0, after the last prompt 21.2)"
    assert host_ram([dict(peak_rss_gib=5.0)]) == "5"  # older rows: the peak alone
    row = HostMemoryPeaks(interval=60).row()  # this process, read now from /proc/self/status
    assert 0 < row["rss_now_gib"] < 1024
