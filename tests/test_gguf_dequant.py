"""GGUF's block formats decoded in torch (``nodes/gguf/dequant.py``) against the ``gguf`` package's own decoder,
``gguf.quants.dequantize`` (numpy): Q8_0 from real quantization, the K-quants from random valid blocks (the package
cannot write them). Bit for bit in float32; one rounding in bf16 and fp16."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from comfyui_ernie_image.nodes.gguf import dequant
from scripts.gguf_writer import random_blocks

KINDS = ["Q8_0", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _blocks(kind: str, count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "Q8_0":  # the package's own quantizer, on weights of a plausible spread
        return gguf.quants.quantize(rng.normal(0, 0.05, (count // 256, 256)).astype(np.float32),
                                    gguf.GGMLQuantizationType.Q8_0)
    return random_blocks(kind, count, rng)


def test_the_block_sizes_are_the_packages():
    for kind, size in dequant.BLOCKS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]] == size


@pytest.mark.parametrize("kind", KINDS)
def test_each_type_decodes_as_the_gguf_package_does(kind):
    count = 64 * 1024
    blocks = _blocks(kind, count)
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(count // 256, 256)
    raw = torch.from_numpy(blocks.reshape(-1).copy())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        decoded = dequant.dequantize(raw, kind, (count // 256, 256), dtype)
        assert decoded.dtype == dtype and decoded.shape == (count // 256, 256)
        expected = torch.from_numpy(reference).to(dtype)  # the one rounding from float32
        error = (decoded.float() - torch.from_numpy(reference)).abs().max().item()
        print(f"{kind} → {dtype}: max |torch - gguf.quants.dequantize| = {error:.3g} "
              f"(values up to {np.abs(reference).max():.3g})")
        assert torch.equal(decoded, expected), kind


def test_a_layer_larger_than_one_step_decodes_in_steps_alike(monkeypatch):
    blocks = _blocks("Q4_K", 40 * 256, seed=3)
    raw = torch.from_numpy(blocks.reshape(-1).copy())
    whole = dequant.dequantize(raw, "Q4_K", (40, 256), torch.float32)
    monkeypatch.setattr(dequant, "CHUNK_VALUES", 3 * 256)  # 14 steps, the last one short
    assert torch.equal(dequant.dequantize(raw, "Q4_K", (40, 256), torch.float32), whole)


def test_the_decoded_layout_is_row_major_over_the_blocks():
    """Block i holds values i·n … (i+1)·n - 1 of the flattened weight (as llama.cpp's rows do)."""
    blocks = _blocks("Q8_0", 4 * 256, seed=5)
    flat = dequant.dequantize(torch.from_numpy(blocks.reshape(-1).copy()), "Q8_0", (1024,), torch.float32)
    one = dequant.dequantize(torch.from_numpy(blocks.reshape(-1, 34)[7].copy()), "Q8_0", (32,), torch.float32)
    assert torch.equal(flat[7 * 32:8 * 32], one)


def test_compiled_the_decode_equals_eager_for_every_type():
    """Where a GGUF DiT is held whole its blocks compile with the decode (``torch.compiler.is_compiling``: no step
    loop): inductor's kernels give the same numbers as eager, each type in one graph (the CPU's inductor here)."""
    raws = {kind: torch.from_numpy(_blocks(kind, 8 * 256, seed=7).reshape(-1).copy()) for kind in KINDS}

    def decode_all(raws):
        return {kind: dequant.dequantize(raw, kind, (8, 256), torch.bfloat16) for kind, raw in raws.items()}

    compiled = torch.compile(decode_all, fullgraph=True)(raws)
    for kind, eager in decode_all(raws).items():
        assert torch.equal(compiled[kind], eager), kind
