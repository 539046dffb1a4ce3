"""Out-of-memory advice that fits the state: what is chosen, and the one next step that would fit, for each state a
16 or 24 GB card (and an 8 GB one) meets, through a real ComfyUI core (in-process, CPU) and the tiny models.

The CPU cannot run out of GPU memory, so the fault is injected (the names say so): every move to the GPU fails
(``OutOfMemoryOnMoves``) or a sampling step's attention does (``OutOfMemoryInAttention``). The ``meta`` device
stands in for the GPU of a load, as in test_quant_lowvram.py; what ComfyUI counts as free (``usable_memory``) is
injected too (core cannot count a meta device, nor make a CPU's RAM small), sized from the models' own bytes so
that the step named fits and the ones before it do not. Each test holds its own list of ComfyUI's loaded models.
"""

from __future__ import annotations

import comfy.model_management as mm
import pytest
import torch

from comfyui_ernie_image.nodes.accel.cache_presets import CacheSettings
from comfyui_ernie_image.nodes.accel.patching import CacheJob, apply_cache, cache_store_bytes
from comfyui_ernie_image.nodes.dit.build import load_dit
from comfyui_ernie_image.nodes.dit.model import make_model_patcher
from comfyui_ernie_image.nodes.dit.weights import tensor_locations
from comfyui_ernie_image.nodes.host import oom
from comfyui_ernie_image.nodes.host.memory import load_whole
from comfyui_ernie_image.nodes.memory_advice import format_bytes as shown  # n bytes as the advice shows them
from comfyui_ernie_image.nodes.quant.requantize import Requantizer
from comfyui_ernie_image.nodes.text.encoder import ErnieTextEncoder
from comfyui_ernie_image.nodes.text.managed import ManagedTextEncoder
from helpers.accel import sample
from helpers.faults import OutOfMemoryInAttention, OutOfMemoryOnMoves

GPU = torch.device("meta")
KiB = 2**10
TE_FP8_STEP = "set the text encoder's weight_dtype to fp8_e4m3fn"
TE_CPU_STEP = "set the text encoder's device to cpu"
STREAMED_STEP = "set the DiT loader's quantization to none with weight_dtype fp8_e4m3fn"
CACHE_STEP = "bypass ERNIE-Image Cache-DiT"


@pytest.fixture(autouse=True)
def loaded_models(monkeypatch) -> list:
    """ComfyUI's list of loaded models, empty for this test (core reads the module's list at every call)."""
    models: list = []
    monkeypatch.setattr(mm, "current_loaded_models", models)
    return models


@pytest.fixture
def free(monkeypatch):
    """``free(n)``: ComfyUI counts ``n`` bytes free on every device (injected)."""
    return lambda n: monkeypatch.setattr(oom, "usable_memory", lambda device: n)


def hold(patcher, loaded_models: list):
    """``patcher``'s model loaded on the stand-in GPU by core's own ``LoadedModel``, and listed as ComfyUI lists the
    models it holds (``load_models_gpu`` itself would count the meta device's memory, which it cannot)."""
    patcher.load_device = GPU
    loaded = mm.LoadedModel(patcher)
    loaded.model_load()
    loaded_models.insert(0, loaded)
    return patcher


def failed_load(patcher) -> str:
    """The error of loading ``patcher``'s model whole on the stand-in GPU, where every move fails."""
    patcher.load_device = GPU
    with OutOfMemoryOnMoves(), pytest.raises(torch.OutOfMemoryError) as raised:
        patcher.load(GPU)
    message = str(raised.value)
    print(message)  # the words each state gets, in the test log (-s)
    assert message.endswith("\nCUDA out of memory. Tried to allocate 64.00 MiB")  # still core's error, after
    return message


def next_steps(message: str) -> str:
    """The advice's last line: the step (or steps) it names."""
    return message.splitlines()[-2]


def text_encoder(snapshot, fp8: bool = False):
    """The tiny text encoder in bf16 (its decoder linears in fp8 when asked), on the stand-in GPU."""
    return ManagedTextEncoder(ErnieTextEncoder.from_snapshot(snapshot, torch.bfloat16, fp8), device="meta").patcher


def bf16_dit(snapshot):
    """The bf16 DiT as the loader makes it with quantization none on an sm89+ GPU, where it would offer fp8_per_row
    (``quantize_to``: injected, the loader finds no GPU here)."""
    dit = load_dit(snapshot, torch.bfloat16)
    dit.quantize_to = "fp8_per_row"
    return make_model_patcher(dit)


def fp8_per_row_dit(snapshot):
    """The DiT as the loader makes it with quantization fp8_per_row: bf16, its block linears quantized by torchao
    and loaded whole. Per-row fp8 needs FP8 tensor cores, so torchao's fp8 weight-only layout (one byte a weight and
    a scale per row, as per-row fp8 holds them) stands in for it; the loader's record of the choice is injected."""
    dit = load_dit(snapshot, torch.bfloat16)
    requantizer = Requantizer(snapshot, "float8_weight_only", torch.bfloat16, tensor_locations)
    for name, linear in dit.named_modules():
        if isinstance(linear, torch.nn.Linear) and name.startswith("layers."):
            linear.weight = requantizer.quantized(linear.weight.float())
    dit.quantization, dit.quantize_to = "fp8_per_row", "fp8_per_row"
    return make_model_patcher(dit, whole=True)


def test_dit_none_bf16_and_text_encoder_bf16_advise_quantizing_the_dit_injected_oom(tiny_models, loaded_models,
                                                                                     free):
    """The text encoder does not fit beside the bf16 DiT, and fp8 text weights would not free enough."""
    snapshot = tiny_models["snapshot"]
    dit = hold(bf16_dit(snapshot), loaded_models)
    te = text_encoder(snapshot)
    missing = te.model.memory_choices().fp8_saving + 16 * KiB  # fp8 text weights fall 16 KiB short
    free(te.model_size() - missing)
    message = failed_load(te)
    assert message.startswith(f"ERNIE-Image: the text encoder (TextEncoderModule) needs {shown(te.model_size())} on "
                              "meta as a whole (it cannot be loaded in part)")
    assert (f"Chosen: text encoder weight_dtype bf16, device meta; DiT quantization none, weight_dtype bf16 "
            f"({shown(dit.model_size())} on meta).") in message
    assert next_steps(message).startswith(f"Next step that fits ({shown(missing)} missing): set the DiT loader's "
                                          "quantization to fp8_per_row: its block weights in one byte each, loaded "
                                          "whole")
    assert TE_FP8_STEP not in message  # frees too little
    assert "int8_weight_only" not in message  # the GPU runs fp8_per_row: one method, the best


def test_dit_fp8_per_row_and_text_encoder_bf16_advise_fp8_text_weights_injected_oom(tiny_models, loaded_models,
                                                                                     free):
    """The case of the issue's 8 GB card: the DiT is fp8_per_row already, and the advice must not say so again."""
    snapshot = tiny_models["snapshot"]
    te = hold(text_encoder(snapshot), loaded_models)
    dit = fp8_per_row_dit(snapshot)
    free(dit.model_size() - 64 * KiB)
    message = failed_load(dit)
    assert message.startswith(f"ERNIE-Image: the DiT (ErnieImageModel) needs {shown(dit.model_size())} on meta as a "
                              "whole")
    assert ("Chosen: DiT quantization fp8_per_row, weight_dtype bf16; text encoder weight_dtype bf16, device meta "
            f"({shown(te.model_size())} on meta).") in message
    assert next_steps(message) == (
        f"Next step that fits (64.0 KiB missing): {TE_FP8_STEP} (text_encoder_weight_dtype on the ERNIE-Image "
        f"Loader): its decoder layers' weights in fp8 (frees about {shown(te.model.memory_choices().fp8_saving)}).")
    assert "quantization to fp8_per_row" not in message and "int8_weight_only" not in message  # taken


@pytest.mark.parametrize("missing_kib, step", [(100, TE_CPU_STEP), (200, STREAMED_STEP)])
def test_dit_fp8_per_row_and_text_encoder_fp8_advise_the_cpu_or_a_streamed_dit_injected_oom(
        tiny_models, loaded_models, free, missing_kib, step):
    """Both quantized already: the text encoder off the GPU where that frees enough (its 124 KiB), else the DiT
    streamed by ComfyUI's partial loading; never fp8 again."""
    snapshot = tiny_models["snapshot"]
    te = hold(text_encoder(snapshot, fp8=True), loaded_models)
    dit = fp8_per_row_dit(snapshot)
    free(dit.model_size() - missing_kib * KiB)
    message = failed_load(dit)
    assert ("Chosen: DiT quantization fp8_per_row, weight_dtype bf16; text encoder weight_dtype fp8_e4m3fn, device "
            f"meta ({shown(te.model_size())} on meta).") in message
    assert next_steps(message).startswith(f"Next step that fits ({shown(missing_kib * KiB)} missing): {step}")
    assert TE_FP8_STEP not in message and "quantization to fp8_per_row" not in message  # taken
    other = STREAMED_STEP if step == TE_CPU_STEP else TE_CPU_STEP
    assert other not in message  # one step: the first that fits


def test_sampling_with_cache_dit_advises_bypassing_it_injected_oom(tiny_models, free):
    """A bf16-class DiT that fits, with Cache-DiT's stores on top (as on the emulated 16 GB card, H200
    2026-12-01): bypassing the node frees what is missing."""
    model = make_model_patcher(load_dit(tiny_models["snapshot"], torch.float32))
    job = CacheJob(CacheSettings(), "balanced", None)
    shape, text_tokens = [1, 128, 8, 8], 7  # CFG 1: the prompt alone, 7 tokens (helpers.accel.sample)
    dit = model.model.diffusion_model
    stores = cache_store_bytes(dit, model.model, job.settings, shape, text_tokens)
    need = int(model.model.memory_required(shape)) + stores
    free(need - stores)  # the step fits without the stores
    with OutOfMemoryInAttention(), pytest.raises(torch.OutOfMemoryError) as raised:
        sample(apply_cache(model, job), steps=1, cfg=1.0)
    message = str(raised.value)
    print(message)
    assert message.startswith(f"ERNIE-Image: sampling a 128×128 image ran out of memory on cpu: the step needs about "
                              f"{shown(need)} (ComfyUI's estimate, {shown(stores)} of it for ERNIE-Image Cache-DiT)")
    assert f"Chosen: DiT quantization none, weight_dtype fp32 ({shown(model.model_size())} on cpu)." in message
    assert next_steps(message) == (f"Next step that fits ({shown(stores)} missing): {CACHE_STEP}: what it keeps across "
                                   f"steps (frees about {shown(stores)}).")
    assert message.endswith("\nCUDA out of memory. Tried to allocate 198.00 MiB")


def test_nothing_left_to_take_says_the_card_is_too_small_injected_oom(tiny_models, free):
    """The DiT streamed in fp8 already, the text encoder in fp8 on the CPU, no Cache-DiT, and nothing free: no step
    is left, and the words hold for any card (what is missing, measured; no card size)."""
    snapshot = tiny_models["snapshot"]
    te = ManagedTextEncoder(ErnieTextEncoder.from_snapshot(snapshot, torch.bfloat16, fp8=True), device="cpu").patcher
    load_whole(te)  # as encoding a prompt loads it
    model = make_model_patcher(load_dit(snapshot, torch.float32, torch.float8_e4m3fn))
    free(0)
    with OutOfMemoryInAttention(), pytest.raises(torch.OutOfMemoryError) as raised:
        sample(model, steps=1, cfg=1.0)
    message = str(raised.value)
    print(message)
    need = model.model.memory_required([1, 128, 8, 8])
    assert ("Chosen: DiT quantization none, weight_dtype fp8_e4m3fn (" in message
            and "text encoder weight_dtype fp8_e4m3fn, device cpu (" in message)
    assert next_steps(message) == (
        f"The card is too small for this: every step the pack offers is taken already, and {shown(need)} is missing on "
        "cpu. Close other programs that use it, or use a GPU with more memory.")
    assert "Next step" not in message and "set the" not in message and "bypass" not in message
    assert " GB" not in message  # no card sizes: the floor is what these models and this step measure


def test_advice_that_cannot_be_worked_out_leaves_the_out_of_memory_error_injected_oom(tiny_models, monkeypatch, free,
                                                                                     caplog):
    """A model that fails to describe itself (injected) must not turn the error into another: ComfyUI frees its
    models only for an out-of-memory error."""
    te = text_encoder(tiny_models["snapshot"])

    def broken(self):
        raise RuntimeError("a broken description")

    monkeypatch.setattr(type(te.model), "memory_choices", broken)
    free(0)
    message = failed_load(te)
    assert message.startswith("ERNIE-Image: ran out of memory on meta; which step would fit could not be worked out "
                              "(the log says why).")
    assert "a broken description" in caplog.text
