"""The loaders' quantization option through a running ComfyUI (CPU): every quantized method is refused before any
weights are read, with words that say why and what to choose; the server goes on; ``none`` samples."""

from __future__ import annotations

import pytest

from comfyui_ernie_image.nodes.quant.capability import METHODS
from helpers.workflows import text_to_image

SNAPSHOT = "ERNIE-Image-Turbo-tiny"
QUANTIZED = [m for m in METHODS if m != "none"]


def _graph(quantization: str, loader: str, seed: int) -> dict:
    dit_file = "ernie-image-turbo-tiny.safetensors" if loader == "dit" else None
    graph = text_to_image(snapshot=SNAPSHOT, prompt="a cat", steps=1, seed=seed, dit_file=dit_file,
                          prefix=f"quant_{seed}")
    graph[loader]["inputs"]["quantization"] = quantization
    return graph


def _samples(server, seed: int) -> None:
    result = server.run(_graph("none", "dit", seed))
    assert result.status == "success", result.messages
    assert len(server.output_images(result)) == 1


def test_both_loaders_offer_every_method(comfy_server):
    info = comfy_server.object_info()
    for node in ("ErnieImageLoader", "ErnieImageDiTLoader"):
        kind, spec = info[node]["input"]["required"]["quantization"]
        assert kind == "COMBO" and spec["options"] == ["auto", *METHODS] and spec["default"] == "auto"


@pytest.mark.parametrize("loader", ["dit", "loader"])
@pytest.mark.parametrize("method", QUANTIZED)
def test_a_method_that_cannot_run_here_says_why_and_the_server_goes_on(comfy_server, method, loader):
    seed = 100 + 10 * QUANTIZED.index(method) + (loader == "loader")
    result = comfy_server.run(_graph(method, loader, seed))
    assert result.status == "error", result.messages
    error = result.error
    assert error["node_id"] == loader
    assert error["exception_message"].strip() == (
        f"Quantization '{method}' needs an NVIDIA GPU (CUDA), but ComfyUI runs this model on cpu. "
        "Set quantization to 'none'."
    )
    assert not (comfy_server.base_dir / "models" / "ernie_quantized").exists()  # refused before any work
    _samples(comfy_server, seed)
