"""``weight_dtype = default`` under ComfyUI's global unet dtype flags: a dtype the pack's DiT runs, or bf16 (fp32
where bf16 is unsupported, as on this CPU) and one line in the log."""

from __future__ import annotations

import logging

import comfy.model_management as mm
import pytest
import torch

from comfyui_ernie_image.nodes.dit import nodes as dit_nodes

FLAGS = ["fp32_unet", "bf16_unet", "fp16_unet", "fp8_e4m3fn_unet", "fp8_e5m2_unet", "fp8_e8m0fnu_unet", "fp64_unet"]


@pytest.fixture
def flag(request, monkeypatch):
    for name in FLAGS:
        monkeypatch.setattr(mm.args, name, name == request.param)
    dit_nodes._say_dtype_fallback.cache_clear()
    return request.param


@pytest.mark.parametrize("flag, expected", [("fp32_unet", torch.float32), ("bf16_unet", torch.bfloat16)],
                         indirect=["flag"])
def test_a_flag_the_dit_runs_in_is_followed_silently(flag, expected, caplog):
    with caplog.at_level(logging.WARNING):
        assert dit_nodes._weight_dtype("default") == expected
    assert not caplog.records


@pytest.mark.parametrize("flag", ["fp16_unet", "fp8_e4m3fn_unet", "fp8_e5m2_unet", "fp8_e8m0fnu_unet", "fp64_unet"],
                         indirect=True)
def test_a_flag_the_dit_cannot_run_falls_back_and_says_so_once(flag, caplog):
    asked = mm.unet_dtype(supported_dtypes=dit_nodes.RUNNABLE_DTYPES)
    with caplog.at_level(logging.WARNING):
        assert dit_nodes._weight_dtype("default") == torch.float32  # no bf16 on this CPU
        assert dit_nodes._weight_dtype("default") == torch.float32
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [f"ERNIE-Image: ComfyUI's unet dtype flag asks for {asked}, which the ERNIE-Image DiT does not "
                        "run in; loading it in torch.float32. For FP8 weights, use the loader's quantization input "
                        "(fp8_per_row or fp8_weight_only)."]


@pytest.mark.parametrize("flag", ["fp8_e4m3fn_unet"], indirect=True)
def test_an_explicit_weight_dtype_wins_over_the_flag(flag):
    assert dit_nodes._weight_dtype("bf16") == torch.bfloat16
