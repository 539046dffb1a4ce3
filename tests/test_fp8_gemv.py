"""The one-kernel product of a decode step with fp8 weights (``fp8_gemv``): its arithmetic in Triton's own
interpreter on the CPU (the kernel's code as the GPU runs it, one program at a time), and on a CUDA GPU inside
``Fp8Linear`` and a captured CUDA graph (the H200 check runs those)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comfyui_ernie_image.nodes import fp8_gemv
from comfyui_ernie_image.nodes.fp8_linear import FP8, Fp8Linear, quantize_rows

NAN_CODES = (0x7F, 0xFF)  # e4m3's two NaNs: never in a weight (non-finite weights are refused at load)

# Run in a process of its own: Triton reads TRITON_INTERPRET when the kernel is made.
_INTERPRETED = """
import sys, torch
sys.path[:0] = [{tests!r}]
import conftest  # the pack importable as comfyui_ernie_image, as in these tests
from comfyui_ernie_image.nodes import fp8_gemv
from comfyui_ernie_image.nodes.fp8_linear import FP8, quantize_rows
codes = torch.tensor([c for c in range(256) if c not in {nan!r}], dtype=torch.uint8)
generator = torch.Generator().manual_seed(0)
weight, row_scale = quantize_rows(torch.randn(37, 700, generator=generator) * 0.02)  # not whole blocks either way
weight.view(torch.uint8)[0, :codes.numel()] = codes  # every finite e4m3 value, subnormals and both zeros
weight.view(torch.uint8)[1, :codes.numel()] = codes.flip(0)
for scale in (row_scale, torch.tensor(0.37)):
    scaled = weight.double() * scale.double().reshape(-1, 1)
    for rows, dtype in ((1, torch.bfloat16), (3, torch.float16), (4, torch.float32)):
        x = torch.randn(rows, 700, generator=generator).to(dtype)
        exact = x.double() @ scaled.T
        out = fp8_gemv.launch(x, weight, scale)
        assert out.dtype == dtype and out.shape == (rows, 37)
        # Sums of 700 products in fp32, then one rounding to the output's dtype.
        bound = exact.abs() * torch.finfo(dtype).eps + (x.double().abs() @ scaled.abs().T) * 700 * 2**-24
        assert bool(((out.double() - exact).abs() <= bound).all()), (scale.numel(), rows, dtype)
print("ok")
"""


def test_the_kernel_widens_every_fp8_value_and_sums_like_the_exact_product_in_tritons_interpreter():
    """Every finite e4m3 byte (subnormals, both zeros, negatives), per-row and per-tensor scales, 1-4 rows in bf16,
    fp16 and fp32, sizes that are not whole blocks: within one rounding of the output's dtype of the exact product
    (float64), in the kernel's own code under Triton's CPU interpreter."""
    code = _INTERPRETED.format(tests=str(Path(__file__).parent), nan=NAN_CODES)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_the_plain_path_runs_where_the_kernel_does_not_serve():
    """The CPU, more rows than ``ROWS`` (a prompt's prefill, a text encode) and a compiled graph take the plain
    cast and matmul."""
    weight, scale = quantize_rows(torch.randn(8, 16))
    assert fp8_gemv.fp8_rows(torch.randn(1, 16), weight, scale) is None  # the CPU
    if torch.cuda.is_available():
        cuda = (weight.cuda(), scale.cuda())
        assert fp8_gemv.fp8_rows(torch.randn(fp8_gemv.ROWS + 1, 16, device="cuda"), *cuda) is None
        assert fp8_gemv.fp8_rows(torch.randn(fp8_gemv.ROWS, 16, device="cuda"), *cuda) is not None


def _linear(rows_scale: bool) -> Fp8Linear:
    generator = torch.Generator().manual_seed(1)
    layer = Fp8Linear(3072, 4096, bias=True)
    weight, scale = quantize_rows(torch.randn(4096, 3072, generator=generator) * 0.02)
    layer.weight.data = weight
    layer.weight_scale = scale if rows_scale else scale.max()
    layer.bias.data = torch.randn(4096, generator=generator) * 0.01
    return layer.cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU (the H200 check runs it)")
@pytest.mark.parametrize("rows_scale", [True, False], ids=["per-row", "per-tensor"])
def test_a_decode_step_on_the_gpu_takes_the_kernel_and_agrees_with_the_plain_path(rows_scale):
    """``Fp8Linear`` with one token's row on a CUDA GPU gives the kernel's product (bias added), within the bf16
    roundings the two paths make of the plain path's (the plain path rounds the product, the scaled product and the
    sum with the bias; the kernel its scaled product and that sum: five half-units of the last place at most), and so
    does a CUDA graph that captured it."""
    layer = _linear(rows_scale)
    assert layer.weight.dtype == FP8
    x = torch.randn(1, 1, 3072, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    out = layer(x)
    kernel = fp8_gemv.launch(x.reshape(1, 3072), layer.weight, layer.weight_scale).reshape(1, 1, 4096) + layer.bias.to(
        torch.bfloat16)
    assert torch.equal(out, kernel)
    plain = torch.nn.functional.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale.reshape(-1).to(x.dtype)
    plain = plain + layer.bias.to(x.dtype)
    assert (out.float() - plain.float()).abs().max() <= 5 * 2**-8 * plain.float().abs().max()
    graph, static = torch.cuda.CUDAGraph(), x.clone()
    with torch.cuda.graph(graph):
        captured = layer(static)
    static.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, layer(static))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU (the H200 check runs it)")
def test_without_triton_fault_the_plain_path_runs_and_the_log_says_how_to_get_triton_once(monkeypatch, caplog):
    """A Windows install without triton-windows, made by hiding Triton from imports (a fault a working install cannot
    give): the layer gives the plain path's product, and one warning names the fix however many steps decode."""
    monkeypatch.setitem(sys.modules, "triton", None)  # ``import triton`` raises ImportError
    monkeypatch.setattr(fp8_gemv, "_kernel", None)
    monkeypatch.setattr(fp8_gemv, "_unavailable", False)
    layer = _linear(rows_scale=True)
    x = torch.randn(1, 1, 3072, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level("WARNING"):
        outs = [layer(x) for _ in range(3)]
    plain = torch.nn.functional.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale.reshape(-1).to(x.dtype)
    assert all(torch.equal(out, plain + layer.bias.to(x.dtype)) for out in outs)
    warnings = [record.getMessage() for record in caplog.records if "one-kernel product" in record.getMessage()]
    assert len(warnings) == 1 and "triton-windows" in warnings[0] and "ModuleNotFoundError" in warnings[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU (the H200 check runs it)")
def test_an_out_of_memory_in_the_kernel_fault_injected_is_raised_and_the_kernel_stays_in_use(monkeypatch):
    """A full card (the fault injected: the launch raises torch's out-of-memory error) is the card's state, not a
    broken kernel: it reaches core's handling as any layer's would, and the next step takes the kernel again."""
    monkeypatch.setattr(fp8_gemv, "_unavailable", False)
    layer = _linear(rows_scale=True)
    x = torch.randn(1, 1, 3072, device="cuda", dtype=torch.bfloat16)

    def full(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    with monkeypatch.context() as patch:
        patch.setattr(fp8_gemv, "launch", full)
        with pytest.raises(torch.OutOfMemoryError):
            layer(x)
    assert not fp8_gemv._unavailable
    assert torch.equal(layer(x), fp8_gemv.launch(x.reshape(1, 3072), layer.weight, layer.weight_scale).reshape(
        1, 1, 4096) + layer.bias.to(torch.bfloat16))
