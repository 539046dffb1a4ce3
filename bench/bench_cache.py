"""Cache-DiT presets and regional compile on the pack's MODEL under ComfyUI's sampler (issue: Cache-DiT accelerator).

True-size ERNIE-Image DiT, random bf16 weights, 1024x1024 (64x64 latent), 256 prompt tokens, 40 negative tokens.
Turbo: 8 steps, CFG 1; Base: 50 steps, CFG 4 (cond and uncond batched). Every variant runs through the pack's
ModelPatcher and ``comfy.sample.sample_custom`` (as bench_dit_sampling.py), beside the plain diffusers loop, in one
process on the same module.

Presets are timed with their steps mask made static (every mask cache step is cached): on random weights the
residual threshold means nothing, so a dynamic preset would cache an arbitrary number of steps. The static time is
each preset's best case; on real weights the dynamic presets cache only the mask steps under their threshold.

    python bench/bench_cache.py            # from the repository root; writes $OUT/bench_cache.json when OUT is set
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
import traceback
from functools import partial

import torch
from bench_dit_sampling import NEGATIVE_TOKENS, PROMPT_TOKENS, comfy_sampling, diffusers_loop
from common import cuda_time, machine, pack_dit, random_true_size_dit, use_comfyui

LATENT = 64
BUDGET_S = float(os.environ.get("BENCH_BUDGET_S", 500))  # stop starting variants after this (the lead's limit: 9 min)
# name, steps, CFG, timed repeats (after a short warm-up); Base first: its ≥ 3x target matters most
RUNS = [("Base", 50, 4.0, 1), ("Turbo", 8, 1.0, 3)]


def variants(patcher) -> list[tuple]:
    """(name, a function making the MODEL (None: the diffusers loop), the preset timed with a static mask)."""
    from comfyui_ernie_image.nodes.accel.cache_presets import PRESETS
    from comfyui_ernie_image.nodes.accel.patching import CacheJob, apply_cache, apply_compile

    def cached(model, name):
        settings = dataclasses.replace(PRESETS[name].settings, steps_mask_cache="static")
        return apply_cache(model, CacheJob(settings, name, None))

    compiled = partial(apply_compile, patcher, "default")
    # Most telling first, so a time budget cuts the least telling.
    return [
        ("diffusers loop, eager", None, None),
        ("pack, uncached, eager", lambda: patcher, None),
        ("pack + compile", compiled, None),
        *[(f"pack + compile + {name}", lambda n=name: cached(compiled(), n), name) for name in ("ultra", "fast")],
        *[(f"pack + {name}", partial(cached, patcher, name), name) for name in reversed(PRESETS)],
    ]


class Summaries(logging.Handler):
    """Keeps the Cache-DiT summary line of each sampling run (steps computed / cached)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@torch.no_grad()
def forward_times(transformer, text, negative, time_left: float) -> list[dict]:
    """One DiT forward at batch 1 (Turbo) and 2 (Base CFG): eager, the pack's regional compile (dynamic sequence
    length), and, time allowing, diffusers' ``compile_repeated_blocks`` (static shapes) for reference."""
    from diffusers import ErnieImagePipeline

    from comfyui_ernie_image.nodes.accel.compile import RegionalCompile

    calls = {}
    for batch in (1, 2):
        x = torch.randn(batch, 128, LATENT, LATENT, device="cuda", dtype=torch.bfloat16)
        t = torch.full((batch,), 500.0, device="cuda", dtype=torch.bfloat16)
        text_bth, lens = ErnieImagePipeline._pad_text([negative, text][-batch:], "cuda", torch.bfloat16, 3072)
        calls[batch] = partial(transformer, hidden_states=x, timestep=t, text_bth=text_bth, text_lens=lens,
                               return_dict=False)
    rows = {batch: dict(batch=batch) for batch in calls}
    for batch, call in calls.items():
        call()
        rows[batch]["eager_ms"] = 1000 * cuda_time(call, repeats=10)
    regional = RegionalCompile(transformer.layers)
    regional.install()
    try:
        for batch, call in calls.items():
            call(), call()  # compiled during the sampling runs already; compiles here if not
            rows[batch]["compiled_ms"] = 1000 * cuda_time(call, repeats=10)
    finally:
        regional.remove()
    if time_left > 120:  # two static compiles
        torch._dynamo.reset()  # or the dynamic graphs above would serve these calls too
        transformer.compile_repeated_blocks()
        try:
            for batch, call in calls.items():
                call(), call()
                rows[batch]["static_ms"] = 1000 * cuda_time(call, repeats=10)
        finally:
            for block in transformer.layers:
                vars(block).pop("_compiled_call_impl", None)
    return list(rows.values())


def main() -> None:
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")  # cache-dit logs its setup at every run otherwise
    use_comfyui()
    import comfy.model_management

    from comfyui_ernie_image.nodes.dit.model import make_model_patcher
    from comfyui_ernie_image.nodes.dit.schedule import reference_sigmas

    summaries = Summaries()
    logging.getLogger("comfyui_ernie_image.nodes.accel").addHandler(summaries)
    logging.getLogger("comfyui_ernie_image.nodes.accel").setLevel(logging.INFO)
    started = time.perf_counter()
    transformer = random_true_size_dit()
    patcher = make_model_patcher(pack_dit(transformer))  # the pack's DiT on the same weights
    comfy.model_management.load_models_gpu([patcher])  # the plain loop shares the module: weights on the GPU first
    text = torch.randn(PROMPT_TOKENS, 3072, device="cuda", dtype=torch.bfloat16)
    negative = torch.randn(NEGATIVE_TOKENS, 3072, device="cuda", dtype=torch.bfloat16)
    noise = torch.randn(1, 128, LATENT, LATENT)
    rows, errors = [], []
    for run, steps, cfg, repeats in RUNS:
        sigmas, warm_sigmas = reference_sigmas(steps), reference_sigmas(2)
        for name, make_model, preset in variants(patcher):
            if time.perf_counter() - started > BUDGET_S:
                rows.append(dict(run=run, variant=name, skipped="time budget"))
                continue
            try:
                model = None if make_model is None else make_model()
                if model is None:
                    timed = partial(diffusers_loop, transformer, noise.cuda().bfloat16(), text, negative, sigmas[:-1],
                                    cfg)
                    warm = partial(diffusers_loop, transformer, noise.cuda().bfloat16(), text, negative,
                                   warm_sigmas[:-1], cfg)
                else:
                    timed = partial(comfy_sampling, model, noise, text, negative, sigmas, cfg)
                    warm = partial(comfy_sampling, model, noise, text, negative, warm_sigmas, cfg)
                warm()  # loads the weights, compiles, picks kernels at the timed shapes
                torch.cuda.reset_peak_memory_stats()
                seconds = cuda_time(timed, repeats=repeats)
                rows.append(dict(run=run, variant=name, steps=steps, cfg=cfg, preset=preset, seconds=seconds,
                                 peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                                 summary=summaries.lines[-1] if preset and summaries.lines else ""))
            except Exception as e:  # one broken variant must not cost the others
                errors.append(f"{run} / {name}: {e!r}\n{traceback.format_exc()}")
                rows.append(dict(run=run, variant=name, error=repr(e)))
    try:
        forwards = forward_times(transformer, text, negative, BUDGET_S - (time.perf_counter() - started))
    except Exception as e:
        errors.append(f"forward times: {e!r}\n{traceback.format_exc()}")
        forwards = []
    comfy.model_management.unload_all_models()
    report(rows, forwards, errors, time.perf_counter() - started)


def report(rows: list[dict], forwards: list[dict], errors: list[str], elapsed: float) -> None:
    from comfyui_ernie_image.nodes.accel.cache_presets import PRESETS

    print(f"\n{machine()}; {elapsed:.0f} s in all\n")
    print("| run | variant | cached steps (static mask) | time | ms/step | vs pack eager | vs diffusers loop "
          "| peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "seconds" not in r:
            print(f"| {r['run']} | {r['variant']} | | {r.get('error') or r.get('skipped')} | | | | |")
            continue
        base = {x["variant"]: x.get("seconds") for x in rows if x["run"] == r["run"]}
        preset = PRESETS.get(r["preset"])
        cached = "" if preset is None else (preset.base_cached if r["steps"] == 50 else preset.turbo_cached)
        ratio = {k: (f"{base[k] / r['seconds']:.2f}x" if base.get(k) else "n/a")
                 for k in ("pack, uncached, eager", "diffusers loop, eager")}
        print(f"| {r['run']} | {r['variant']} | {cached} | {r['seconds']:.3f} s "
              f"| {1000 * r['seconds'] / r['steps']:.1f} | {ratio['pack, uncached, eager']} "
              f"| {ratio['diffusers loop, eager']} | {r['peak_gib']:.1f} |")
    print("\n| DiT forward, batch | eager | pack compile (dynamic length) | speed-up | diffusers "
          "compile_repeated_blocks (static) | speed-up |\n|---|---|---|---|---|---|")
    for f in forwards:
        static = (f"{f['static_ms']:.1f} ms | {f['eager_ms'] / f['static_ms']:.2f}x" if "static_ms" in f
                  else "skipped (time budget) |")
        print(f"| {f['batch']} | {f['eager_ms']:.1f} ms | {f.get('compiled_ms', float('nan')):.1f} ms | "
              f"{f['eager_ms'] / f.get('compiled_ms', float('nan')):.2f}x | {static} |")
    print("\nCache-DiT summaries (last timed run of each preset):")
    for r in rows:
        if r.get("summary"):
            print(f"- {r['run']} / {r['variant']}: {r['summary']}")
    for e in errors:
        print(f"\nERROR {e}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_cache.json"), "w") as f:
            json.dump({"machine": machine(), "elapsed_s": elapsed, "rows": rows, "forwards": forwards,
                       "errors": errors}, f, indent=1)


if __name__ == "__main__":
    main()
