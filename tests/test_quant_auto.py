"""``quantization: auto`` (``quant/choice.py``): what it picks on each class of card, and a real ComfyUI running a
workflow with it on the CPU."""

from __future__ import annotations

import math

import pytest

from comfyui_ernie_image.nodes.model_files import read_header
from comfyui_ernie_image.nodes.quant.capability import Facts
from comfyui_ernie_image.nodes.quant.choice import BESIDE_THE_DIT, GIB, choose, fp8_bytes
from helpers.workflows import text_to_image

# The true-size DiT's weights (ERNIE-Image and Turbo alike): 15.3 GB in bf16, so about 7.7 GB in FP8.
TRUE_SIZE_FP8 = int(7.7e9)
# ComfyUI's capacity for models (total less its minimum inference memory, 0.8 GiB + its 0.4 GiB default reserve).
CARD = {16: 16 * GIB - int(1.2 * GIB), 12: 12 * GIB - int(1.2 * GIB), 24: 24 * GIB - int(1.2 * GIB)}


def _gpu(arch: tuple[int, int], torchao: bool = True) -> Facts:
    return Facts(device="cuda:0", gpu="NVIDIA GeForce RTX", arch=arch, torchao=torchao)


@pytest.mark.parametrize("card", [16, 24])
def test_rtx_40_and_50_cards_of_16_gb_and_up_get_torchao_fp8(card):
    for arch in ((8, 9), (12, 0)):
        choice = choose(_gpu(arch), CARD[card], TRUE_SIZE_FP8, "default")
        assert (choice.quantization, choice.weight_dtype) == ("fp8_per_row", "default")
        assert "fit" in choice.why and f"sm{arch[0]}{arch[1]}" in choice.why


def test_a_12_gb_card_gets_fp8_storage_that_comfyui_streams():
    choice = choose(_gpu((8, 9)), CARD[12], TRUE_SIZE_FP8, "default")
    assert (choice.quantization, choice.weight_dtype) == ("none", "fp8_e4m3fn")
    assert "do not fit" in choice.why and "streams" in choice.why
    assert TRUE_SIZE_FP8 + BESIDE_THE_DIT > CARD[12]


@pytest.mark.parametrize("arch", [(8, 6), (8, 0), (7, 5)])
def test_gpus_without_fp8_matmul_get_fp8_storage_whatever_their_memory(arch):
    choice = choose(_gpu(arch), 80 * GIB, TRUE_SIZE_FP8, "default")
    assert (choice.quantization, choice.weight_dtype) == ("none", "fp8_e4m3fn")
    assert "no FP8 matmul" in choice.why


def test_without_torchao_fp8_storage_and_the_install_line():
    choice = choose(_gpu((8, 9), torchao=False), CARD[24], TRUE_SIZE_FP8, "default")
    assert (choice.quantization, choice.weight_dtype) == ("none", "fp8_e4m3fn")
    assert "pip install torchao" in choice.why


def test_not_an_nvidia_gpu_keeps_the_loaders_weight_dtype():
    choice = choose(Facts(device="cpu"), 64 * GIB, TRUE_SIZE_FP8, "bf16")
    assert (choice.quantization, choice.weight_dtype) == ("none", "bf16")


def test_the_fp8_size_is_one_byte_per_weight_of_the_files(tiny_models):
    snapshot = tiny_models["snapshot"]
    files = sorted((snapshot / "transformer").glob("*.safetensors"))
    weights = sum(math.prod(info.shape) for f in files for info in read_header(f).values())
    assert fp8_bytes(snapshot) == weights > 0
    assert fp8_bytes(tiny_models["single_file"]) == weights  # the single-file repack holds the same weights


def test_both_loaders_run_auto_on_the_cpu(comfy_server):
    for loader in ("dit", "loader"):
        dit_file = "ernie-image-turbo-tiny.safetensors" if loader == "dit" else None
        graph = text_to_image(snapshot="ERNIE-Image-Turbo-tiny", prompt="a cat", steps=1, seed=7, dit_file=dit_file,
                              prefix=f"auto_{loader}")
        graph[loader]["inputs"]["quantization"] = "auto"
        result = comfy_server.run(graph)
        assert result.status == "success", result.messages
        assert len(comfy_server.output_images(result)) == 1
