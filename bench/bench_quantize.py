"""The quantized ERNIE-Image DiT vs bf16 on one GPU, in one process (issue: quantization and memory).

True-size DiT (8.03B) with random weights, 1024x1024 (64x64 latent), 256 text tokens. For bf16 and each quantization
method this GPU can run, done the way the loader does it (``nodes.accel.quantize``):
- quantize s: from CPU-resident bf16 weights (as read from disk), on the GPU when the bf16 DiT fits there (else on
  the CPU, as the loader chooses);
- weights GiB: GPU memory of the DiT's weights, measured (ComfyUI's estimate: the pack's ModelPatcher size);
- eager / compiled ms: one forward of the pack's DiT (batch 1), eager, then with the pack's regional compile;
- rel. error: ||out - ref|| / ||ref|| of the DiT output at one step (sigma 0.5) vs bf16, same weights and inputs.
Methods that cannot run here show the loader's error words. Then the peak GPU memory of a whole Turbo 1024x1024 run
with fp8_per_row weights: 8 steps of ComfyUI's sampler through the pack's MODEL (weights loaded by ComfyUI), then the
VAE decode (random weights, real architecture) with the DiT unloaded.

    python bench/bench_quantize.py [--no-compile]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from functools import partial

import torch
from bench_dit_sampling import comfy_sampling
from common import TRUE_DIT, cuda_time, machine, random_true_size_dit, use_comfyui

DEVICE = torch.device("cuda")
LATENT, TEXT_TOKENS = 64, 256
VARIANTS = ["bf16", "fp8_per_row", "fp8_weight_only", "int8_weight_only"]
TOLERANCE = {"fp8_per_row": 0.10, "fp8_weight_only": 0.10, "int8_weight_only": 0.05}  # accepted rel. error
RUN_METHOD = "fp8_per_row"  # the low-VRAM recipe's DiT
COMPILE_DEADLINE_S = 300  # no compile starts later than this: the whole script stays under 8 minutes
GIB = 2**30
START = time.perf_counter()


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def seeded_dit() -> torch.nn.Module:
    """The same random bf16 weights on every call."""
    torch.manual_seed(0)
    return random_true_size_dit(device=DEVICE)


@torch.inference_mode()
def forward(model, inputs: dict) -> torch.Tensor:
    """The pack's forward (what its MODEL runs)."""
    from comfyui_ernie_image.nodes.dit.forward import ernie_forward

    return ernie_forward(model, **inputs)


def forward_ms(model, inputs: dict) -> float:
    forward(model, inputs)  # warm-up at the timed shapes
    return 1000 * cuda_time(lambda: forward(model, inputs), repeats=5)


def quantize(model, variant: str, on: torch.device) -> torch.nn.Module:
    from comfyui_ernie_image.nodes.accel.capability import METHODS
    from comfyui_ernie_image.nodes.accel.quantize import quantize_torchao

    return model if variant == "bf16" else quantize_torchao(model, METHODS[variant].quant_type, on)


def measure_eager(variant: str, inputs: dict, reference: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    """Quantize as the loader does, then weight memory, eager time and error; also returns the output."""
    from comfyui_ernie_image.nodes.accel.quantize import quantization_device
    from comfyui_ernie_image.nodes.dit.model import make_model_patcher

    model = seeded_dit().to("cpu")  # where the loader has the weights after reading them
    free()
    base = torch.cuda.memory_allocated()
    on = quantization_device(model, DEVICE)  # the loader's choice
    start = time.perf_counter()
    quantize(model, variant, on)
    torch.cuda.synchronize()
    quantize_s = time.perf_counter() - start
    estimate = make_model_patcher(model).model_size()
    model.to(DEVICE)
    weights = torch.cuda.memory_allocated() - base
    out = forward(model, inputs)
    error = None if reference is None else ((out.float() - reference.float()).norm() / reference.float().norm()).item()
    row = dict(method=variant, quantized_on=str(on) if variant != "bf16" else "—", quantize_s=quantize_s,
               weights_gib=weights / GIB, comfy_estimate_gib=estimate / GIB, eager_ms=forward_ms(model, inputs),
               rel_error=error, tolerance=TOLERANCE.get(variant))
    del model
    free()
    return row, out


def measure_compiled(row: dict, inputs: dict) -> None:
    """Adds compile time and compiled forward time to ``row`` (same weights, quantized in place on the GPU)."""
    from comfyui_ernie_image.nodes.accel.compile import RegionalCompile

    model = quantize(seeded_dit(), row["method"], DEVICE)
    regional = RegionalCompile(model.layers)  # the pack's compile (the loader's default on CUDA)
    regional.install()
    start = time.perf_counter()
    forward(model, inputs)
    torch.cuda.synchronize()
    row["compile_s"] = time.perf_counter() - start
    row["compiled_ms"] = forward_ms(model, inputs)
    regional.remove()
    del model
    torch._dynamo.reset()
    free()


def measure_run(variant: str) -> dict:
    """Peak GPU memory of Turbo 1024x1024 (8 steps, CFG 1) under ComfyUI's sampler, then of the VAE decode. The DiT
    is quantized on the CPU here, as the loader does when the bf16 DiT does not fit on the GPU (timed)."""
    import comfy.model_management
    import comfy.sd
    from diffusers import AutoencoderKLFlux2

    from comfyui_ernie_image.nodes.accel.patching import compile_by_default
    from comfyui_ernie_image.nodes.dit.model import make_model_patcher
    from comfyui_ernie_image.nodes.dit.schedule import reference_sigmas
    from comfyui_ernie_image.nodes.dit.vae import make_vae

    model = seeded_dit().to("cpu")
    start = time.perf_counter()
    patcher = compile_by_default(make_model_patcher(quantize(model, variant, torch.device("cpu"))))
    cpu_quantize_s = time.perf_counter() - start
    del model
    text = torch.randn(TEXT_TOKENS, TRUE_DIT["text_in_dim"], device=DEVICE, dtype=torch.bfloat16)
    noise = torch.randn(1, TRUE_DIT["in_channels"], LATENT, LATENT)
    sigmas = reference_sigmas(8)
    turbo = partial(comfy_sampling, patcher, noise, text, text[:40], sigmas, 1.0)
    free()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    latent = turbo()  # the first run loads the weights
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    dit_peak = torch.cuda.max_memory_allocated()
    loaded_s = cuda_time(turbo)
    comfy.model_management.unload_all_models()
    del turbo, patcher
    free()
    vae = make_vae(AutoencoderKLFlux2().state_dict(), "random weights")  # as the loader makes it
    torch.cuda.reset_peak_memory_stats()
    vae.decode(latent)
    vae_peak = torch.cuda.max_memory_allocated()
    comfy.model_management.unload_all_models()
    return dict(method=variant, cpu_quantize_s=cpu_quantize_s, first_run_s=first_s, loaded_run_s=loaded_s,
                dit_stage_peak_gib=dit_peak / GIB,
                vae_stage_peak_gib=vae_peak / GIB)


def report(facts, rows: list[dict], refused: dict[str, str], runs: list[dict]) -> None:
    def num(row, key, fmt):
        return format(row[key], fmt) if row.get(key) is not None else "—"

    print(f"\n{machine()}; {facts}\n")
    print("| method | quantize s (on) | DiT weights GiB (ComfyUI's estimate) | eager ms/forward | compiled ms/forward "
          "(compile s) | rel. error vs bf16 | within tolerance |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['method']} | failed: {r['error']} | | | | | |")
            continue
        if r.get("rel_error") is None or r["tolerance"] is None:
            within = "(the reference)" if r["method"] == "bf16" else "—"
        else:
            within = f"{'yes' if r['rel_error'] <= r['tolerance'] else 'NO'} (≤ {r['tolerance']})"
        print(f"| {r['method']} | {num(r, 'quantize_s', '.1f')} ({r['quantized_on']}) | {num(r, 'weights_gib', '.2f')} "
              f"({num(r, 'comfy_estimate_gib', '.2f')}) | {num(r, 'eager_ms', '.1f')} | "
              f"{r.get('compile_error') or num(r, 'compiled_ms', '.1f')} ({num(r, 'compile_s', '.0f')}) | "
              f"{num(r, 'rel_error', '.4f')} | {within} |")
    for method, words in refused.items():
        print(f"| {method} | cannot run here: {words} | | | | | |")
    print("\n| Turbo 1024², 8 steps | quantize s on the CPU | first run s (loads weights) | loaded run s | "
          "DiT stage peak GiB | VAE decode peak GiB |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        if "error" in r:
            print(f"| {r['method']} | failed: {r['error']} | | | | |")
        else:
            print(f"| {r['method']} | {r['cpu_quantize_s']:.1f} | {r['first_run_s']:.2f} | {r['loaded_run_s']:.2f} | "
                  f"{r['dit_stage_peak_gib']:.2f} | {r['vae_stage_peak_gib']:.2f} |")


def save(facts, rows, refused, runs) -> None:
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_quantize.json"), "w") as f:
            json.dump(dict(machine=machine(), facts=repr(facts), rows=rows, refused=refused, runs=runs), f, indent=1)


def failed(row: dict, error: Exception, key: str = "error") -> None:
    """Record ``error`` in ``row`` and go on with the next variant: a benchmark reports every variant it can."""
    traceback.print_exc()
    row[key] = f"{type(error).__name__}: {error}"[:300]
    free()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled timings")
    parser.add_argument("--no-run", action="store_true", help="skip the whole Turbo run with CPU-quantized weights")
    args = parser.parse_args()
    use_comfyui()
    from comfyui_ernie_image.nodes.accel.capability import METHODS, probe, problem

    facts = probe(DEVICE)
    print(facts, flush=True)
    refused = {m: problem(m, facts, torch.bfloat16) for m in METHODS if m != "none"}
    refused = {m: words for m, words in refused.items() if words is not None}
    if facts.torchao:
        import cache_dit.quantization.torchao  # noqa: F401  (imports torchao once, outside the timings)
    torch.manual_seed(1)
    inputs = dict(
        latents=torch.randn(1, TRUE_DIT["in_channels"], LATENT, LATENT, device=DEVICE, dtype=torch.bfloat16),
        timestep=torch.full((1,), 500.0, device=DEVICE, dtype=torch.bfloat16),  # sigma 0.5
        text=torch.randn(1, TEXT_TOKENS, TRUE_DIT["text_in_dim"], device=DEVICE, dtype=torch.bfloat16),
        text_lens=[TEXT_TOKENS],
    )
    rows, runs, reference = [], [], None
    for variant in [v for v in VARIANTS if v not in refused]:
        row = dict(method=variant)
        try:
            measured, out = measure_eager(variant, inputs, reference)
            row.update(measured)
            reference = out if variant == "bf16" else reference
        except Exception as e:
            failed(row, e)
        rows.append(row)
        print(row, flush=True)
        save(facts, rows, refused, runs)
    if RUN_METHOD not in refused and not args.no_run:
        run = dict(method=RUN_METHOD)
        try:
            run.update(measure_run(RUN_METHOD))
        except Exception as e:
            failed(run, e)
        runs.append(run)
        print(run, flush=True)
        save(facts, rows, refused, runs)
    for row in [] if args.no_compile else rows:
        if "error" in row or time.perf_counter() - START > COMPILE_DEADLINE_S:
            continue
        try:
            measure_compiled(row, inputs)
        except Exception as e:
            failed(row, e, key="compile_error")
        print(row, flush=True)
        save(facts, rows, refused, runs)
    report(facts, rows, refused, runs)
    print(f"\ntotal {time.perf_counter() - START:.0f} s")


if __name__ == "__main__":
    main()
