"""``weight_dtype = default`` under ComfyUI's global unet dtype flags: a dtype the pack's DiT runs, an fp8 storage
(computing in bf16, fp32 where bf16 is unsupported, as on this CPU), or that fallback and one line in the log."""

from __future__ import annotations

import logging

import comfy.model_management as mm
import pytest
import torch

from comfyui_ernie_image.nodes import loaders
from comfyui_ernie_image.nodes.dit import precision
from comfyui_ernie_image.nodes.errors import ErnieImageError

FLAGS = ["fp32_unet", "bf16_unet", "fp16_unet", "fp8_e4m3fn_unet", "fp8_e5m2_unet", "fp8_e8m0fnu_unet", "fp64_unet"]


@pytest.fixture
def flag(request, monkeypatch):
    for name in FLAGS:
        monkeypatch.setattr(mm.args, name, name == request.param)
    precision._say_dtype_fallback.cache_clear()
    return request.param


@pytest.mark.parametrize("flag, expected", [("fp32_unet", torch.float32), ("bf16_unet", torch.bfloat16)],
                         indirect=["flag"])
def test_a_flag_the_dit_runs_in_is_followed_silently(flag, expected, caplog):
    with caplog.at_level(logging.WARNING):
        assert precision.weight_dtypes("default") == (expected, expected)
    assert not caplog.records


@pytest.mark.parametrize("flag, storage", [("fp8_e4m3fn_unet", torch.float8_e4m3fn),
                                           ("fp8_e5m2_unet", torch.float8_e5m2)], indirect=["flag"])
def test_an_fp8_flag_stores_the_weights_in_fp8(flag, storage, caplog):
    with caplog.at_level(logging.WARNING):
        assert precision.weight_dtypes("default") == (torch.float32, storage)  # computing in fp32: no bf16 here
    assert not caplog.records


@pytest.mark.parametrize("flag", ["fp16_unet", "fp8_e8m0fnu_unet", "fp64_unet"], indirect=True)
def test_a_flag_the_dit_cannot_run_falls_back_and_says_so_once(flag, caplog):
    asked = mm.unet_dtype(supported_dtypes=precision.RUNNABLE_DTYPES)
    with caplog.at_level(logging.WARNING):
        assert precision.weight_dtypes("default") == (torch.float32, None)  # no bf16 on this CPU
        assert precision.weight_dtypes("default") == (torch.float32, None)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [f"ERNIE-Image: ComfyUI's unet dtype flag asks for {asked}, which the ERNIE-Image DiT does not "
                        "run in; loading it in torch.float32. For FP8 weights, pick weight_dtype fp8_e4m3fn or the "
                        "loader's quantization input (fp8_per_row)."]


@pytest.mark.parametrize("flag", ["none"], indirect=True)
def test_without_a_flag_default_keeps_a_files_fp8(flag):
    assert precision.weight_dtypes("default") == (torch.float32, None)  # None: the file's fp8 stays fp8
    assert precision.weight_dtypes("fp32") == (torch.float32, torch.float32)  # explicit: upcast


@pytest.mark.parametrize("flag", ["fp8_e4m3fn_unet"], indirect=True)
def test_an_explicit_weight_dtype_wins_over_the_flag(flag):
    assert precision.weight_dtypes("bf16") == (torch.bfloat16, torch.bfloat16)
    assert precision.weight_dtypes("fp8_e5m2") == (torch.float32, torch.float8_e5m2)


@pytest.mark.parametrize("flag", ["none"], indirect=True)
def test_fp8_storage_and_a_quantization_method_together_are_refused_before_loading(flag, tmp_path):
    missing = tmp_path / "never-read.safetensors"  # refused before the file is looked at
    with pytest.raises(ErnieImageError, match=r"^weight_dtype fp8_e4m3fn and quantization fp8_per_row are two ways of "
                                              r"storing the DiT's weights: pick one \(set the other to default / none\)"
                                              r"\.$"):
        loaders._load_model(missing, "fp8_e4m3fn", "fp8_per_row", 4.0)
