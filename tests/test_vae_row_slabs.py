"""The loader's VAE decodes large images a slab of rows at a time (``nodes/host/vae.decode_in_row_slabs``): each
height-keeping convolution, each ResnetBlock's norm → SiLU → convolution and each Upsample's upsampling; less memory,
the same image. Core's own blocks (``comfy/ldm/modules/diffusionmodules/model.py``) on random weights."""

from __future__ import annotations

import comfy.ldm.modules.diffusionmodules.model as vae_model
import comfy.model_management
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
        assert host_vae.decode_in_row_slabs(layer) == 1
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
    assert host_vae.decode_in_row_slabs(torch.nn.Sequential(strided, padless)) == 0
    assert type(strided) is torch.nn.Conv2d and type(padless) is torch.nn.Conv2d


def _randomise(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    for name, parameter in list(module.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        value = torch.randn(parameter.shape) * (0.2 if leaf == "weight" and parameter.ndim > 1 else 1.0)
        setattr(module.get_submodule(owner) if owner else module, leaf, torch.nn.Parameter(value.to(dtype)))
    return module.eval()


def _counting(monkeypatch, target, name: str) -> list:
    calls, real = [], getattr(target, name)
    monkeypatch.setattr(target, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize(("dtype", "core_casts"),
                         [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)])
def test_a_resnet_block_in_slabs_equals_the_whole(dtype, core_casts, monkeypatch):
    block = _randomise(vae_model.ResnetBlock(in_channels=64, out_channels=32, temb_channels=0), dtype)
    for norm in (block.norm1, block.norm2):
        norm.comfy_cast_weights = core_casts  # True: the weights come through core's cast, as when loaded in part
    x = torch.randn(2, 64, 37, 21).to(dtype)
    with torch.inference_mode():
        whole = block(x)
        assert host_vae.decode_in_row_slabs(block) == 4  # the block and its three convolutions
        monkeypatch.setattr(host_vae, "SLAB_BYTES", 8 * 2 * 21 * (64 + 32) * x.element_size())
        norms = _counting(monkeypatch, torch.nn.functional, "group_norm")
        convolutions = _counting(monkeypatch, torch.nn.Conv2d, "_conv_forward")
        sliced = block(x)
    assert isinstance(block, vae_model.ResnetBlock) and sliced.dtype == dtype
    assert not norms and len(convolutions) > 8  # no whole normalised copy; the convolutions a slab at a time
    if dtype == torch.bfloat16:  # the same numbers up to bf16's rounding of a norm computed in another order:
        # a few elements one unit in the last place apart (1/32 for values in [4, 8))
        torch.testing.assert_close(sliced, whole, rtol=0.016, atol=2**-5)
        assert (sliced != whole).float().mean() < 0.01
    else:
        torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)


def test_an_upsample_in_slabs_equals_the_whole(monkeypatch):
    upsample = _randomise(vae_model.Upsample(6, with_conv=True), torch.float32)
    x = torch.randn(2, 6, 19, 11)
    with torch.inference_mode():
        whole = upsample(x)
        assert host_vae.decode_in_row_slabs(upsample) == 2  # the upsample and its convolution
        monkeypatch.setattr(host_vae, "SLAB_BYTES", 5 * 2 * 2 * 11 * (6 + 6) * 4)  # slabs of 5 of the 38 rows
        emptied = _counting(monkeypatch, comfy.model_management, "soft_empty_cache")
        interpolations = []
        real = torch.nn.functional.interpolate
        monkeypatch.setattr(torch.nn.functional, "interpolate",
                            lambda t, *a, **k: interpolations.append(t.shape[-2]) or real(t, *a, **k))
        sliced = upsample(x)
    assert len(interpolations) == 8 and max(interpolations) <= 5  # the upsampled image never whole
    assert len(emptied) == 1  # the cache emptied once, before the first slab
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)


def test_blocks_called_as_current_cores_call_them_take_the_slabs(monkeypatch):
    """Current cores' Decoder calls ``block(h, temb, conv_carry_in, conv_carry_out)`` and ``upsample(h, conv_carry_in,
    conv_carry_out)``, the carries None for an image (comfy/ldm/modules/diffusionmodules/model.py @9b6bab1b); 0.3.75's
    blocks, called that way, compute in slabs too (else users' cores would keep the whole-image copies)."""
    block = _randomise(vae_model.ResnetBlock(in_channels=32, out_channels=32, temb_channels=0), torch.float32)
    upsample = _randomise(vae_model.Upsample(32, with_conv=True), torch.float32)
    x = torch.randn(1, 32, 40, 12)
    with torch.inference_mode():
        whole_block, whole_upsample = block(x), upsample(x)
        host_vae.decode_in_row_slabs(torch.nn.ModuleList([block, upsample]))
        monkeypatch.setattr(host_vae, "SLAB_BYTES", 2**14)
        norms = _counting(monkeypatch, torch.nn.functional, "group_norm")
        interpolations = _counting(monkeypatch, torch.nn.functional, "interpolate")
        sliced_block, sliced_upsample = block(x, None, None, None), upsample(x, None, None)
    assert not norms and len(interpolations) > 1
    torch.testing.assert_close(sliced_block, whole_block, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sliced_upsample, whole_upsample, rtol=1e-5, atol=1e-5)


def test_the_loaders_vae_decodes_the_same_image_in_slabs(tiny_models, monkeypatch):
    vae = load_vae(tiny_models["vae_file"])
    decoder = vae.first_stage_model.decoder
    convolutions = [m for m in decoder.modules() if isinstance(m, torch.nn.Conv2d)]
    assert convolutions and all(isinstance(m, host_vae._RowSlabConv) for m in convolutions)
    assert all(isinstance(m, host_vae._RowSlabResnetBlock) for m in decoder.modules()
               if isinstance(m, vae_model.ResnetBlock))
    assert any(isinstance(m, host_vae._RowSlabUpsample) for m in decoder.modules())
    assert not any(isinstance(m, host_vae._RowSlabConv) for m in vae.first_stage_model.encoder.modules())
    assert host_vae.decode_in_row_slabs(decoder) == 0  # once is enough
    # In float64: slabs sum each convolution in another order, which in float32 moved one of 23,040 values by
    # 1.04e-5 on one 2-core CI-like machine (torch 2.14.1; CPUs differ in the kernels they pick); in float64 the two
    # agree within a few of the output's float32 steps.
    vae.first_stage_model.to(torch.float64)
    vae.vae_dtype = torch.float64
    torch.manual_seed(1)
    latent = torch.randn(1, vae.latent_channels, 6, 5)
    calls = _counting(monkeypatch, torch.nn.Conv2d, "_conv_forward")
    norms = _counting(monkeypatch, torch.nn.functional, "group_norm")
    with torch.inference_mode():
        whole = vae.decode(latent)
        whole_calls, whole_norms = len(calls), len(norms)
        monkeypatch.setattr(host_vae, "SLAB_BYTES", 64 * 2**10)
        sliced = vae.decode(latent)
    assert len(calls) - whole_calls > 2 * whole_calls  # most convolutions ran in several slabs
    assert len(norms) - whole_norms < whole_norms / 2  # most blocks normalised a slab at a time
    torch.testing.assert_close(sliced, whole, rtol=0, atol=2e-6)  # measured: 5.4e-7
