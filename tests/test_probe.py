"""Issue 43: what each form costs on this machine, measured once by the probe (``nodes/host/probe.py``) on synthetic
layers and kept in ComfyUI's user folder, keyed by the GPU, its driver and torch.

The probe's own code runs here on the CPU device with tiny shapes (the true ones take an H200 a few seconds); the
costs file goes through a real ComfyUI 0.3.75 core's user folder (``folder_paths``), its progress bar and its Cancel.
"""

from __future__ import annotations

import importlib.util
import json
import math

import comfy.model_management as mm
import comfy.utils
import folder_paths
import pytest
import torch

from comfyui_ernie_image.nodes.gguf.dequant import BLOCKS
from comfyui_ernie_image.nodes.host import probe
from comfyui_ernie_image.nodes.plan.costs import MAX_FILE_BYTES, read_costs

TINY = probe.Shapes(dit_hidden=64, dit_heads=4, dit_ffn=128, dit_blocks=2, dit_tokens=40, text_hidden=64,
                    text_heads=4, text_kv_heads=2, text_head_dim=16, text_ffn=128, text_layers=2, text_tokens=8,
                    pe_cached_tokens=16, vocab=512, vae_channels=32, vae_mult=(1, 1), vae_latent_channels=4,
                    vae_latent=8, copy_bytes=1 << 20)
CPU = torch.device("cpu")
KEY = "NVIDIA H200; driver 580.95.05; torch 2.11.0+cu130; CUDA 13.0; probe 3"


@pytest.fixture
def user_dir(tmp_path):
    """ComfyUI's user folder (``--user-directory``, which core's CLI sets so) in a temporary folder."""
    before = folder_paths.get_user_directory()
    folder_paths.set_user_directory(str(tmp_path / "user"))
    yield tmp_path / "user"
    folder_paths.set_user_directory(before)


@pytest.fixture
def measured(monkeypatch):
    """How often the real probe measured (it runs as it is; each call is counted)."""
    calls = []
    real = probe.measure

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(probe, "measure", counted)
    return calls


def test_the_probe_gives_a_finite_positive_cost_for_every_form_and_reports_its_progress():
    steps = []
    costs = probe.measure(CPU, TINY, progress=lambda done, total: steps.append((done, total)))
    gguf = {f"dit:gguf:{kind}" for kind in BLOCKS}
    assert gguf == {f"dit:gguf:{kind}" for kind in ("Q8_0", "Q6_K", "Q5_1", "Q5_K", "Q5_0", "Q4_1", "Q4_K", "IQ4_NL",
                                                    "Q4_0", "IQ4_XS", "Q3_K", "Q2_K")}
    fp8_matmul = {"dit:fp8_matmul"} if probe.fp8_matmul_runs(CPU) else set()
    text_gguf = {f"{model}:gguf:{kind}" for model in ("text", "pe") for kind in BLOCKS}  # a GGUF text encoder or PE
    assert set(costs.seconds) == {"dit:bf16", "dit:fp8_cast", "text:bf16", "text:fp8", "pe:bf16", "pe:fp8"} | gguf \
        | fp8_matmul | text_gguf | {"vae", "lora:dit_per_gb"}
    assert set(costs.cpu_seconds) == {"text:bf16", "image:png"}  # the encode, and the decoded image as a PNG
    numbers = [costs.pinned, costs.pageable, *costs.seconds.values(), *costs.cpu_seconds.values()]
    assert all(isinstance(n, float) and math.isfinite(n) and n > 0 for n in numbers), costs
    total = steps[-1][1]
    assert steps == [(done, total) for done in range(1, total + 1)]
    assert costs.key == probe.machine_key(CPU) and f"torch {torch.__version__}" in costs.key


def test_with_no_time_left_each_form_is_still_measured_once():
    costs = probe.measure(CPU, TINY, budget_s=0)
    assert {"dit:bf16", "dit:fp8_cast", "text:fp8", "pe:fp8"} <= set(costs.seconds)
    assert all(math.isfinite(v) and v > 0 for v in costs.seconds.values())


def test_cancel_stops_the_probe_before_its_next_measurement():
    steps = []

    def cancel_after_the_third(done, total):
        steps.append(done)
        if done == 3:
            mm.interrupt_current_processing(True)  # the user presses Cancel during the probe

    try:
        with pytest.raises(mm.InterruptProcessingException):
            probe.measure(CPU, TINY, progress=cancel_after_the_third)
    finally:
        mm.interrupt_current_processing(False)
    assert steps == [1, 2, 3]


def test_the_costs_are_kept_in_comfyuis_user_folder_and_read_back(user_dir, measured):
    bar = []
    comfy.utils.set_progress_bar_global_hook(lambda value, total, preview, node_id=None: bar.append((value, total)))
    try:
        first = probe.kept_or_measured(probe.costs_path(), KEY, CPU, TINY)
    finally:
        comfy.utils.set_progress_bar_global_hook(None)
    path = user_dir / "ernie-image" / "costs.json"
    assert probe.costs_path() == path and path.is_file()
    assert bar[-1][0] == bar[-1][1] > 10, bar  # ComfyUI's progress bar went to its end
    assert first.key == KEY and read_costs(path, KEY) == first
    assert probe.kept_or_measured(path, KEY, CPU, TINY) == first
    assert len(measured) == 1, "the kept costs were measured again"
    assert sorted(p.name for p in path.parent.iterdir()) == ["costs.json"]  # no partial file left behind


def test_a_new_gpu_driver_or_torch_or_a_deleted_file_measures_again(user_dir, measured):
    path = probe.costs_path()
    probe.kept_or_measured(path, KEY, CPU, TINY)
    new_driver = KEY.replace("580.95.05", "590.10")
    assert probe.kept_or_measured(path, new_driver, CPU, TINY).key == new_driver
    assert json.loads(path.read_text())["key"] == new_driver
    assert len(measured) == 2
    path.unlink()
    probe.kept_or_measured(path, new_driver, CPU, TINY)
    assert len(measured) == 3 and read_costs(path, new_driver) is not None


def _valid() -> dict:
    return {"key": KEY, "pinned": 5e10, "pageable": 1e10, "seconds": {"dit:bf16": 0.04}, "cpu_seconds": {}}


HOSTILE = {
    "not JSON": b"{\"key\": ",
    "not UTF-8": b"\xff\xfe{}",
    "a list": b"[1, 2]",
    "NaN": json.dumps(_valid() | {"seconds": {"dit:bf16": float("nan")}}).encode(),
    "Infinity": json.dumps(_valid() | {"pinned": float("inf")}).encode(),
    "negative": json.dumps(_valid() | {"seconds": {"dit:bf16": -1.0}}).encode(),
    "zero": json.dumps(_valid() | {"pageable": 0}).encode(),
    "a cost that makes a form free": json.dumps(_valid() | {"seconds": {"dit:bf16": 1e-300}}).encode(),
    "a cost of centuries": json.dumps(_valid() | {"cpu_seconds": {"text:bf16": 1e300}}).encode(),
    "a string": json.dumps(_valid() | {"seconds": {"dit:bf16": "0.04"}}).encode(),
    "a boolean": json.dumps(_valid() | {"pinned": True}).encode(),
    "a table that is a list": json.dumps(_valid() | {"seconds": [0.04]}).encode(),
    "another machine's key": json.dumps(_valid() | {"key": "NVIDIA GeForce RTX 4090; driver 1"}).encode(),
    "no key": json.dumps({k: v for k, v in _valid().items() if k != "key"}).encode(),
    "huge": json.dumps(_valid() | {"pad": "x" * MAX_FILE_BYTES}).encode(),
    "too many entries": json.dumps(_valid() | {"seconds": {f"k{i}": 1.0 for i in range(300)}}).encode(),
    "nested 30,000 deep": b"[" * 30_000 + b"]" * 30_000,  # within the size bound: on main a RecursionError escaped
}


def test_the_hostile_cases_differ_from_a_file_that_is_believed(tmp_path):
    (tmp_path / "costs.json").write_text(json.dumps(_valid()))
    assert read_costs(tmp_path / "costs.json", KEY).seconds == {"dit:bf16": 0.04}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_damaged_or_hostile_costs_file_is_ignored_and_rewritten(user_dir, measured, case):
    path = probe.costs_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(HOSTILE[case])
    costs = probe.kept_or_measured(path, KEY, CPU, TINY)
    assert len(measured) == 1, f"{case}: the file was believed"
    assert costs.seconds["dit:bf16"] != 0.04 and read_costs(path, KEY) == costs


def test_a_costs_file_that_links_to_an_endless_device_is_replaced_not_read(user_dir, measured):
    path = probe.costs_path()
    path.parent.mkdir(parents=True)
    path.symlink_to("/dev/zero")
    costs = probe.kept_or_measured(path, KEY, CPU, TINY)
    assert len(measured) == 1 and not path.is_symlink() and read_costs(path, KEY) == costs


def test_a_link_planted_where_the_costs_are_written_is_not_followed(user_dir, tmp_path, measured):
    """Another process made ``costs.partial`` (the name a fixed temporary file would have) a link to a file of the
    user's: writing the costs must not write through it."""
    path = probe.costs_path()
    path.parent.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's file")
    path.with_suffix(".partial").symlink_to(victim)
    costs = probe.kept_or_measured(path, KEY, CPU, TINY)
    assert victim.read_text() == "the user's file" and read_costs(path, KEY) == costs


def test_no_costs_where_there_is_no_cuda_gpu(user_dir, measured):
    assert probe.costs_here("cpu") is None
    if not torch.cuda.is_available():
        assert probe.costs_here("cuda") is None and probe.costs_here(torch.device("cuda", 0)) is None
    assert measured == [] and not user_dir.exists()


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="NVML answers first where installed")
@pytest.mark.parametrize("line, version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 18:56:32 UTC 2023", "535.129.03"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  (dvs-builder@U16)",
     "580.95.05"),
    ("something else", "unknown"),
])
def test_without_nvml_the_driver_version_is_read_from_the_kernel_modules_file(tmp_path, line, version):
    probe.driver_version.cache_clear()  # read once per process: each case is a new process's first reading
    (tmp_path / "version").write_text(line + "\nGCC version:  gcc version 12.2.0\n")
    assert probe.driver_version(tmp_path / "version") == version
    assert probe.driver_version(tmp_path / "missing") == "unknown"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU (the H200 check runs it)")
def test_on_a_gpu_a_pe_tokens_work_is_timed_as_a_replayed_cuda_graph():
    """A PE token's kernels are timed as the PE runs them (captured once, replayed): the replay repeats the work on
    the tensors captured, and a run that cannot be captured (it waits on the host, as ``.item()`` does: a fault the
    probe's own layers do not give) is timed as launched, the probe going on."""
    cuda = torch.device("cuda")
    total, step = torch.zeros((), device=cuda), torch.ones((), device=cuda)
    replay = probe._graphed(lambda: total.add_(step), cuda)
    assert float(total) == 1  # the warm-up ran it; the capture records without running
    replay()
    replay()
    assert float(total) == 3
    step.fill_(10)
    replay()
    assert float(total) == 13  # the captured tensors are read at each replay
    before = float(total)
    waits = probe._graphed(lambda: total.add_(step).item(), cuda)  # its warm-up runs it once
    waits()
    assert float(total) == before + 20  # the run itself, not a graph
    again = probe._graphed(lambda: total.add_(step), cuda)  # the stream captures again after the failed capture
    again()
    assert float(total) == before + 40
