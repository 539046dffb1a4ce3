"""The quantized ERNIE-Image DiT vs bf16 on one GPU, in one process (issue: quantization and memory).

True-size DiT (8.03B) with random weights, 1024x1024 (64x64 latent), 256 text tokens. For bf16 and each quantization
method this GPU can run, done the way the loader does it (``nodes.quant.quantize``):
- quantize s: from CPU-resident bf16 weights (as read from disk), on the GPU when the bf16 DiT fits there (else on
  the CPU, as the loader chooses);
- weights GiB: GPU memory of the DiT's weights, measured (ComfyUI's estimate: the pack's ModelPatcher size);
- eager / compiled ms: one forward of the pack's DiT (batch 1), eager, then with the pack's regional compile;
- rel. error: ||out - ref|| / ||ref|| of the DiT output at one step (sigma 0.5) vs bf16, same weights and inputs.
Methods that cannot run here show the loader's error words. Then whole Turbo 1024x1024 runs (text encoder, 8 steps of
ComfyUI's sampler through the pack's MODEL, VAE decode) with ComfyUI's model management behaving as on a 24 GiB card,
and the peak GPU memory of each stage (``measure_run``).

    python bench/bench_quantize.py [--methods bf16,fp8_per_row] [--runs fp8_per_row,bf16] [--no-compile]
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
from common import TRUE_DIT, cuda_time, machine, pack_dit, pack_forward, random_true_size_dit, use_comfyui

DEVICE = torch.device("cuda")
LATENT, TEXT_TOKENS = 64, 256
VARIANTS = ["bf16", "fp8_per_row", "fp8_weight_only", "int8_weight_only"]
TOLERANCE = {"fp8_per_row": 0.10, "fp8_weight_only": 0.10, "int8_weight_only": 0.05}  # accepted rel. error
CARD_GIB = 24  # the whole-run measurement behaves as on a card of this size
GIB = 2**30
START = time.perf_counter()


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def seeded_dit() -> torch.nn.Module:
    """The same random bf16 weights on every call."""
    torch.manual_seed(0)
    return pack_dit(random_true_size_dit(device=DEVICE))


@torch.inference_mode()
def forward(model, inputs: dict) -> torch.Tensor:
    """The pack's forward (what its MODEL runs)."""
    return pack_forward(model, **inputs)


def forward_ms(model, inputs: dict) -> float:
    forward(model, inputs)  # warm-up at the timed shapes
    return 1000 * cuda_time(lambda: forward(model, inputs), repeats=5)


def quantize(model, variant: str, on: torch.device) -> torch.nn.Module:
    """As the loader node does, under inference mode like every node in ComfyUI's executor. (torchao's weights made
    outside inference mode refuse ``detach`` inside it, where ComfyUI moves and sizes models.)"""
    from comfyui_ernie_image.nodes.quant.capability import METHODS
    from comfyui_ernie_image.nodes.quant.quantize import quantize_torchao

    with torch.inference_mode():
        return model if variant == "bf16" else quantize_torchao(model, METHODS[variant].quant_type, on)


def measure_eager(variant: str, inputs: dict, reference: torch.Tensor | None) -> tuple[dict, torch.Tensor]:
    """Quantize as the loader does, then weight memory, eager time and error; also returns the output."""
    from comfyui_ernie_image.nodes.dit.model import make_model_patcher
    from comfyui_ernie_image.nodes.host.memory import usable_memory
    from comfyui_ernie_image.nodes.quant.quantize import quantization_device

    model = seeded_dit().to("cpu")  # where the loader has the weights after reading them
    free()
    base = torch.cuda.memory_allocated()
    on = quantization_device(model, DEVICE, usable_memory)  # the loader's choice
    start = time.perf_counter()
    quantize(model, variant, on)
    torch.cuda.synchronize()
    quantize_s = time.perf_counter() - start
    estimate = make_model_patcher(model, whole=variant != "bf16").model_size()  # quantized: whole, as the loader
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


def text_stage(encoder, ids: torch.Tensor) -> torch.Tensor:
    """What the text encode node does (``nodes/text/managed.py``), from token ids: ComfyUI loads the encoder."""
    import comfy.model_management

    comfy.model_management.load_model_gpu(encoder.patcher)
    with torch.inference_mode():
        hidden = encoder.encoder.language_model(input_ids=ids.to(encoder.patcher.load_device),
                                                output_hidden_states=True).hidden_states[-2][0]
    return hidden.to(comfy.model_management.intermediate_device())


def measure_run(variant: str) -> dict:
    """Whole Turbo 1024x1024 runs (8 steps, CFG 1), first as on a 24 GB card, then on the whole GPU.

    As on a card of ``CARD_GIB``: torch may allocate no more (``set_per_process_memory_fraction``) and ComfyUI's
    model management reserves the rest of the GPU, so it offloads and keeps models as it would there. Stages, each
    with its peak of allocated GPU memory and its time: the loader quantizing the DiT where it chooses
    (``quantization_device``; on a 24 GB card with nothing loaded the bf16 DiT fits there too); the text encoder
    (true-size random Ministral 3B, 300 tokens) under ComfyUI's management; ComfyUI's sampler on the pack's MODEL
    with the loader's default compile; the VAE decode (random weights, real architecture). The first run loads and
    compiles, the second is what each later prompt costs there. Then the limits are lifted: everything stays
    loaded, and the last run is the end-to-end time on this GPU."""
    import comfy.model_management
    from bench_fast_path import random_text_encoder
    from diffusers import AutoencoderKLFlux2

    from comfyui_ernie_image.nodes.accel.patching import compile_by_default
    from comfyui_ernie_image.nodes.dit.model import make_model_patcher
    from comfyui_ernie_image.nodes.dit.schedule import reference_sigmas
    from comfyui_ernie_image.nodes.dit.vae import make_vae
    from comfyui_ernie_image.nodes.host.memory import usable_memory
    from comfyui_ernie_image.nodes.quant.quantize import quantization_device
    from comfyui_ernie_image.nodes.text.encoder import ErnieTextEncoder
    from comfyui_ernie_image.nodes.text.managed import ManagedTextEncoder

    management = comfy.model_management
    total = torch.cuda.get_device_properties(DEVICE).total_memory
    reserved_before = management.EXTRA_RESERVED_VRAM
    peaks: dict[str, float] = {}
    times: dict[str, float] = {}
    loaded: dict[str, list[str]] = {}

    def stage(name: str, fn):
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times[name] = time.perf_counter() - start
        peaks[name] = max(peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / GIB)
        modules = [m.model.model for m in management.current_loaded_models]  # LoadedModel → patcher → module
        loaded[name] = [type(getattr(m, "module", m)).__name__ for m in modules]  # inside the pack's containers
        return result

    row = dict(method=variant, card_gib=CARD_GIB)
    try:
        model = seeded_dit().to("cpu")  # as read from disk (made on the GPU, in fp32 first: before the limit)
        encoder = ManagedTextEncoder(ErnieTextEncoder(random_text_encoder().to("cpu"), tokenizer=None))
        vae = make_vae(AutoencoderKLFlux2().state_dict(), "random weights")  # as the loader makes it
        free()
        management.EXTRA_RESERVED_VRAM = reserved_before + max(total - CARD_GIB * GIB, 0)
        torch.cuda.set_per_process_memory_fraction(min(CARD_GIB * GIB / total, 1.0))
        on = quantization_device(model, DEVICE, usable_memory) if variant != "bf16" else None
        quantized = stage("load + quantize DiT", partial(quantize, model, variant, on))
        patcher = compile_by_default(make_model_patcher(quantized, whole=variant != "bf16"))
        del model, quantized
        ids = torch.randint(1000, 100000, (1, 300))
        noise = torch.randn(1, TRUE_DIT["in_channels"], LATENT, LATENT)
        sigmas = reference_sigmas(8)

        def turbo():
            text = stage("text encoder", lambda: text_stage(encoder, ids))
            latent = stage("DiT sampling", lambda: comfy_sampling(patcher, noise, text, text[:40], sigmas, 1.0))
            with torch.inference_mode():  # as ComfyUI's executor runs the node; with autograd it held 11 GiB
                return stage("VAE decode", lambda: vae.decode(latent))

        row.update(quantized_on=str(on), quantize_s=times["load + quantize DiT"],
                   quantize_peak_gib=peaks.pop("load + quantize DiT"))
        row["first_run_s"] = cuda_time(turbo)  # loads the models, compiles
        row["first_run_peak_gib"] = max(peaks.values())  # compiling may take more than the runs after it
        peaks.clear()
        row["card_run_s"] = cuda_time(turbo)
        peaks["load + quantize DiT"] = row["quantize_peak_gib"]
        row.update(peak_gib=max(peaks.values()), stage_peaks_gib=dict(peaks), card_stage_s=dict(times),
                   loaded_models=dict(loaded))
        management.EXTRA_RESERVED_VRAM = reserved_before
        torch.cuda.set_per_process_memory_fraction(1.0)
        turbo()  # loads whatever the card's limit had unloaded
        row["gpu_run_s"] = cuda_time(turbo)
        row["gpu_stage_s"] = dict(times)
        return row
    finally:
        management.unload_all_models()
        management.EXTRA_RESERVED_VRAM = reserved_before
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch._dynamo.reset()
        free()


def diffusers_reference() -> dict:
    """The diffusers pipeline's Turbo run on the same GPU (bf16, eager, text encoding included): the yardstick."""
    from bench_fast_path import diffusers_turbo_s, random_text_encoder

    transformer, encoder = seeded_dit(), random_text_encoder()
    ids = torch.randint(1000, 100000, (1, 300), device=DEVICE)

    @torch.inference_mode()
    def encode():
        return encoder(input_ids=ids, output_hidden_states=True).hidden_states[-2][0]

    total_s, vae_s = diffusers_turbo_s(transformer, encode)
    return dict(method="diffusers pipeline (bf16, eager)", gpu_run_s=total_s, vae_decode_s=vae_s)


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
    print(f"\n| Turbo 1024², 8 steps | quantize s (on) | first run s (loads, compiles) | "
          f"run s as on a {CARD_GIB} GiB card | peak GiB there | stage peaks GiB | loaded models after each stage | "
          "run s on the whole GPU (stages) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        if "error" in r:
            print(f"| {r['method']} | failed: {r['error']} | | | | | | |")
            continue
        if "stage_peaks_gib" not in r:  # the yardstick
            print(f"| {r['method']} | | | | | | | {r['gpu_run_s']:.3f} (VAE decode {r['vae_decode_s']:.3f}) |")
            continue
        stages = "; ".join(f"{k} {v:.2f}" for k, v in r["stage_peaks_gib"].items())
        models = "; ".join(f"{k}: {', '.join(v) or '—'}" for k, v in r["loaded_models"].items())
        split = ", ".join(f"{k} {v:.3f}" for k, v in r.get("gpu_stage_s", {}).items())
        print(f"| {r['method']} | {r['quantize_s']:.1f} ({r['quantized_on']}) | {r['first_run_s']:.1f} | "
              f"{r['card_run_s']:.2f} | {r['peak_gib']:.2f} | {stages} | {models} | "
              f"{r.get('gpu_run_s', float('nan')):.3f} ({split}) |")


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
    parser.add_argument("--methods", default=",".join(VARIANTS), help="forward rows, comma separated")
    parser.add_argument("--runs", default="fp8_per_row", help="whole Turbo runs as on a 24 GiB card ('' for none)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled timings")
    parser.add_argument("--no-run", action="store_true", help="the same as --runs ''")
    parser.add_argument("--reference", action="store_true", help="also the diffusers pipeline's Turbo run")
    parser.add_argument("--compile-deadline-s", type=float, default=300,
                        help="no compiled timing starts after this many seconds (a device call lasts 10 minutes)")
    args = parser.parse_args()
    use_comfyui()
    from comfyui_ernie_image.nodes.quant.capability import METHODS, probe, problem

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
    for method in [] if args.no_run else [m for m in filter(None, args.runs.split(",")) if m not in refused]:
        run = dict(method=method)
        try:
            run.update(measure_run(method))
        except Exception as e:
            failed(run, e)
        runs.append(run)
        print(run, flush=True)
        save(facts, rows, refused, runs)
    if args.reference:
        run = dict(method="diffusers pipeline")
        try:
            run = diffusers_reference()
        except Exception as e:
            failed(run, e)
        runs.append(run)
        print(run, flush=True)
        save(facts, rows, refused, runs)
    for variant in [v for v in args.methods.split(",") if v in VARIANTS and v not in refused]:
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
    for row in [] if args.no_compile else rows:
        if "error" in row or time.perf_counter() - START > args.compile_deadline_s:
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
