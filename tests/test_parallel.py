"""ERNIE-Image Parallel on the CPU: rank 0 is this process, its worker a real process on gloo, built from the
loader's recipe with the LoRA replayed, sampled by ComfyUI's own sampler (``comfy.sample``) on the tiny DiT. The code
is what runs on NCCL with GPUs, but for the backend's name (``pool._backend``).

Each split of the forward equals the single-process forward within float32 rounding, and so do the latents after 8
steps; the measured differences are printed (``-s``) for the record in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import signal

import comfy.model_management
import pytest
import torch

from comfyui_ernie_image.nodes.accel.cache_presets import CacheSettings
from comfyui_ernie_image.nodes.accel.patching import CacheJob, apply_cache
from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.host.parallel import WorkerMemory
from comfyui_ernie_image.nodes.host.sampling import DIFFUSION_MODEL
from comfyui_ernie_image.nodes.host.sizes import module_bytes
from comfyui_ernie_image.nodes.loaders import ErnieImageDiTLoader
from comfyui_ernie_image.nodes.lora.patching import apply_lora
from comfyui_ernie_image.nodes.parallel import patching
from comfyui_ernie_image.nodes.parallel.nodes import ErnieImageParallel
from comfyui_ernie_image.nodes.parallel.patching import apply_parallel, stop_workers
from comfyui_ernie_image.nodes.parallel.pool import CPU_WORKERS, worker_gpus
from helpers.accel import sample, text, tiny_patcher
from helpers.lora import LAYERS, deltas, lora_file

pytestmark = pytest.mark.usefixtures("cpu_workers")
TOLERANCE = 1e-5  # float32 rounding of a forward whose outputs are ~3 in size; measured: up to 1e-6
ROUGH = CacheSettings(Fn_compute_blocks=4, residual_diff_threshold=0.5, max_warmup_steps=2, taylorseer_order=1)


@pytest.fixture(scope="module")
def base(tiny_models, comfy_paths):
    """The tiny DiT from the DiT loader (its recipe is what the workers build from), with a LoRA on it."""
    model = ErnieImageDiTLoader.execute("diffusion_models/ernie-image-turbo-tiny.safetensors").result[0]
    with_lora, report = apply_lora(model, lora_file("peft", deltas(LAYERS, seed=1)), 1.0, "lora")
    assert report.applied == 3
    yield with_lora
    stop_workers()  # the other test files sample without workers in this process


def recorded(model) -> tuple[object, list[torch.Tensor]]:
    """A clone of ``model`` that keeps each DiT forward's output. Put before the parallel node, its wrapper is the
    outer one and sees the gathered output."""
    outputs: list[torch.Tensor] = []
    clone = model.clone()
    clone.add_wrapper_with_key(DIFFUSION_MODEL, "test-record",
                               lambda executor, *a, **kw: outputs.append(executor(*a, **kw).clone()) or outputs[-1])
    return clone, outputs


def workers() -> list:
    return list(patching._current.pool.processes.values())


CASES = {  # mode, cfg, prompt tokens: with the 8×8 latent's 64 image tokens
    "sequence-cfg1-even": ("sequence", 1.0, 6),  # 70 tokens: two equal slices, no mask
    "sequence-cfg1-padded": ("sequence", 1.0, 7),  # 71: padded to 72, the padding masked
    "sequence-cfg4": ("sequence", 4.0, 7),  # cond and uncond batched, texts of 7 and 3 tokens: masked and padded
    "cfg-cfg4": ("cfg", 4.0, 7),  # cond on rank 0, uncond on rank 1
    "cfg-cfg1": ("cfg", 1.0, 7),  # one row: split as sequence
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_split_equals_one_process(base, case):
    mode, cfg, tokens = CASES[case]
    prompt = text(tokens, 100)
    single, single_outputs = recorded(base)
    expected = sample(single, cfg=cfg, prompt=prompt)
    split, split_outputs = recorded(base)
    result = sample(apply_parallel(split, mode, 2), cfg=cfg, prompt=prompt)
    forward = float((split_outputs[0] - single_outputs[0]).abs().max())  # the same inputs: the first step's
    latent = float((result - expected).abs().max())
    print(f"\n{case}: first forward max |diff| {forward:.2e}, latent after 8 steps {latent:.2e}")
    assert len(split_outputs) == len(single_outputs) == 8
    assert forward <= TOLERANCE and latent <= TOLERANCE


@pytest.mark.parametrize("mode, cfg", [("sequence", 1.0), ("cfg", 4.0)])
def test_cache_dit_decides_once_for_all_ranks(base, mode, cfg, caplog):
    """The same steps cached as in one process (cache-dit's decision is averaged over the group, equal slices: the
    whole batch's), and the same latent; a Cache-DiT run beside the workers without the node is refused."""
    caplog.set_level(logging.INFO)
    prompt = text(6, 100)  # 70 tokens: equal slices with no padding, so the residuals are the one process's
    stop_workers()
    expected = sample(apply_cache(base, CacheJob(ROUGH, "rough", None)), cfg=cfg, prompt=prompt)
    parallel = apply_parallel(apply_cache(base, CacheJob(ROUGH, "rough", None)), mode, 2)
    result = sample(parallel, cfg=cfg, prompt=prompt)
    single_line, split_line = [r.getMessage() for r in caplog.records if "Cache-DiT [rough]" in r.getMessage()]
    strip = re.compile(r", residual diff mean .*")  # the diffs' last digits may round apart
    assert strip.sub("", split_line) == strip.sub("", single_line)
    assert int(re.search(r"(\d+) cached", single_line).group(1)) >= 2, single_line
    latent = float((result - expected).abs().max())
    print(f"\nCache-DiT {mode} CFG {cfg}: {split_line.split(': ', 1)[1]}; latent max |diff| {latent:.2e}")
    assert latent <= TOLERANCE
    with pytest.raises(ErnieImageError, match="would wait forever"):
        sample(apply_cache(base, CacheJob(ROUGH, "rough", None)), cfg=cfg, prompt=prompt)


def test_a_worker_killed_with_sigkill_gives_a_clear_error_and_the_next_run_samples(base):
    model = apply_parallel(base, "sequence", 2)
    expected = sample(model, cfg=1.0, steps=2)

    def kill() -> None:
        (worker,) = workers()
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()

    # Inside a forward: the worker waits in an all-to-all, and rank 0's next one finds its connection closed.
    hook = base.model.diffusion_model.layers[5].register_forward_pre_hook(lambda *_: kill())
    try:
        with pytest.raises(ErnieImageError, match="rank 1 .on the CPU. was killed by SIGKILL during this step"):
            sample(model, cfg=1.0, steps=2)
    finally:
        hook.remove()
    assert torch.equal(sample(model, cfg=1.0, steps=2), expected)

    # Between two steps: the next step's job finds the worker gone.
    with pytest.raises(ErnieImageError, match="rank 1 .on the CPU. was killed by SIGKILL before this step"):
        sample(model, cfg=1.0, steps=2, callback=lambda step, *_: step == 0 and kill())
    assert torch.equal(sample(model, cfg=1.0, steps=2), expected)


def test_model_management_counts_the_workers_and_they_stop_on_free_and_with_their_model(base):
    model = apply_parallel(base, "sequence", 2)
    sample(model, cfg=1.0, steps=1)
    entries = [m for m in comfy.model_management.current_loaded_models if isinstance(m.model, WorkerMemory)]
    assert [(e.device, e.model_memory()) for e in entries if e.model_memory()] == [
        (torch.device("cpu"), module_bytes(base.model.diffusion_model))]
    first = workers()
    comfy.model_management.unload_all_models()  # what POST /free runs
    assert all(worker.poll() is not None for worker in first)

    sample(model, cfg=1.0, steps=1)  # started again
    second = workers()
    assert second != first and all(worker.poll() is None for worker in second)
    del model  # ComfyUI drops the node's output when the next prompt no longer has the node
    gc.collect()
    assert all(worker.poll() is not None for worker in second)


def test_the_node_says_what_does_not_fit(base, tiny_models):
    with pytest.raises(ErnieImageError, match="use a GPU count that divides 4"):
        ErnieImageParallel.execute(base, "sequence", 3)  # the tiny DiT has 4 heads
    with pytest.raises(ErnieImageError, match="connect the MODEL of an ERNIE-Image loader"):
        ErnieImageParallel.execute(tiny_patcher(tiny_models["snapshot"]), "cfg", 2)


def test_more_gpus_than_cuda_shows_are_refused_computed_for_one_visible_gpu():
    """What the node raises on a one-GPU machine (this CPU machine has none to show it)."""
    assert worker_gpus(torch.device("cuda", 1), 3, visible=4) == [0, 2]
    with pytest.raises(ErnieImageError, match="asks for 2 GPUs, and this ComfyUI sees 1"):
        worker_gpus(torch.device("cuda", 0), 2, visible=1)


def test_workers_on_the_cpu_are_refused_without_the_switch_and_beyond_two_with_it(base, monkeypatch):
    """Each worker holds a whole DiT in this machine's memory (an 8B DiT in fp32: 32 GB): a ComfyUI without the GPUs
    gets words, not up to 7 copies of the DiT."""
    monkeypatch.delenv(CPU_WORKERS)
    with pytest.raises(ErnieImageError, match=r"runs a worker on each extra CUDA GPU.* this ComfyUI runs the DiT on "
                                              rf"CPU .*{CPU_WORKERS}=1 allows up to 2"):
        ErnieImageParallel.execute(base, "cfg", 2)
    monkeypatch.setenv(CPU_WORKERS, "1")
    with pytest.raises(ErnieImageError, match="at most 2 workers on the CPU.* use gpus 3 or fewer"):
        ErnieImageParallel.execute(base, "sequence", 4)  # 4 divides the tiny DiT's 4 heads: only the cap refuses
