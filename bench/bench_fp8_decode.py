"""One decode step's linears of the true-size PE (Ministral 3 3B: 26 layers of 3072, the PE's stacked gate and up) at
one token, in each way its weights could be held and multiplied: what an fp8 PE's decode could cost against bf16's.

A decode step reads every weight once for one row of activations, so its time is the bytes read. The pack's
``Fp8Linear`` casts the fp8 weight to bf16 and multiplies (1 byte read, 2 written, 2 read again: the probe's pe:fp8
is 3x pe:bf16). Measured here, each replayed in a CUDA graph as the PE's decode is:

- ``bf16``: ``F.linear`` on bf16 weights (the reference);
- ``fp8_cast``: the weight cast to bf16, then the matmul (``Fp8Linear``'s plain path; per-row scales);
- ``fp8_linear``: the pack's ``Fp8Linear`` as it runs now (``fp8_gemv``'s kernel for up to 4 rows);
- ``fp8_fused_compiled``: the same weights, the product written as a reduction that torch.compile fuses with the cast
  (one kernel reading 1 byte a weight; Triton casts fp8 on CUDA 8.9 and later);
- ``fp8_triton_<n>x<k>``: the kernel of ``nodes/fp8_gemv.py`` (one a linear, the fp8 bytes read once and widened
  through fp16's bits) with programs of n output rows stepping k inputs;
- ``int8_pack``: ``torch._weight_int8pack_mm`` on int8 rows with bf16 scales (torch's own kernel, any CUDA GPU);
- ``fp8_scaled_mm``: ``torch._scaled_mm`` with the activation row quantized to fp8 too (CUDA 8.9+).

Benchmark, not a test: ``python3 bench/bench_fp8_decode.py [--out DIR]`` prints a table (ms per step, GB/s of
weights, the largest difference from bf16 relative to bf16's largest output).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nodes import fp8_gemv  # noqa: E402
from nodes.fp8_linear import Fp8Linear, quantize_rows  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 3072, 9216, 26, 32, 8, 128
TRITON_BLOCKS = [(4, 1024), (8, 1024), (16, 512), (32, 256), (2, 2048)]
# One layer's linears (out, in): q, k, v, o, the stacked gate and up, down.
SHAPES = [(HEADS * HEAD_DIM, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN), (KV_HEADS * HEAD_DIM, HIDDEN),
          (HIDDEN, HEADS * HEAD_DIM), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def _fused(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (weight.to(x.dtype)[None] * x[:, None, :]).sum(-1, dtype=torch.float32).mul(scale.reshape(-1)).to(x.dtype)


def _scaled_mm(x: torch.Tensor, weight_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows = torch.zeros(16, x.shape[1], device=x.device, dtype=x.dtype)  # _scaled_mm wants 16-row multiples
    rows[: x.shape[0]] = x
    x_scale = rows.abs().amax(1, keepdim=True).float().clamp(min=1e-12) / 448.0
    x8 = (rows.float() / x_scale).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(x8, weight_t, scale_a=x_scale, scale_b=scale.reshape(1, -1).float(), out_dtype=x.dtype)
    return out[: x.shape[0]]


def _layers(device: torch.device, generator: torch.Generator) -> list[dict]:
    layers = []
    for _ in range(LAYERS):
        for out_features, in_features in SHAPES:
            weight = (torch.randn(out_features, in_features, generator=generator, device=device) * 0.02).bfloat16()
            fp8, scale = quantize_rows(weight)
            absmax = weight.abs().amax(1, keepdim=True).float()
            int8_scale = (absmax / 127).clamp(min=1e-12)
            int8 = (weight.float() / int8_scale).round().clamp(-127, 127).to(torch.int8)
            linear = Fp8Linear(in_features, out_features, bias=False, device=device)
            linear.weight.data, linear.weight_scale = fp8, scale
            layers.append(dict(bf16=weight, fp8=fp8, scale=scale, fp8_t=fp8.t(), linear=linear, int8=int8,
                               int8_scale=int8_scale.reshape(-1).bfloat16()))
    return layers


def _ways(fused) -> dict:
    return {
        "bf16": lambda x, w: torch.nn.functional.linear(x, w["bf16"]),
        "fp8_cast": lambda x, w: (torch.nn.functional.linear(x, w["fp8"].to(x.dtype))
                                  * w["scale"].reshape(-1).to(x.dtype)),
        "fp8_linear": lambda x, w: w["linear"](x),
        "fp8_fused_compiled": lambda x, w: fused(x, w["fp8"], w["scale"]),
        **{f"fp8_triton_{n}x{k}": (lambda x, w, block=(n, k): fp8_gemv.launch(x, w["fp8"], w["scale"], block))
           for n, k in TRITON_BLOCKS},
        "int8_pack": lambda x, w: torch._weight_int8pack_mm(x, w["int8"], w["int8_scale"]),
        "fp8_scaled_mm": lambda x, w: _scaled_mm(x, w["fp8_t"], w["scale"]),
    }


def _step(way, inputs: list[torch.Tensor], layers: list[dict]) -> list[torch.Tensor]:
    return [way(inputs[i], w) for i, w in enumerate(layers)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--compiled", action="store_true", help="also the torch.compile reduction (compiles)")
    parser.add_argument("--rows", default="1,4", help="rows of activations (prompts decoding together)")
    args = parser.parse_args()
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    layers = _layers(device, generator)
    weight_bytes = {"bf16": sum(w["bf16"].nbytes for w in layers)}
    fp8_ways = ["fp8_cast", "fp8_linear", "fp8_fused_compiled", "fp8_scaled_mm"]
    fp8_ways += [f"fp8_triton_{n}x{k}" for n, k in TRITON_BLOCKS]
    weight_bytes.update(dict.fromkeys(fp8_ways, sum(w["fp8"].nbytes for w in layers)))
    weight_bytes["int8_pack"] = sum(w["int8"].nbytes for w in layers)
    fused = torch.compile(_fused, dynamic=False)
    rows = []
    for count, (name, way) in itertools.product(map(int, args.rows.split(",")), _ways(fused).items()):
        if name == "fp8_fused_compiled" and not args.compiled:
            continue
        inputs = [torch.randn(count, w["bf16"].shape[1], generator=generator, device=device).bfloat16()
                  for w in layers]
        reference = _step(_ways(fused)["bf16"], inputs, layers)
        try:
            began = time.perf_counter()
            outputs = _step(way, inputs, layers)
            torch.cuda.synchronize()
            first_s = time.perf_counter() - began  # a compile included
            for _ in range(2):  # warm up outside the graph
                outputs = _step(way, inputs, layers)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = _step(way, inputs, layers)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graph.replay()
            start.record()
            for _ in range(args.replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / args.replays
            error = max(((c.float() - r.float()).abs().max() / r.float().abs().max()).item()
                        for c, r in zip(captured, reference, strict=True))
            del outputs
            rows.append(dict(way=name, rows=count, ms=round(ms, 3), gb_per_s=round(weight_bytes[name] / ms / 1e6, 1),
                             rel_error=round(error, 4), first_s=round(first_s, 2)))
        except Exception as error:  # a way this GPU or torch cannot run: say so, measure the others
            rows.append(dict(way=name, rows=count, error=f"{type(error).__name__}: {str(error)[:200]}"))
        print(json.dumps(rows[-1]), flush=True)
    info = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fp8_decode.json").write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
