"""The loader's VAE decodes large images a slab of rows at a time in each height-keeping convolution
(``nodes/host/vae.convolve_in_row_slabs``): less scratch memory, the same image."""

from __future__ import annotations

import comfy.ops
import pytest
import torch

from comfyui_ernie_image.nodes.dit.vae import load_vae
from comfyui_ernie_image.nodes.host import vae as host_vae


def _conv(cls, kernel: int, padding: int, stride: int = 1) -> torch.nn.Conv2d:
    torch.manual_seed(0)
    layer = cls(6, 5, kernel_size=kernel, padding=padding, stride=stride)
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight, device="cpu"))
    layer.bias = torch.nn.Parameter(torch.randn(5))
    return layer


@pytest.mark.parametrize("cls", [comfy.ops.disable_weight_init.Conv2d, comfy.ops.manual_cast.Conv2d])
@pytest.mark.parametrize(("kernel", "padding"), [(3, 1), (1, 0), (5, 2)])
def test_a_convolution_in_slabs_equals_the_whole(cls, kernel, padding, monkeypatch):
    layer = _conv(cls, kernel, padding)
    x = torch.randn(2, 6, 37, 21)
    with torch.inference_mode():
        whole = layer(x)
        assert host_vae.convolve_in_row_slabs(layer) == 1
        row_bytes = (6 + 5) * 2 * 21 * 4
        monkeypatch.setattr(host_vae, "SLAB_BYTES", 8 * row_bytes)  # 5 slabs of 8 rows (the last 5)
        calls = []
        real = torch.nn.Conv2d._conv_forward
        monkeypatch.setattr(torch.nn.Conv2d, "_conv_forward", lambda s, *a: calls.append(a[0].shape) or real(s, *a))
        sliced = layer(x)
    assert isinstance(layer, cls)
    assert len(calls) == 5 and all(shape[-2] <= 8 + 2 * padding for shape in calls)
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)


def test_convolutions_that_change_the_height_are_left_whole():
    strided, padless = _conv(torch.nn.Conv2d, 3, 1, stride=2), _conv(torch.nn.Conv2d, 3, 0)
    assert host_vae.convolve_in_row_slabs(torch.nn.Sequential(strided, padless)) == 0
    assert type(strided) is torch.nn.Conv2d and type(padless) is torch.nn.Conv2d


def test_the_loaders_vae_decodes_the_same_image_in_slabs(tiny_models, monkeypatch):
    vae = load_vae(tiny_models["vae_file"])
    decoder_convs = [m for m in vae.first_stage_model.decoder.modules() if isinstance(m, torch.nn.Conv2d)]
    assert decoder_convs and all(isinstance(m, host_vae._RowSlabs) for m in decoder_convs)
    assert not any(isinstance(m, host_vae._RowSlabs) for m in vae.first_stage_model.encoder.modules())
    assert host_vae.convolve_in_row_slabs(vae.first_stage_model.decoder) == 0  # once is enough
    torch.manual_seed(1)
    latent = torch.randn(1, vae.latent_channels, 6, 5)
    calls = []
    real = torch.nn.Conv2d._conv_forward
    monkeypatch.setattr(torch.nn.Conv2d, "_conv_forward", lambda s, *a: calls.append(1) or real(s, *a))
    with torch.inference_mode():
        whole = vae.decode(latent)
        whole_calls = len(calls)
        monkeypatch.setattr(host_vae, "SLAB_BYTES", 64 * 2**10)
        sliced = vae.decode(latent)
    assert len(calls) - whole_calls > 2 * whole_calls  # most convolutions ran in several slabs
    torch.testing.assert_close(sliced, whole, rtol=0, atol=1e-5)
