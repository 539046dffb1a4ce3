"""Decode speed of the ERNIE-Image Prompt Enhancer (issue: Prompt Enhancer), true size, random weights.

A 3.4B ``Ministral3ForCausalLM`` (the PE's geometry: hidden 3072, 26 layers, 32 heads / 8 KV heads of 128, FFN 9216,
vocab 131072, tied embeddings) built on the meta device and filled with normal(0, 0.02) in bf16. In one run, for each
shape (batch x new tokens, ``min_new_tokens`` / ``ignore_eos`` force the length) and after a warm-up at that shape:

- ``generate``: transformers' plain ``generate`` (sampling, temperature 0.6, top-p 0.8);
- ``static``: the same with ``cache_implementation="static"`` (transformers compiles the decode step itself);
- ``pack-sdpa``: the pack's compiled fast path, ``StaticDecoder(model, "compiled", attention="sdpa")``: static KV
  cache, one compiled decode step with CUDA graphs (not under cudaMallocAsync), top-p sampling on the GPU; attention
  is transformers' ``sdpa``, which under compilation repeats K/V from 8 to 32 heads;
- ``pack-unfused``: the same with the pack's grouped decode attention (``nodes/pe/local/attention.py``, the
  default): K/V read in place;
- ``pack``: the same after ``nodes/pe/local/fused.py`` stacks each layer's gate and up projections into one matrix.
  It fuses the model in place, so the variants above run first (the order of ``--variants``);
- ``pack-graphs``: what ``auto`` runs on CUDA: the fused model's eager step captured in a CUDA graph per bucket (no
  compiler);
- ``pack-fp8``, ``pack-fp8-graphs``: ``pack`` and ``pack-graphs`` with the decoder's linears in fp8 (``weight_dtype``
  fp8_e4m3fn: cast to bf16 per layer as each step runs), last (the bf16 weights go).
``--probe`` adds the memory plan's figure for the graphed path: tokens of ``pack-graphs`` / ``pack-fp8-graphs`` at
1x64 against the probe's eager token of the same form on this machine (``describe.GRAPHED_PE``).
All pack variants use the same cache buckets.

Reports decode tokens/s, time to first token, compile (warm-up minus timed run) and peak memory as a markdown table,
and writes JSON to ``$OUT/bench_pe.json`` after every measurement. Each measurement is guarded: an error is printed
and the run goes on. ``--profile`` adds where a decode token's GPU time goes on ``pack`` at 1x256: the top CUDA
kernels of 32 decode steps (a torch.profiler trace, also written to ``$OUT/bench_pe_trace.json.gz``). ``--gemv``
adds the bandwidth of one batch-1 matrix-vector product per PE weight shape, separate and stacked, replayed from a
CUDA graph: cuBLAS (``F.linear``) and an inductor-generated reduction (``(x * W).sum(-1)`` compiled).

    cd bench && python3 bench_pe.py
    cd bench && python3 bench_pe.py --variants pack-sdpa,pack --shapes 1x256,1x1024,4x1024 --profile
    cd bench && python3 bench_pe.py --variants pack-unfused,pack --gemv
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time
import traceback
from pathlib import Path

import torch
from common import cuda_time, machine, use_comfyui

PE_3B = dict(vocab_size=131072, hidden_size=3072, intermediate_size=9216, num_hidden_layers=26,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=11)
TEMPERATURE, TOP_P = 0.6, 0.8


@torch.no_grad()
def random_true_size_pe(dtype: torch.dtype = torch.bfloat16, device: str = "cuda"):
    """The PE with normal(0, 0.02) weights (norms at 1); rotary tables computed for real."""
    from transformers import Ministral3Config, Ministral3ForCausalLM

    config = Ministral3Config(**PE_3B)
    with torch.device("meta"):
        model = Ministral3ForCausalLM(config)
    model = model.to_empty(device=device).to(dtype)
    model.lm_head.weight = model.model.embed_tokens.weight  # keep the tie through to_empty
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02)
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config)  # its buffers are not parameters
    return model.eval()


def runners(model, decode, protocol) -> dict:
    from comfyui_ernie_image.nodes.pe.local.fused import FusedGatedMLP, fuse_mlp_projections

    """``variant -> make()``; ``make()`` gives ``run(input_ids, attention_mask, new_tokens)``, forcing exactly
    ``new_tokens``. Made when the variant's turn comes, so a pack variant's KV caches go with it."""
    sampling = dict(do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, pad_token_id=11, eos_token_id=2)

    def generate(ids, mask, n, **extra):
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, **sampling,
                              **extra)

    def pack(step: str = "compiled", **options):
        fast = decode.StaticDecoder(model, step, **options)

        def run(ids, mask, n):
            params = protocol.SamplingParams(TEMPERATURE, TOP_P, n, seed=0)
            request = decode.DecodeRequest(ids, mask, params, [2], 11, lambda: False, lambda done: None)
            return fast.generate(request, ignore_eos=True)

        return run

    def unfused(make):
        def check():
            if isinstance(model.model.layers[0].mlp, FusedGatedMLP):
                raise ValueError("the model is fused already: list this variant before 'pack'")
            return make()
        return check

    return {
        "generate": unfused(lambda: generate),
        "static": unfused(lambda: lambda ids, mask, n: generate(ids, mask, n, cache_implementation="static")),
        "pack-sdpa": unfused(lambda: pack(attention="sdpa")),
        "pack-unfused": unfused(lambda: pack()),
        "pack": lambda: (fuse_mlp_projections(model), pack())[1],
        "pack-graphs": lambda: (fuse_mlp_projections(model), pack("graphs"))[1],
        "pack-fp8": lambda: (fuse_mlp_projections(model), to_fp8(model), pack())[2],
        "pack-fp8-graphs": lambda: (fuse_mlp_projections(model), to_fp8(model), pack("graphs"))[2],
    }


@torch.no_grad()
def to_fp8(model) -> int:
    """The decoder's linears (stacked gate and up too) as the pack's fp8 PE holds them (``Fp8Linear``, one scale per
    row), in place: what ``weight_dtype`` fp8_e4m3fn loads. Last of the variants (the bf16 weights go)."""
    from comfyui_ernie_image.nodes.fp8_linear import DECODER_LINEAR, FUSED_LINEAR, Fp8Linear, quantize_rows

    converted = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and (DECODER_LINEAR.match(f"{name}.weight")
                                                    or FUSED_LINEAR.match(f"{name}.weight")):
            layer = Fp8Linear(module.in_features, module.out_features, bias=False, device="meta")
            weight, scale = quantize_rows(module.weight)
            layer.weight = torch.nn.Parameter(weight, requires_grad=False)
            layer.weight_scale = scale
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, layer)
            converted += 1
    return converted


def measure(run, batch: int, new_tokens: int, prompt_tokens: int, device: str) -> dict:
    ids = torch.randint(1000, PE_3B["vocab_size"], (batch, prompt_tokens), device=device)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        warm_s = cuda_time(lambda: run(ids, mask, new_tokens))  # compiles and captures at this shape
        torch.cuda.reset_peak_memory_stats()
        total_s = cuda_time(lambda: run(ids, mask, new_tokens))
        peak = torch.cuda.max_memory_allocated() / 2**30
        ttft_s = cuda_time(lambda: run(ids, mask, 1), repeats=3)
    decode_s = max(total_s - ttft_s, 1e-9)
    return {
        "batch": batch, "new_tokens": new_tokens, "total_s": round(total_s, 3), "ttft_ms": round(ttft_s * 1e3, 1),
        "decode_tok_s_per_seq": round((new_tokens - 1) / decode_s, 1),
        "decode_tok_s_total": round(batch * (new_tokens - 1) / decode_s, 1),
        "warmup_s": round(warm_s, 1), "compile_s": round(max(warm_s - total_s, 0.0), 1), "peak_gib": round(peak, 2),
    }


def graphed_factors(rows: list[dict], probe_seconds: dict[str, float]) -> dict[str, float]:
    """Per form, a graphed decode token (the smallest batch-1 shape measured) over the probe's eager PE token: the
    memory plan's ``GRAPHED_PE``."""
    factors = {}
    for variant, form in (("pack-graphs", "bf16"), ("pack-fp8-graphs", "fp8")):
        measured = [r for r in rows if r["variant"] == variant and r["batch"] == 1 and "error" not in r]
        if measured and f"pe:{form}" in probe_seconds:
            row = min(measured, key=lambda r: r["new_tokens"])
            factors[form] = round(1 / (row["decode_tok_s_per_seq"] * probe_seconds[f"pe:{form}"]), 3)
    return factors


def agreement(model, decode, protocol, prompt_tokens: int, device: str, new_tokens: int = 200) -> dict:
    """Greedy tokens of the fast path (graphed on CUDA) vs the same loop eager, and vs plain generate (bf16 and random
    weights make near-ties: expect long common prefixes, not always identical tails). 200 new tokens after the
    default prompt stay in the 1x256 run's shape bucket, so this compiles nothing new."""
    ids = torch.randint(1000, PE_3B["vocab_size"], (1, prompt_tokens), device=device)
    mask = torch.ones_like(ids)
    params = protocol.SamplingParams(0.0, 1.0, new_tokens)
    with torch.inference_mode():
        outputs = {
            step: decode.StaticDecoder(model, step).generate(
                decode.DecodeRequest(ids, mask, params, [2], 11, lambda: False, lambda done: None),
                ignore_eos=True)[0]
            for step in ("eager", "compiled" if device != "cuda" else "graphs")
        }
        plain = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, pad_token_id=11)[0, prompt_tokens:]

    def prefix(a, b) -> int:
        different = (a != b).nonzero()
        return int(different[0]) if len(different) else len(a)

    fast = next(step for step in outputs if step != "eager")
    return {"tokens": new_tokens, f"{fast}_vs_eager_prefix": prefix(outputs[fast], outputs["eager"]),
            "eager_vs_generate_prefix": prefix(outputs["eager"], plain)}


def profile_decode(model, decode, protocol, prompt_tokens: int, device: str, new_tokens: int = 256, steps: int = 32,
                   top: int = 15, trace: Path | None = None) -> dict:
    """Where a decode token's GPU time goes on the shipped path (the eager step captured in CUDA graphs, what
    ``auto`` takes on CUDA) at the ``1 x new_tokens`` shape (its cache bucket), on the model as the last variant left
    it (its linears in fp8 after an fp8 variant).

    Runs stop through ``should_stop`` after ``steps`` decode steps; the kernels of a run stopped before its first
    decode step (prefill, first sample) are subtracted per kernel name, leaving the decode steps' own. Wall time per
    token comes from the same two runs without the profiler: GPU time well below it means idle gaps between kernels.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from comfyui_ernie_image.nodes.fp8_linear import holds_fp8

    fast = decode.StaticDecoder(model, "graphs")
    ids = torch.randint(1000, PE_3B["vocab_size"], (1, prompt_tokens), device=device)
    mask = torch.ones_like(ids)
    params = protocol.SamplingParams(TEMPERATURE, TOP_P, new_tokens, seed=0)

    def run(decode_steps: int) -> None:
        checks = iter(range(decode_steps))  # should_stop is asked before each decode step: stop after decode_steps
        try:
            fast.generate(decode.DecodeRequest(ids, mask, params, [2], 11, lambda: next(checks, None) is None,
                                               lambda done: None), ignore_eos=True)
        except protocol.GenerationStopped:
            pass

    def kernels(decode_steps: int, trace_path: Path | None = None) -> dict[str, list]:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(decode_steps)
            torch.cuda.synchronize()
        if trace_path is not None:
            prof.export_chrome_trace(str(trace_path))
        totals: dict[str, list] = {}
        for event in prof.events():
            if event.device_type == DeviceType.CUDA:  # kernels, copies and memsets, also inside CUDA graphs
                entry = totals.setdefault(event.name, [0, 0.0])
                entry[0] += 1
                entry[1] += event.time_range.elapsed_us()
        return totals

    with torch.inference_mode():
        run(steps)
        run(steps)  # captured in a CUDA graph (if this shape is new)
        wall_s = (cuda_time(lambda: run(steps), repeats=3) - cuda_time(lambda: run(0), repeats=3)) / steps
        full, base = kernels(steps, trace), kernels(0)
    decode_kernels = []
    for name, (calls, us) in full.items():
        base_calls, base_us = base.get(name, (0, 0.0))
        if calls > base_calls:
            decode_kernels.append((name, calls - base_calls, max(us - base_us, 0.0)))
    gpu_us = sum(us for _, _, us in decode_kernels)
    decode_kernels.sort(key=lambda k: -k[2])
    return {
        "form": "fp8" if holds_fp8(model) else "bf16",
        "shape": f"1x{new_tokens}", "cache": list(decode.StaticDecoder.shape(1, prompt_tokens, new_tokens)),
        "steps": steps, "wall_ms_per_token": round(wall_s * 1e3, 3), "gpu_ms_per_token": round(gpu_us / steps / 1e3, 3),
        "gpu_activities_per_token": round(sum(c for _, c, _ in decode_kernels) / steps, 1),
        "top": [{"kernel": name, "calls": calls, "total_ms": round(us / 1e3, 3),
                 "pct_gpu": round(100 * us / max(gpu_us, 1e-9), 1)} for name, calls, us in decode_kernels[:top]],
    }


GEMV_SHAPES = {  # (out, in) of each PE weight at batch 1; "+" rows are the stacked matrices
    "q": (4096, 3072), "k or v": (1024, 3072), "q+k+v": (6144, 3072), "o": (3072, 4096),
    "gate or up": (9216, 3072), "gate+up": (18432, 3072), "down": (3072, 9216), "lm_head": (131072, 3072),
}


def gemv_bandwidth(device: str, calls: int = 50) -> list[dict]:
    """GB/s of one ``[1, in] x [out, in]^T`` product per shape: cuBLAS and a compiled reduction, each replayed
    ``calls`` times from one CUDA graph (no launch gaps), median of 5 replays."""
    def reduction(x, w):
        return (x.float() * w.float()).sum(-1).to(x.dtype)

    kernels = {"cublas": torch.nn.functional.linear, "reduction": torch.compile(reduction, dynamic=False)}
    rows = []
    for name, (out_features, in_features) in GEMV_SHAPES.items():
        w = torch.randn(out_features, in_features, device=device, dtype=torch.bfloat16)
        x = torch.randn(1, in_features, device=device, dtype=torch.bfloat16)
        row = {"weight": name, "shape": f"{out_features}x{in_features}", "mb": round(w.numel() * 2 / 1e6, 1)}
        graph = None
        for kernel, fn in kernels.items():
            try:
                fn(x, w), fn(x, w)  # compiles, warms up
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(calls):
                        fn(x, w)
                seconds = cuda_time(graph.replay, repeats=5) / calls
                row[f"{kernel}_us"] = round(seconds * 1e6, 1)
                row[f"{kernel}_gb_s"] = round(w.numel() * 2 / seconds / 1e9)
            except Exception as error:
                traceback.print_exc()
                row[f"{kernel}_us"] = f"{type(error).__name__}"
        rows.append(row)
        print(row, flush=True)
        del w, graph
    return rows


def gemv_table(rows: list[dict]) -> str:
    lines = ["| weight | shape | MB | cuBLAS µs (GB/s) | compiled reduction µs (GB/s) |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['weight']} | {r['shape']} | {r['mb']} | {r.get('cublas_us')} ({r.get('cublas_gb_s')}) | "
                     f"{r.get('reduction_us')} ({r.get('reduction_gb_s')}) |")
    return "\n".join(lines)


def profile_table(profile: dict) -> str:
    rows, slots = profile["cache"]
    lines = [f"{profile['form']} PE, graphed, at {profile['shape']} ({rows} x {slots} cache slots), "
             f"{profile['steps']} decode steps: "
             f"{profile['wall_ms_per_token']} ms/token wall, {profile['gpu_ms_per_token']} ms/token on the GPU in "
             f"{profile['gpu_activities_per_token']} kernels/copies", "",
             "| kernel | calls | total ms | % of GPU time |", "|---|---|---|---|"]
    for k in profile["top"]:
        name = k["kernel"] if len(k["kernel"]) <= 90 else k["kernel"][:87] + "..."
        lines.append(f"| `{name}` | {k['calls']} | {k['total_ms']} | {k['pct_gpu']} |")
    if not profile["top"]:
        lines.append("| (no CUDA kernels recorded: is CUPTI available to torch.profiler?) ||||")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| variant | batch | new tokens | decode tok/s (per seq) | decode tok/s (all) | TTFT ms | compile s "
             "| total s | peak GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['batch']} | {r['new_tokens']} | error: {r['error'][:60]} |||||| ")
            continue
        lines.append(f"| {r['variant']} | {r['batch']} | {r['new_tokens']} | {r['decode_tok_s_per_seq']} | "
                     f"{r['decode_tok_s_total']} | {r['ttft_ms']} | {r['compile_s']} | {r['total_s']} | "
                     f"{r['peak_gib']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="generate,static,pack-sdpa,pack")
    parser.add_argument("--shapes", default="1x256,1x1024,4x1024", help="batch x new tokens, comma separated")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="Baidu's template + a short prompt ~ 100")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", action="store_true", help="top CUDA kernels of 32 graphed decode steps at 1x256, "
                        "in the last variant's form")
    parser.add_argument("--gemv", action="store_true", help="bandwidth of batch-1 products per PE weight shape")
    parser.add_argument("--probe", action="store_true", help="the graphed path's tokens against the probe's eager "
                        "token of the same form (the plan's GRAPHED_PE), at the smallest batch-1 shape measured")
    args = parser.parse_args()
    use_comfyui()  # imports the pack as comfyui_ernie_image (the PE engine itself needs no ComfyUI)
    import transformers

    from comfyui_ernie_image.nodes.pe import protocol
    from comfyui_ernie_image.nodes.pe.local import decode

    started = time.time()
    model = random_true_size_pe(device=args.device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    report = {"date": datetime.date.today().isoformat(), "machine": machine(), "transformers": transformers.__version__,
              "weights_gb": round(weights / 1e9, 2), "prompt_tokens": args.prompt_tokens, "rows": [], "checks": {}}
    print(f"{report['machine']}, transformers {transformers.__version__}; PE weights {weights / 1e9:.2f} GB "
          f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters)", flush=True)
    out = Path(os.environ["OUT"]) / "bench_pe.json" if os.environ.get("OUT") else None

    def save() -> None:
        if out is not None:
            out.write_text(json.dumps(report, indent=1))

    if args.gemv:
        report["gemv"] = gemv_bandwidth(args.device)
        save()
    make_run = runners(model, decode, protocol)
    shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.shapes.split(",")]
    slots = {f"{b}x{n}": decode.StaticDecoder.shape(b, args.prompt_tokens, n) for b, n in shapes}
    print(f"pack cache buckets (rows, slots): {slots}", flush=True)
    for variant in filter(None, args.variants.split(",")):
        run = make_run[variant]()
        for batch, new_tokens in shapes:
            row = {"variant": variant, "batch": batch, "new_tokens": new_tokens}
            try:
                row.update(measure(run, batch, new_tokens, args.prompt_tokens, args.device))
            except Exception as error:  # one run on a lent machine: record and go on
                traceback.print_exc()
                row["error"] = f"{type(error).__name__}: {error}"
            report["rows"].append(row)
            print(f"[{time.time() - started:6.0f} s] {row}", flush=True)
            save()
        del run  # its KV caches, before the next variant's peak memory is measured
        gc.collect()
        torch.cuda.empty_cache()
    if args.profile:
        try:
            trace = out.with_name("bench_pe_trace.json.gz") if out is not None else None
            report["profile"] = profile_decode(model, decode, protocol, args.prompt_tokens, args.device, trace=trace)
        except Exception as error:
            traceback.print_exc()
            report["profile"] = f"{type(error).__name__}: {error}"
        save()
    if args.probe:
        from comfyui_ernie_image.nodes.host.probe import measure as probe_costs

        report["graphed_pe"] = graphed_factors(report["rows"], probe_costs(args.device).seconds)
        print(f"graphed PE token / probe's eager token: {report['graphed_pe']}", flush=True)
        save()
    try:
        report["checks"]["greedy_agreement"] = agreement(model, decode, protocol, args.prompt_tokens, args.device)
    except Exception as error:
        traceback.print_exc()
        report["checks"]["greedy_agreement"] = f"{type(error).__name__}: {error}"
    save()
    print(f"\ngreedy agreement: {report['checks']['greedy_agreement']}")
    print(f"weights read per token: {weights / 1e9:.2f} GB; at 4.3 TB/s that bounds batch-1 decode at "
          f"{4.3e12 / weights:.0f} tok/s\n")
    print(table(report["rows"]))
    if "gemv" in report:
        print("\n" + gemv_table(report["gemv"]))
    if isinstance(report.get("profile"), dict):
        print("\n" + profile_table(report["profile"]))
    elif "profile" in report:
        print(f"\nprofile: {report['profile']}")


if __name__ == "__main__":
    main()
