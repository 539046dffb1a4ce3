"""A decode step's product with fp8 weights in one kernel that reads each weight byte once (engine).

A decode step multiplies one row of activations by every weight, so its time is the bytes it reads. ``Fp8Linear``'s
plain path casts the weight to bf16 and multiplies: it reads a byte, writes two and reads them again, so an fp8 PE
decoded slower than a bf16 one (the probe's ``pe:fp8`` 0.0255 s a token against ``pe:bf16`` 0.0087 on the H100,
bench/RESULTS.md, session 30). Here a Triton kernel reads the fp8 bytes, widens them in registers and accumulates in
fp32, for up to ``ROWS`` rows (a few prompts decoding together: each row reads the weight again, so past that the
cast and one matmul read less).

The bytes are widened as integers (an e4m3 value's sign, exponent and mantissa moved into an fp16's, which is 2^-8 of
the value, subnormals included): no fp8 type in the kernel, so it runs on GPUs whose Triton cannot convert fp8 (CUDA
before 8.9, the RTX 20 and 30 cards). Where Triton is missing or its first build fails (a Windows install without
triton-windows or a C compiler), the plain path runs, as before, and the log says so once.
"""

from __future__ import annotations

import logging

import torch

ROWS = 4  # rows up to which one kernel per linear beats the cast and the matmul (each row reads the weight again)
# Output rows and inputs per step of a program: the fastest of five shapes for one token of the PE's linears on an
# H100 (bench/bench_fp8_decode.py, 2026-12-06: 1.73 ms against 1.94-3.41 for the others and 2.70 for bf16).
BLOCK = (4, 1024)

_kernel = None  # the Triton kernel, built at first use
_unavailable = False  # Triton is missing here, or building or launching the kernel failed once


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_rows_kernel(x_ptr, w_ptr, scale_ptr, scale_stride, out_ptr, N, K: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # K is a constant (one build per layer width, a handful a model): Triton's interpreter before 3.8 cannot loop
        # up to a runtime integer under numpy 2 (its ``__index__`` of a one-element array).
        row, block = tl.program_id(1), tl.program_id(0)
        rn = block * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            bits = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                           other=0).to(tl.int16)
            # The sign to fp16's bit 15, exponent and mantissa to bits 7-13: 2^-8 of the e4m3 value (the scale's 256)
            half = (((bits & 0x80) << 8) | ((bits & 0x7F) << 7)).to(tl.float16, bitcast=True)
            x = tl.load(x_ptr + row * K + rk, mask=rk < K, other=0.0).to(tl.float32)
            acc += tl.sum(half.to(tl.float32) * x[None, :], axis=1)
        scale = tl.load(scale_ptr + rn * scale_stride, mask=rn < N, other=0.0).to(tl.float32) * 256.0
        tl.store(out_ptr + row * N + rn, (acc * scale).to(out_ptr.dtype.element_ty), mask=rn < N)

    return triton, fp8_rows_kernel


def launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """``x [rows, in] @ (weight * scale).T`` by the kernel: ``weight [out, in]`` fp8 e4m3 (contiguous), ``scale`` one
    per tensor or one per output row, the result in ``x``'s dtype; ``block``: a program's output rows and inputs per
    step (powers of two). Any device Triton runs on (its interpreter too)."""
    global _kernel
    if _kernel is None:
        _kernel = _build()
    triton, kernel = _kernel
    (rows, inputs), outputs = x.shape, weight.shape[0]
    out = torch.empty(rows, outputs, device=x.device, dtype=x.dtype)
    scale = scale.reshape(-1)
    kernel[(triton.cdiv(outputs, block[0]), rows)](
        x.contiguous(), weight.view(torch.uint8), scale, 0 if scale.numel() == 1 else 1, out, outputs, inputs,
        BLOCK_N=block[0], BLOCK_K=block[1])
    return out


def fp8_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """The product for a decode step on a CUDA GPU (``launch``), or None where the plain path should run: more than
    ``ROWS`` rows, another device, inside torch.compile (which traces the plain path), or no working Triton."""
    global _unavailable
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (_unavailable or not 0 < rows <= ROWS or x.device.type != "cuda" or not weight.is_contiguous()
            or torch.compiler.is_compiling()):
        return None
    try:
        with torch.cuda.device(x.device):  # Triton launches on the current device, which may be another GPU
            return launch(x.reshape(rows, x.shape[-1]), weight, scale).reshape(*x.shape[:-1], weight.shape[0])
    except torch.OutOfMemoryError:  # the card is full now, not the kernel broken: core's handling, as for any layer
        raise
    except Exception as error:  # no Triton, no C compiler, a GPU it cannot build for: the plain path, as before
        _unavailable = True
        hint = " (on Windows: pip install triton-windows)" if isinstance(error, ImportError) else ""
        logging.warning("ERNIE-Image: fp8 layers decode by casting their weights (slower): the one-kernel "
                        "product could not run here%s (%s: %s)", hint, type(error).__name__, str(error)[:200])
        return None
