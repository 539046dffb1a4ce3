"""The loader's VAE tells ComfyUI what a whole decode takes, so ComfyUI makes room before it (bench/RESULTS.md:
core's estimate is under half the measured need, and on a 24 GB card the decode ran out of memory)."""

from __future__ import annotations

import pytest
import torch

from comfyui_ernie_image.nodes.dit.vae import load_snapshot_vae

GIB = 2**30


def test_the_decode_estimate_is_the_measured_one_and_scales_with_pixels_and_dtype(tiny_models):
    vae = load_snapshot_vae(tiny_models["snapshot"])
    one_image_1024 = vae.memory_used_decode((1, 128, 64, 64), torch.bfloat16)
    assert one_image_1024 == pytest.approx(11.4 * GIB)  # measured on the H200, whole 1024² decode in bf16
    assert vae.memory_used_decode((3, 128, 64, 64), torch.bfloat16) == one_image_1024  # per image, as core's
    assert vae.memory_used_decode((1, 128, 32, 64), torch.bfloat16) == pytest.approx(one_image_1024 / 2)
    assert vae.memory_used_decode((1, 128, 64, 64), torch.float32) == pytest.approx(2 * one_image_1024)
