"""One DiT forward at true size: the pack's DiT against diffusers' and ComfyUI's native ERNIE-Image, same weights.

The issue "The DiT as a ComfyUI-native model" asks for this comparison: eager and with the blocks compiled (the
pack's regional compile, the same for all three), bf16, 1024² (4096 image tokens) and 256 text tokens, batch 1,
each output's relative error against diffusers' forward on an fp32 copy of the weights.

ComfyUI's native model (``comfy/ldm/ernie/model.py``, ComfyUI >= 0.19) is public source that stays out of this
repository: pass a copy with ``--native PATH`` (it imports ``comfy.ldm.modules.attention``, which 0.3.75 has).

Each forward is timed once the GPU has run it back to back for 3 s (its clock settled, as in a sampling loop).
``--profile`` adds, per implementation and way of running, where one forward's GPU time goes: matrix products,
attention and the rest (norms, modulation, RoPE, casts), the costliest kernels and where the GPU sat idle between
kernels; the SM clock, power draw and NVML's reasons for any clock below maximum while each is timed; and the rate
of the blocks' largest matrix product alone, run once after a pause and back to back (whether the GPU clocks down
under dense work).

    python bench/bench_native_dit.py [--native .gpu/native_ernie.py] [--profile] [--tiny --device cpu]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from common import TRUE_DIT, cuda_time, gpu_clock, machine, pack_dit, pack_forward, random_true_size_dit, use_comfyui

TINY = dict(hidden_size=64, num_attention_heads=4, num_layers=3, ffn_hidden_size=128, in_channels=128,
            out_channels=128, text_in_dim=32, rope_axes_dim=(4, 6, 6))


def native_dit(path: Path, reference: torch.nn.Module, config: dict) -> torch.nn.Module:
    """ComfyUI's native ERNIE-Image model from ``path``, holding ``reference``'s weights (shared)."""
    import comfy.ops

    spec = importlib.util.spec_from_file_location("native_ernie", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["native_ernie"] = module  # where torch.compile looks the module up again
    spec.loader.exec_module(module)
    with torch.device("meta"):
        model = module.ErnieImageModel(**config, dtype=reference.dtype, operations=comfy.ops.disable_weight_init)
    model.load_state_dict(reference.state_dict(), strict=True, assign=True)
    return model.eval()


def time_ms(call, device: torch.device, repeats: int = 20, readings: dict | None = None,
            settle_s: float = 3.0) -> float:
    """Median ms of ``call`` once the GPU has run it back to back for ``settle_s``: its clock ramps up from idle
    (after a compile, say), and a sampling loop of many steps runs at the settled clock."""
    call()  # warm-up (and compile) at the timed shapes
    if device.type != "cuda":
        return float("nan")
    start = time.perf_counter()
    while time.perf_counter() - start < settle_s:
        call()
        torch.cuda.synchronize()
    with gpu_clock(readings) if readings is not None else nullcontext():  # a sampling thread only where asked
        return 1000 * cuda_time(call, repeats=repeats)


def matmul_rates(device: torch.device, tokens: int, hidden: int, ffn: int) -> dict:
    """TFLOP/s of the blocks' largest product (``tokens × hidden → ffn``) once after a 0.2 s pause (median of 5),
    and 200 times back to back, with the clock and power of the latter."""
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    w = torch.randn(ffn, hidden, device=device, dtype=torch.bfloat16)
    flop = 2 * tokens * hidden * ffn
    torch.nn.functional.linear(x, w)
    once = []
    for _ in range(5):
        time.sleep(0.2)
        once.append(cuda_time(lambda: torch.nn.functional.linear(x, w)))
    readings: dict = {}
    with gpu_clock(readings):
        seconds = cuda_time(lambda: [torch.nn.functional.linear(x, w) for _ in range(200)])
    return dict(after_pause_tflops=round(flop / sorted(once)[2] / 1e12), back_to_back_tflops=round(
        200 * flop / seconds / 1e12), back_to_back=readings)


# Kernel names by kind (cuBLAS: nvjet, sm90_xmma, cutlass; cuDNN's and FlashAttention's): attention first, as
# some attention kernels carry an architecture prefix too.
KINDS = {"attention": re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I),
         "matmul": re.compile(r"gemm|nvjet|cutlass|xmma|aten::mm|aten::addmm|sm90_", re.I)}


def kernel_profile(call, device: torch.device, top: int = 12) -> dict:
    """One call's kernel time (ms) by kind, and its ``top`` costliest kernels (the CPU's ops on the CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as trace:
        call()
        if cuda:
            torch.cuda.synchronize()
    events = [(e.key, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1000, e.count)
              for e in trace.key_averages() if (e.self_device_time_total if cuda else e.self_cpu_time_total) > 0]
    kinds = dict.fromkeys([*KINDS, "other"], 0.0)
    for name, ms, _ in events:
        kinds[next((kind for kind, pattern in KINDS.items() if pattern.search(name)), "other")] += ms
    events.sort(key=lambda e: -e[1])
    return dict(kinds_ms={k: round(v, 2) for k, v in kinds.items()},
                top=[dict(kernel=name[:120], ms=round(ms, 2), calls=count) for name, ms, count in events[:top]],
                **(idle_gaps(trace.events()) if cuda else {}))


def idle_gaps(events: list, top: int = 6, least_us: float = 20.0) -> dict:
    """Where the GPU sat idle within one traced call: the total of the gaps of at least ``least_us`` between
    one kernel's end and the next one's start, and the ``top`` longest, each with when it began (ms after the first
    kernel) and the kernel that ended it."""
    from torch.autograd import DeviceType

    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    gaps, busy_until = [], kernels[0].time_range.end
    for kernel in kernels[1:]:
        if kernel.time_range.start - busy_until >= least_us:
            gaps.append((kernel.time_range.start - busy_until, busy_until - kernels[0].time_range.start,
                         kernel.name))
        busy_until = max(busy_until, kernel.time_range.end)
    gaps.sort(key=lambda g: -g[0])
    return dict(span_ms=round((busy_until - kernels[0].time_range.start) / 1000, 2),
                idle_ms=round(sum(g[0] for g in gaps) / 1000, 2),
                gaps=[dict(ms=round(us / 1000, 3), at_ms=round(at / 1000, 2), before=name[:80])
                      for us, at, name in gaps[:top]])


def _print_profile(label: str, profile: dict) -> None:
    print(f"  {label}: " + ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in profile["kinds_ms"].items()))
    if "gaps" in profile:
        print(f"    GPU idle {profile['idle_ms']} ms of a {profile['span_ms']} ms span; longest gaps {profile['gaps']}")
    for kernel in profile["top"]:
        print(f"    {kernel['ms']:8.2f} ms  {kernel['calls']:5d}x  {kernel['kernel']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--native", type=Path, help="a copy of ComfyUI's comfy/ldm/ernie/model.py")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke run of the script)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", action="store_true", help="where each forward's kernel time goes")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")) / "native_dit.json")
    args = parser.parse_args()
    use_comfyui(cpu=args.device == "cpu")
    from comfyui_ernie_image.nodes.accel.compile import RegionalCompile, compile_settings

    device = torch.device(args.device)
    config = {**TRUE_DIT, "patch_size": 1} if not args.tiny else {**TINY, "patch_size": 1}
    side, tokens = (8, 5) if args.tiny else (64, 256)
    torch.manual_seed(0)
    diffusers_dit = random_true_size_dit(device=args.device, **(TINY if args.tiny else {}))
    latents = torch.randn(1, config["in_channels"], side, side, device=device, dtype=torch.bfloat16)
    timestep = torch.full((1,), 500.0, device=device, dtype=torch.bfloat16)
    text = torch.randn(1, tokens, config["text_in_dim"], device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        fp32 = random_true_size_dit(dtype=torch.float32, device=args.device, **(TINY if args.tiny else {}))
        fp32.load_state_dict(diffusers_dit.state_dict())
        reference = fp32(latents.float(), timestep.float(), text.float(), torch.tensor([tokens], device=device),
                         return_dict=False)[0]
        del fp32

    calls = {
        "diffusers": (diffusers_dit, lambda: diffusers_dit(latents, timestep, text,
                                                            torch.tensor([tokens], device=device),
                                                            return_dict=False)[0]),
    }
    pack = pack_dit(diffusers_dit)
    calls["pack"] = (pack, lambda: pack_forward(pack, latents, timestep, text, [tokens]))
    if args.native:
        native = native_dit(args.native, diffusers_dit, config)
        calls["comfyui native"] = (native, lambda: native(latents, timestep, text))

    rows = []
    for name, (model, call) in calls.items():
        with torch.inference_mode():
            out = call()
            error = ((out.float() - reference).norm() / reference.norm()).item()
            clocks: dict = {"eager": {}, "compiled": {}} if args.profile else {}
            eager = time_ms(call, device, readings=clocks.get("eager"))
            profiles = {"eager": kernel_profile(call, device)} if args.profile else {}
            regional = RegionalCompile(model.layers)
            regional.install()
            try:
                with compile_settings():
                    compiled = time_ms(call, device, readings=clocks.get("compiled"))
                    if args.profile:
                        profiles["compiled"] = kernel_profile(call, device)
            finally:
                regional.remove()
        rows.append(dict(implementation=name, eager_ms=eager, compiled_ms=compiled, rel_error=error,
                         profiles=profiles, clocks=clocks))
        print(f"{name}: eager {eager:.1f} ms, compiled blocks {compiled:.1f} ms, rel. error vs fp32 {error:.4f}"
              + (f"; SM clock and power {clocks}" if clocks else ""), flush=True)
        for label, profile in profiles.items():
            _print_profile(label, profile)
    rates = matmul_rates(device, side * side + tokens, config["hidden_size"], config["ffn_hidden_size"]) if (
        args.profile and device.type == "cuda") else {}
    if rates:
        print(f"the blocks' largest product alone: {rates}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(machine=machine(), rows=rows, matmul=rates), indent=1))


if __name__ == "__main__":
    main()
