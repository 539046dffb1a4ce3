"""Every model the pack loads works after ComfyUI moves it, whatever mode its loader ran in.

ComfyUI runs every node inside ``torch.inference_mode()``, so a loader's weights are made there, and model
management moves them between devices inside or outside it (``/free`` unloads between prompts). On a GPU a move
copies every weight; a weight made in inference mode whose copy is then put in place outside it breaks every later
forward ("Inference tensors do not track version counter", the first sampling step of every GPU user on
2026-12-01). On the CPU a move to the CPU copies nothing, which hid it: ``CopyingMoves`` makes every ``Tensor.to``
return a copy, as a move to another device does.
"""

from __future__ import annotations

import comfy.model_management as mm
import pytest
import torch
from safetensors.torch import save_file
from torch.overrides import TorchFunctionMode

from comfyui_ernie_image.nodes.dit.vae import load_vae
from comfyui_ernie_image.nodes.loaders import ErnieImageDiTLoader, ErnieImageLoader, _load_model
from comfyui_ernie_image.nodes.lora.patching import apply_lora
from comfyui_ernie_image.nodes.model_files import read_safetensors
from comfyui_ernie_image.nodes.pe.comfy_runtime import ComfyRuntime
from comfyui_ernie_image.nodes.pe.local.enhancer import LocalPromptEnhancer
from comfyui_ernie_image.nodes.pe.protocol import PromptSpec, SamplingParams
from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader
from helpers.accel import sample, text
from helpers.lora import LAYERS, deltas, lora_file
from helpers.quant_files import comfy_quant_fp8
from scripts.tiny_models import write_gguf_dit


class CopyingMoves(TorchFunctionMode):
    """A move to the CPU copies every tensor, as a move to or from a GPU does (the stand-in for the GPU)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.Tensor.to and result is args[0]:
            return result.clone()
        return result


def free_models() -> None:
    """What ``POST /free`` runs between prompts, outside inference mode."""
    with CopyingMoves():
        mm.unload_all_models()


@pytest.fixture(autouse=True)
def unloaded():
    free_models()
    yield
    free_models()


def loaded_in_inference_mode(node, *inputs):
    with torch.inference_mode():
        return node.execute(*inputs).result


@pytest.mark.parametrize("loader, name", [(ErnieImageLoader, "ERNIE-Image-Turbo-tiny"),
                                          (ErnieImageDiTLoader, "ernie-image-turbo-tiny.safetensors")])
def test_the_dit_samples_after_moves_and_after_free(comfy_paths, loader, name):
    model = loaded_in_inference_mode(loader, name, "fp32", "none")[0]
    with CopyingMoves():
        first = sample(model, steps=2, cfg=4.0)  # loads (a move), cond + uncond batched
    free_models()
    with CopyingMoves():
        again = sample(model, steps=2, cfg=4.0)
    assert first.abs().max() > 0
    torch.testing.assert_close(again, first)


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "with a LoRA"])
def test_a_dit_in_cores_quantized_layers_samples_after_moves_and_after_free(tiny_models, tmp_path, lora):
    """Core's mixed-precision layers hold their fp8 weights as tensor subclasses, which core's sizing (``state_dict``)
    cannot detach inside inference mode once moved outside it; nor can a LoRA loader's ``add_patches``, which reads
    the same ``state_dict`` inside it."""
    path = tmp_path / "ernie-image-turbo-fp8.safetensors"
    save_file(comfy_quant_fp8(read_safetensors(tiny_models["single_file"])), path)
    with torch.inference_mode():
        model = _load_model(path, "default", "none", 4.0)
        if lora:
            model, report = apply_lora(model, lora_file("ai-toolkit", deltas(LAYERS, 1)), 1.0, "tiny.safetensors")
            assert report.applied == len(LAYERS)
    _samples_again_after_free(model)


def _samples_again_after_free(model) -> None:
    """``model`` samples under moves that copy, and after ComfyUI's /free the same again."""
    with CopyingMoves():
        first = sample(model, steps=2, cfg=4.0)
    free_models()
    with CopyingMoves():
        again = sample(model, steps=2, cfg=4.0)
    assert first.abs().max() > 0
    torch.testing.assert_close(again, first)


def test_a_gguf_dit_with_a_lora_samples_after_moves_and_after_free(tmp_path):
    """A GGUF DiT's blocks are read in inference mode and its LoRA patches are put on parameters when it loads,
    which ComfyUI does inside inference mode too (``host/gguf_layers.GGUFModelPatcher``)."""
    path = write_gguf_dit(tmp_path / "ernie-image-tiny-Q4_K_M.gguf")
    with torch.inference_mode():
        model = _load_model(path, "default", "none", 4.0)
        model, report = apply_lora(model, lora_file("ai-toolkit", deltas(LAYERS, 1)), 1.0, "tiny.safetensors")
    assert report.applied == len(LAYERS)
    _samples_again_after_free(model)


@pytest.mark.parametrize("name", ["ERNIE-Image-Turbo-tiny", "text_encoders/ministral-3-3b-tiny.safetensors"])
def test_the_text_encoder_encodes_after_moves_and_after_free(comfy_paths, name):
    (encoder,) = loaded_in_inference_mode(ErnieImageTextEncoderLoader, name)
    results = []
    for _ in range(2):
        with torch.inference_mode(), CopyingMoves():
            results.append(encoder.encode("a red cat sits on a blue mat"))
        free_models()
    assert results[0].abs().max() > 0
    torch.testing.assert_close(results[1], results[0])


def test_the_vae_decodes_after_moves_and_after_free(tiny_models):
    with torch.inference_mode():
        vae = load_vae(tiny_models["vae_file"])
    latent = text(1, 0).new_zeros(1, 128, 4, 4).normal_(generator=torch.manual_seed(3))
    images = []
    for _ in range(2):
        with torch.inference_mode(), CopyingMoves():
            images.append(vae.decode(latent))
        free_models()
    torch.testing.assert_close(images[1], images[0])


@pytest.mark.parametrize("layout", ["snapshot", "pe_single_file"])
def test_the_local_pe_enhances_after_moves_and_after_free(tiny_models, layout):
    """Loaded on first use, inside the enhance node (inference mode), with its fused gate/up layers."""
    pe = LocalPromptEnhancer.from_path(tiny_models[layout], runtime=ComfyRuntime())
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    texts = []
    for _ in range(2):
        with torch.inference_mode(), CopyingMoves():
            texts.append(pe.enhance([PromptSpec("a cat", 1024, 1024)], params)[0].text)
        free_models()
    assert texts[0] and texts[1] == texts[0]
