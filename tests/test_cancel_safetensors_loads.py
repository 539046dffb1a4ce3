"""Issue 41: Cancel stops a LoRA load and a safetensors DiT load between two tensors.

ComfyUI's own interrupt (``interrupt_current_processing``, what ``/interrupt`` sets) is set from inside the reading of
the k-th tensor, counted on the pack's real reader; the load must stop before the next tensor with ComfyUI's
``InterruptProcessingException`` (reported as an interrupted prompt), leave nothing behind, and the next load must
work. Main read on to the end (a LoRA of 5 000 tensors: 13.9 s after the user's Cancel on the audit's machine).
"""

from __future__ import annotations

import time

import comfy.model_management as mm
import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_ernie_image.nodes import model_files
from comfyui_ernie_image.nodes.loaders import ErnieImageDiTLoader
from comfyui_ernie_image.nodes.lora.files import MAX_TENSORS, read_lora
from comfyui_ernie_image.nodes.lora.patching import apply_lora
from comfyui_ernie_image.nodes.paths import model_file_path
from helpers.accel import tiny_patcher
from helpers.lora import BLOCK_LINEARS, RANK

K = 50  # the interrupt lands while this tensor is read


@pytest.fixture
def reads(monkeypatch):
    """Counts the tensors the pack reads, and those read after ComfyUI's interrupt was set; ``reads["cancel_at"]``:
    the read during which it is set (0: never)."""
    counts = {"all": 0, "after": 0, "cancel_at": 0}
    real = model_files._read_tensor

    def counting(*args, **kwargs):
        if mm.processing_interrupted():
            counts["after"] += 1
        counts["all"] += 1
        if counts["all"] == counts["cancel_at"]:
            mm.interrupt_current_processing(True)  # the user presses Cancel while this tensor is read
        return real(*args, **kwargs)

    monkeypatch.setattr(model_files, "_read_tensor", counting)
    yield counts
    mm.interrupt_current_processing(False)


def _cancelled(reads: dict, load) -> None:
    """``load()`` with Cancel pressed during the K-th tensor: stopped by ComfyUI's interrupt, at most the tensor in
    hand finished."""
    reads.update({"all": 0, "after": 0, "cancel_at": K})
    try:
        with pytest.raises(mm.InterruptProcessingException):
            load()
    finally:
        mm.interrupt_current_processing(False)
    assert reads["all"] == K and reads["after"] <= 1, reads


def _uninterrupted(reads: dict, load, what: str):
    reads.update({"all": 0, "after": 0, "cancel_at": 0})
    start = time.perf_counter()
    result = load()
    print(f"{what}: {reads['all']} tensors read uninterrupted in {time.perf_counter() - start:.2f} s")
    return result


def test_cancel_stops_a_lora_load_of_many_tensors(tiny_models, placed, reads):
    """A LoRA of the most tensors the loader reads: the tiny DiT's 70 linear layers, and foreign layers."""
    generator = torch.Generator().manual_seed(16)
    tensors = {}
    for block in range(10):
        for layer, (rows, cols) in BLOCK_LINEARS.items():
            name = f"diffusion_model.layers.{block}.{layer}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, cols, generator=generator) * 0.1
            tensors[f"{name}.lora_B.weight"] = torch.randn(rows, RANK, generator=generator) * 0.1
    for i in range((MAX_TENSORS - len(tensors)) // 2):
        tensors[f"diffusion_model.foreign.{i}.lora_A.weight"] = torch.randn(RANK, 64, generator=generator)
        tensors[f"diffusion_model.foreign.{i}.lora_B.weight"] = torch.randn(64, RANK, generator=generator)
    save_file(tensors, placed("loras", "many_tensors.safetensors"))
    model = tiny_patcher(tiny_models["snapshot"])

    def load():  # what the LoRA loader node runs
        path = model_file_path("loras", "many_tensors.safetensors")
        return apply_lora(model, read_lora(path, path.name), 1.0, path.name)

    _cancelled(reads, load)
    assert not model.patches  # the MODEL given to the node is untouched; no patched clone was made
    patched, report = _uninterrupted(reads, load, "LoRA")
    assert reads["all"] == len(tensors)
    assert report.applied == 70 and len(patched.patches) == 70


def test_cancel_stops_a_safetensors_dit_load(tiny_models, placed, reads):
    """The tiny DiT grown to the most blocks the loader builds (256, each a copy of one of its 10)."""
    tiny = load_file(tiny_models["single_file"])
    tensors = {k: v for k, v in tiny.items() if not k.startswith("layers.")}
    for block in range(256):
        tensors |= {f"layers.{block}.{k.split('.', 2)[2]}": v.clone() for k, v in tiny.items()
                    if k.startswith(f"layers.{block % 10}.")}
    save_file(tensors, placed("diffusion_models", "many_blocks.safetensors"))
    loaded = len(mm.current_loaded_models)

    def load():  # what ComfyUI runs for the DiT loader node
        return ErnieImageDiTLoader.execute("many_blocks.safetensors", "default", "none").result[0]

    _cancelled(reads, load)
    assert len(mm.current_loaded_models) == loaded
    model = _uninterrupted(reads, load, "DiT")
    assert reads["all"] == len(tensors)
    assert len(model.model.diffusion_model.layers) == 256
