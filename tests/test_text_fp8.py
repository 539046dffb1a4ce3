"""The text encoder with its decoder linears in fp8: bytes, embedding error against bf16, core's fp8 file layouts
loading as fp8 without a bf16 copy, and its loader node through a running ComfyUI (the PE's: test_pe_fp8.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.fp8_linear import FP8, Fp8Linear, linear_bytes, quantize_rows
from comfyui_ernie_image.nodes.text.encoder import ErnieTextEncoder
from helpers.quant_files import comfy_quant_fp8, scaled_fp8
from helpers.workflows import text_to_image

PROMPTS = ["a red cat sits on a blue mat", "一只 红色 的 猫"]
# Measured on the tiny model (bf16 compute, 2026-12-01): the fp8 encoder's embeddings (per-row scales) 0.037–0.041
# relative error against bf16; a per-tensor-scaled fp8 file 0.051–0.058 against the per-row one. Bounds: about 2×.
EMBEDDING_ERROR = 0.08
FILE_ERROR = 0.12


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


@pytest.fixture(scope="module")
def encoders(tiny_models):
    file = tiny_models["text_encoder_file"]
    return (ErnieTextEncoder.from_single_file(file, torch.bfloat16),
            ErnieTextEncoder.from_single_file(file, torch.bfloat16, fp8=True))


def test_the_fp8_encoder_holds_half_the_bytes_and_stays_close_to_bf16(encoders):
    bf16, fp8 = encoders
    linears = [m for m in fp8.language_model.modules() if isinstance(m, Fp8Linear)]
    assert linears and all(m.weight.dtype == FP8 for m in linears)
    assert fp8.language_model.embed_tokens.weight.dtype == torch.bfloat16
    bf16_bytes, fp8_bytes = linear_bytes(bf16.language_model), linear_bytes(fp8.language_model)
    print(f"decoder linear weights: bf16 {bf16_bytes} B, fp8 {fp8_bytes} B ({fp8_bytes / bf16_bytes:.3f}×)")
    assert fp8_bytes * 2 == bf16_bytes
    cpu = torch.device("cpu")
    for prompt in PROMPTS:
        error = _relative_error(fp8.encode(prompt, cpu), bf16.encode(prompt, cpu))
        print(f"fp8 vs bf16 embedding relative error ({prompt!r}): {error:.4f}")
        assert 0 < error < EMBEDDING_ERROR


@pytest.mark.parametrize("layout", [scaled_fp8, comfy_quant_fp8])
def test_a_core_fp8_file_loads_as_fp8_like_the_bf16_file_quantized_at_load(tiny_models, encoders, tmp_path, layout):
    source = load_file(tiny_models["text_encoder_file"])
    written = tmp_path / "ministral-fp8.safetensors"
    save_file(layout(source, prefix="model.layers."), written)
    loaded = ErnieTextEncoder.from_single_file(written, torch.bfloat16)  # default weight dtype: an fp8 file stays
    assert linear_bytes(loaded.language_model) == linear_bytes(encoders[1].language_model)
    cpu = torch.device("cpu")
    for prompt in PROMPTS:
        reference = encoders[0].encode(prompt, cpu)
        at_load = encoders[1].encode(prompt, cpu)
        from_file = loaded.encode(prompt, cpu)
        error = _relative_error(from_file, at_load)
        print(f"{layout.__name__} file vs quantized at load ({prompt!r}): {error:.4f}")
        assert error < FILE_ERROR and _relative_error(from_file, reference) < FILE_ERROR


def test_a_non_finite_scale_is_refused(tiny_models, tmp_path):
    tensors = scaled_fp8(load_file(tiny_models["text_encoder_file"]), prefix="model.layers.")
    key = next(k for k in tensors if k.endswith(".scale_weight"))
    tensors[key] = torch.tensor(float("nan"))
    written = tmp_path / "damaged.safetensors"
    save_file(tensors, written)
    with pytest.raises(ErnieImageError, match=r"the scale .*\.scale_weight is nan; a scale must be a finite positive"):
        ErnieTextEncoder.from_single_file(written, torch.bfloat16)


def test_per_row_quantization_keeps_each_row_within_fp8_precision():
    weight = torch.randn(64, 256) * torch.logspace(-3, 1, 64)[:, None]
    fp8, scale = quantize_rows(weight)
    assert fp8.dtype == FP8 and scale.shape == (64, 1)
    assert _relative_error(fp8.float() * scale, weight) < 0.04


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_an_fp8_layer_gives_the_scaled_weights_product_without_overflow_in_fp16(dtype):
    """bf16 and fp32 scale the product (one pass over the weight less), fp16 the weight: the unscaled product of fp8
    values up to 448 and large activations overflows fp16's 65,504. Each equals the product with the scaled weight
    within the dtype's rounding."""
    torch.manual_seed(0)
    weight = torch.randn(96, 512) * torch.logspace(-3, -1, 96)[:, None]
    layer = Fp8Linear(512, 96, bias=True)
    layer.weight.data, layer.weight_scale = quantize_rows(weight)
    layer.bias.data = torch.randn(96)
    x = torch.randn(4, 512) * 60  # activations as large as a language model's outliers
    expected = torch.nn.functional.linear(x.double(), layer.weight.double() * layer.weight_scale.double(),
                                          layer.bias.double())
    out = layer(x.to(dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert _relative_error(out, expected) < {torch.float32: 1e-5}.get(dtype, 1e-2)


def test_the_loader_node_holds_fp8_only_when_asked(comfy_paths, tiny_models):
    from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader

    name = f"text_encoders/{tiny_models['text_encoder_file'].name}"
    asked = ErnieImageTextEncoderLoader.execute(name, "cpu", "fp8_e4m3fn").result[0]
    saved_before = ErnieImageTextEncoderLoader.execute(name, "cpu").result[0]  # a workflow without the input
    assert any(isinstance(m, Fp8Linear) for m in asked.encoder.language_model.modules())
    assert not any(isinstance(m, Fp8Linear) for m in saved_before.encoder.language_model.modules())


def test_e2e_the_loader_node_runs_fp8_in_a_running_comfyui(comfy_server):
    """Through ComfyUI's executor: the text encoder loader with weight_dtype fp8_e4m3fn, and as saved before the
    input existed, each to an image; the fp8 encoder's embeddings change the image."""
    images = {}
    for weight_dtype in ("fp8_e4m3fn", None):
        graph = text_to_image(snapshot="diffusers/ERNIE-Image-Turbo-tiny", prompt="a red cat", steps=2)
        loader = {"model_name": "text_encoders/ministral-3-3b-tiny.safetensors", "device": "default"}
        graph["text_encoder"] = {"class_type": "ErnieImageTextEncoderLoader",
                                 "inputs": loader if weight_dtype is None else {**loader, "weight_dtype": weight_dtype}}
        for encode in ("positive", "negative"):
            graph[encode]["inputs"]["text_encoder"] = ["text_encoder", 0]
        result = comfy_server.run(graph)
        assert result.status == "success", result.messages
        (path,) = [p for p in comfy_server.output_images(result) if p.is_file()]
        images[weight_dtype] = np.asarray(Image.open(path)).astype(int)
    difference = np.abs(images["fp8_e4m3fn"] - images[None]).mean()
    print(f"fp8 vs default text encoder in the graph: the image differs by {difference:.2f} of 255 on average")
    assert difference > 0
