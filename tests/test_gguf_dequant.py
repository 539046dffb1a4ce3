"""GGUF's block formats decoded in torch (``nodes/gguf/dequant.py``) against the ``gguf`` package's own decoder,
``gguf.quants.dequantize`` (numpy): Q8_0, Q5_1, Q5_0, Q4_1 and Q4_0 from real quantization (``gguf.quants.quantize``),
the K-quants and IQ4 from random valid blocks (the package cannot write them). Bit for bit in float32; one rounding in
bf16 and fp16. Every block type's fp16 scales are where the package reads them, and one that is not finite is refused
naming the tensor (``reader.first_bad_value``)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from comfyui_ernie_image.nodes.gguf import dequant
from comfyui_ernie_image.nodes.gguf.reader import first_bad_value
from scripts.gguf_writer import SCALES, SPAN, random_blocks

# Every block type ComfyUI-GGUF's ``dequant.py`` reads (city96/ComfyUI-GGUF at 03e0e547; it reads BF16 too): the pack
# reads these, and these only.
KINDS = ["Q8_0", "Q6_K", "Q5_1", "Q5_K", "Q5_0", "Q4_1", "Q4_K", "IQ4_NL", "Q4_0", "IQ4_XS", "Q3_K", "Q2_K"]
# The decode runs where the layer runs: on the GPU too where there is one (``pytest tests/test_gguf_dequant.py`` there).
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _blocks(kind: str, count: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind not in SPAN:  # the package's own quantizer, on weights of a plausible spread
        return gguf.quants.quantize(rng.normal(0, 0.05, (count // 256, 256)).astype(np.float32),
                                    gguf.GGMLQuantizationType[kind])
    return random_blocks(kind, count, rng)


def test_the_block_sizes_are_the_packages():
    for kind, size in dequant.BLOCKS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]] == size


def test_the_pack_reads_every_type_comfyui_gguf_reads():
    assert list(dequant.BLOCKS) == KINDS and set(dequant.SCALE_OFFSETS) == set(KINDS)
    bits = [size * 8 / values for values, size in dequant.BLOCKS.values()]
    assert bits == sorted(bits, reverse=True)  # the messages name them from the most bits a weight to the fewest


@pytest.mark.parametrize("kind", KINDS)
def test_the_scales_checked_are_where_the_package_reads_fp16_scales(kind):
    """A NaN written at byte ``offset`` of a valid block makes ``gguf.quants.dequantize`` give NaN exactly where
    ``offset`` is one of ``SCALE_OFFSETS[kind]``: the reader checks every fp16 number the values are scaled by (and
    the test writer draws them: ``SCALES``)."""
    values, size = dequant.BLOCKS[kind]
    blocks = np.repeat(_blocks(kind, 256, seed=1).reshape(-1, size)[:1], size - 1, axis=0)
    for offset in range(size - 1):  # block ``offset`` has the bytes of a NaN at ``offset``
        blocks[offset, offset:offset + 2] = np.array([np.nan], np.float16).view(np.uint8)
    decoded = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(size - 1, values)
    assert tuple(np.flatnonzero(np.isnan(decoded).any(axis=1))) == dequant.SCALE_OFFSETS[kind] == SCALES[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_a_non_finite_scale_of_each_type_is_refused_naming_the_tensor(kind):
    """Each fp16 scale where llama.cpp's block keeps it (the test writer's ``SCALES``, ggml-common.h)."""
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]][1]
    for offset in SCALES[kind]:
        for value, words in ((np.inf, "inf"), (np.nan, "nan"), (-np.inf, "-inf")):
            blocks = _blocks(kind, 4 * 256, seed=2).reshape(-1, size)
            assert first_bad_value("layers.3.mlp.up_proj.weight", kind, torch.from_numpy(blocks.reshape(-1))) is None
            blocks[2, offset:offset + 2] = np.array([value], np.float16).view(np.uint8)
            assert first_bad_value("layers.3.mlp.up_proj.weight", kind, torch.from_numpy(blocks.reshape(-1))) == (
                f"the fp16 block scale at byte {offset} of block 2 of layers.3.mlp.up_proj.weight is {words}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
def test_each_type_decodes_as_the_gguf_package_does(kind, device):
    count = 64 * 1024
    blocks = _blocks(kind, count)
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(count // 256, 256)
    raw = torch.from_numpy(blocks.reshape(-1).copy()).to(device)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        decoded = dequant.dequantize(raw, kind, (count // 256, 256), dtype).cpu()
        assert decoded.dtype == dtype and decoded.shape == (count // 256, 256)
        expected = torch.from_numpy(reference).to(dtype)  # the one rounding from float32
        error = (decoded.float() - torch.from_numpy(reference)).abs().max().item()
        print(f"{kind} → {dtype}: max |torch - gguf.quants.dequantize| = {error:.3g} "
              f"(values up to {np.abs(reference).max():.3g})")
        assert torch.equal(decoded, expected), kind


@pytest.mark.parametrize("kind", [kind for kind in KINDS if kind not in SPAN])
def test_each_quantized_type_decodes_any_bytes_as_the_gguf_package_does(kind):
    """The package's quantizer writes only some of the bytes llama.cpp's may (rounded quants, ``m`` the minimum):
    random quants and minimums, finite scales, decode as the package decodes them too."""
    values, size = dequant.BLOCKS[kind]
    rng = np.random.default_rng(4)
    blocks = rng.integers(0, 256, (4096 // values, size), dtype=np.uint8)
    for offset in dequant.SCALE_OFFSETS[kind]:
        blocks[:, offset:offset + 2] = rng.normal(0, 1e-2, (len(blocks), 1)).astype(np.float16).view(np.uint8)
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(-1)
    decoded = dequant.dequantize(torch.from_numpy(blocks.reshape(-1).copy()), kind, (4096,), torch.float32)
    assert torch.equal(decoded, torch.from_numpy(reference))


@pytest.mark.parametrize("kind", ["Q4_K", "Q4_0", "IQ4_XS"])  # 256- and 32-value blocks, and the IQ4 levels
def test_a_layer_larger_than_one_step_decodes_in_steps_alike(monkeypatch, kind):
    blocks = _blocks(kind, 40 * 256, seed=3)
    raw = torch.from_numpy(blocks.reshape(-1).copy())
    whole = dequant.dequantize(raw, kind, (40, 256), torch.float32)
    monkeypatch.setattr(dequant, "CHUNK_VALUES", 3 * 256)  # 14 steps, the last one short
    assert torch.equal(dequant.dequantize(raw, kind, (40, 256), torch.float32), whole)


def test_the_decoded_layout_is_row_major_over_the_blocks():
    """Block i holds values i·n … (i+1)·n - 1 of the flattened weight (as llama.cpp's rows do)."""
    blocks = _blocks("Q8_0", 4 * 256, seed=5)
    flat = dequant.dequantize(torch.from_numpy(blocks.reshape(-1).copy()), "Q8_0", (1024,), torch.float32)
    one = dequant.dequantize(torch.from_numpy(blocks.reshape(-1, 34)[7].copy()), "Q8_0", (32,), torch.float32)
    assert torch.equal(flat[7 * 32:8 * 32], one)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_the_decode_equals_eager_for_every_type(device):
    """Where a GGUF DiT is held whole its blocks compile with the decode (``torch.compiler.is_compiling``: no step
    loop): inductor's kernels give the same numbers as eager, every type in one graph."""
    raws = {kind: torch.from_numpy(_blocks(kind, 8 * 256, seed=7).reshape(-1).copy()).to(device) for kind in KINDS}

    def decode_all(raws):
        return {kind: dequant.dequantize(raw, kind, (8, 256), torch.bfloat16) for kind, raw in raws.items()}

    compiled = torch.compile(decode_all, fullgraph=True)(raws)
    for kind, eager in decode_all(raws).items():
        assert torch.equal(compiled[kind], eager), kind
