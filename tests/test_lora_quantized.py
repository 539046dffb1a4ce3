"""LoRAs on a torchao-quantized DiT (the low-VRAM recipe's): each patched layer's weight is read again from the DiT's
file, core merges the LoRA into it, and the result is quantized with the same method; unloading restores the
quantized weights exactly.

On the CPU, torchao runs int8_weight_only and fp8_weight_only (fp8_per_row needs FP8 tensor cores, and cache-dit's
whole-DiT quantize() needs CUDA): the tiny DiT is quantized here layer by layer with the same function that makes a
patched layer again, which applies cache-dit's own torchao configuration, as its quantize() does to each layer.
"""

from __future__ import annotations

import logging

import comfy.sd
import pytest
import torch
from safetensors.torch import save_file

from comfyui_ernie_image.nodes.dit.build import load_dit
from comfyui_ernie_image.nodes.dit.model import make_model_patcher
from comfyui_ernie_image.nodes.dit.weights import tensor_locations
from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.lora.patching import apply_lora
from comfyui_ernie_image.nodes.quant.requantize import Requantizer
from helpers.accel import sample as core_sample
from helpers.lora import LAYERS, OTHER_LAYERS, deltas, lora_file
from helpers.quant_files import comfy_quant_fp8, header_fp8, scaled_fp8

DTYPE = torch.bfloat16  # what fp8_per_row quantizes from, and the recipe's
METHODS = ("int8_weight_only", "float8_weight_only")  # cache-dit's names: the pack's int8_weight_only, fp8_weight_only
# How far the LoRA'd quantized DiT's latent (4 steps, CFG 1, 8x8) may lie from the merged-then-quantized one's: one
# level of an 8-bit image. Measured: 0.0 for both methods, at strengths 1 and 3 (core adds the LoRA to the file's
# weight in fp32 as the reference does, so the same bf16 weight is quantized). For scale: quantizing itself moves the
# latent 0.006 (int8) and 0.010 (fp8) from the bf16 DiT's; the LoRA at strength 1 moves it 0.28.
TOLERANCE = 1 / 255


def sample(model) -> torch.Tensor:
    """The Turbo recipe's sampling, shortened: 4 steps, CFG 1 (no negative pass)."""
    return core_sample(model, steps=4, cfg=1.0)


def block_linears(dit: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {name: m for name, m in dit.named_modules() if isinstance(m, torch.nn.Linear) and name.startswith("layers.")}


def quantized_dit(source, quant_type: str, merge: dict[str, torch.Tensor] | None = None):
    """The DiT at ``source`` in bf16, its block linear layers quantized with ``quant_type`` as the loader does,
    after adding ``merge``'s deltas (layer → delta, in fp32) to their weights."""
    dit = load_dit(source, DTYPE)
    requantizer = Requantizer(source, quant_type, DTYPE, tensor_locations)
    for name, linear in block_linears(dit).items():
        weight = linear.weight.float() + (merge or {}).get(name, 0)
        linear.weight = requantizer.quantized(weight)
    dit.requantizer = requantizer
    return make_model_patcher(dit, whole=True)


def lora_deltas(*loras: tuple[dict, float]) -> dict[str, torch.Tensor]:
    """Each layer's ``Σ strength · up @ down`` (PEFT LoRAs without alpha: scale 1)."""
    merged: dict[str, torch.Tensor] = {}
    for lora, strength in loras:
        for layer, (down, up) in lora.items():
            merged[layer] = merged.get(layer, 0) + strength * (up @ down)
    return merged


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(params=METHODS)
def method(request) -> str:
    return request.param


@pytest.fixture
def plain(tiny_models, method):
    """The quantized DiT without a LoRA and its latent."""
    model = quantized_dit(tiny_models["snapshot"], method)
    return model, sample(model)


def test_a_peft_lora_equals_the_weights_merged_then_quantized(tiny_models, method, plain, caplog):
    lora = deltas(LAYERS, seed=1)
    with caplog.at_level(logging.INFO):
        patched, report = apply_lora(plain[0], lora_file("peft", lora), 1.0, "style")
        ours = sample(patched)
    expected = sample(quantized_dit(tiny_models["snapshot"], method, lora_deltas((lora, 1.0))))
    assert report.applied == 3
    assert distance(ours, plain[1]) > 10 * TOLERANCE  # the LoRA changes the image well past the tolerance
    assert distance(ours, expected) < TOLERANCE
    said = [r.getMessage() for r in caplog.records if "merged LoRA patches" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("ERNIE-Image: merged LoRA patches into 3 quantized layers "
                                                 "(re-quantized in ")
    weights = dict(patched.model.diffusion_model.named_parameters())
    assert all(Requantizer.holds(weights[f"{layer}.weight"]) for layer in LAYERS)  # still quantized, not bf16


def test_only_the_patched_layers_are_read_and_backed_up(tiny_models, plain, monkeypatch):
    """No plain copy of the DiT: each patched layer's weight is read alone from the file, and core's backup holds the
    quantized weights of those layers only."""
    from comfyui_ernie_image.nodes.quant import requantize

    read = []
    real = requantize.read_safetensors
    monkeypatch.setattr(requantize, "read_safetensors", lambda path, keys: read.extend(keys) or real(path, keys))
    patched, _ = apply_lora(plain[0], lora_file("peft", deltas(LAYERS, seed=7)), 1.0, "style")
    sample(patched)  # ComfyUI loads it (the plain DiT it shares the module with was loaded before)
    assert sorted(read) == sorted(f"{layer}.weight" for layer in LAYERS)
    assert sorted(patched.backup) == sorted(f"diffusion_model.{layer}.weight" for layer in LAYERS)
    assert all(Requantizer.holds(backup.weight) for backup in patched.backup.values())


def test_cores_lora_loader_takes_it_too(tiny_models, method, plain):
    """What core's LoraLoaderModelOnly runs (``comfy.sd.load_lora_for_models``) ends in the same ``add_patches``."""
    lora = deltas(LAYERS, seed=2)
    patched, _ = comfy.sd.load_lora_for_models(plain[0], None, lora_file("ai-toolkit", lora), 0.8, 0.0)
    expected = sample(quantized_dit(tiny_models["snapshot"], method, lora_deltas((lora, 0.8))))
    assert distance(sample(patched), expected) < TOLERANCE


def test_a_changed_stack_is_quantized_again_and_removing_it_restores_the_dit_exactly(tiny_models, method, plain):
    model, plain_latent = plain
    first, second = deltas(LAYERS, seed=3), deltas(OTHER_LAYERS + LAYERS[:1], seed=4)
    once, _ = apply_lora(model, lora_file("peft", first), 1.0, "first")
    assert distance(sample(once), sample(quantized_dit(tiny_models["snapshot"], method,
                                                       lora_deltas((first, 1.0))))) < TOLERANCE
    twice, _ = apply_lora(once, lora_file("peft", second), 0.5, "second")  # stacked, on a layer of the first too
    assert distance(sample(twice), sample(quantized_dit(tiny_models["snapshot"], method,
                                                        lora_deltas((first, 1.0), (second, 0.5))))) < TOLERANCE
    weaker, _ = apply_lora(model, lora_file("peft", first), 0.3, "first")  # the strength changed
    assert distance(sample(weaker), sample(quantized_dit(tiny_models["snapshot"], method,
                                                         lora_deltas((first, 0.3))))) < TOLERANCE
    assert torch.equal(sample(model), plain_latent)  # the LoRA loader taken out: the quantized weights as they were


def test_other_adapters_merge_as_core_computes_them(tiny_models, method, plain):
    """LoKr here (LoHa and DoRA go the same way): core's formula merges it, whatever the kind."""
    w1, w2 = torch.randn(8, 4, generator=torch.manual_seed(5)), torch.randn(16, 16, generator=torch.manual_seed(6))
    lokr = {"diffusion_model.layers.2.mlp.up_proj.lokr_w1": w1 * 0.5,
            "diffusion_model.layers.2.mlp.up_proj.lokr_w2": w2 * 0.5}
    patched, report = apply_lora(plain[0], lokr, 1.0, "lokr")
    expected = sample(quantized_dit(tiny_models["snapshot"], method,
                                    {"layers.2.mlp.up_proj": torch.kron(w1, w2) * 0.25}))
    assert report.applied == 1
    assert distance(sample(patched), plain[1]) > 10 * TOLERANCE
    assert distance(sample(patched), expected) < TOLERANCE


@pytest.mark.parametrize("layout", ["snapshot", "single file", "prefixed file", "scaled fp8", "comfy_quant fp8",
                                    "header fp8"])
def test_a_layers_original_weight_is_what_the_loader_quantized(tiny_models, tmp_path, layout):
    """Read alone from the file in every layout the loader reads, an fp8 file's scale multiplied in as it does."""
    source = tiny_models["snapshot"] if layout == "snapshot" else tmp_path / "dit.safetensors"
    if layout != "snapshot":
        weights = {k: v.contiguous() for k, v in load_dit(tiny_models["snapshot"], torch.float32).state_dict().items()}
        metadata = None
        if layout == "prefixed file":
            weights = {f"model.diffusion_model.{k}": v for k, v in weights.items()}
        elif layout == "scaled fp8":
            weights = scaled_fp8(weights)
        elif layout == "comfy_quant fp8":
            weights = comfy_quant_fp8(weights)
        elif layout == "header fp8":
            weights, metadata = header_fp8(weights)
        save_file(weights, source, metadata=metadata)
    loaded = dict(load_dit(source, DTYPE, DTYPE).named_parameters())  # as a quantizing loader asks (asked_dtypes)
    requantizer = Requantizer(source, "int8_weight_only", DTYPE, tensor_locations)
    for key in ("layers.0.self_attention.to_q.weight", "layers.9.mlp.linear_fc2.weight"):
        assert torch.equal(requantizer.original(key), loaded[key])


def test_an_svdquant_dit_still_refuses_loras(plain):
    """An SVDQuant DiT (no requantizer: its layers are a low-rank branch beside 4-bit weights) refuses in words."""
    model = plain[0].clone()
    del model.model.diffusion_model.requantizer
    with pytest.raises(ErnieImageError, match="quantized with SVDQuant .* quantize it with fp8_per_row or "
                                              "int8_weight_only"):
        apply_lora(model, lora_file("peft", deltas(LAYERS, 1)), 1.0, "x")



def test_a_lora_applies_inside_the_inference_mode_comfyui_runs_nodes_in(tiny_models, method, plain):
    """ComfyUI runs the LoRA loader under ``torch.inference_mode()``, where core's ``add_patches`` reads the model's
    ``state_dict()``: torchao's weights cannot be detached there (the GPU check's LoRA on the FP8 recipe failed so:
    "Cannot set version_counter for inference tensor"). The patches are taken outside it, as loads are."""
    lora = deltas(LAYERS, seed=1)
    with torch.inference_mode():
        patched, report = apply_lora(plain[0], lora_file("peft", lora), 1.0, "style")
        ours = sample(patched)
    expected = sample(quantized_dit(tiny_models["snapshot"], method, lora_deltas((lora, 1.0))))
    assert report.applied == 3
    assert distance(ours, expected) < TOLERANCE
