"""Per-step time of the pack's MODEL under ComfyUI's sampler vs the plain diffusers loop (issue: text-to-image).

True-size ERNIE-Image DiT, random bf16 weights, 1024x1024 (64x64 latent), 256 prompt tokens, 40 negative tokens.
Both paths run in one process on the same module; each is warmed up at the timed shapes first.

    python bench/bench_dit_sampling.py
"""

from __future__ import annotations

import json
import os
from functools import partial

import torch
from common import cuda_time, machine, pack_dit, random_true_size_dit, use_comfyui

PROMPT_TOKENS, NEGATIVE_TOKENS, LATENT = 256, 40, 64


@torch.no_grad()
def diffusers_loop(transformer, latents, text, negative, sigmas, cfg):
    """The denoising loop of ``ErnieImagePipeline.__call__`` (pad text, batch CFG, scheduler step)."""
    from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=4.0)
    scheduler.set_timesteps(sigmas=sigmas, device="cuda")
    dtype = transformer.dtype
    hiddens = [negative, text] if cfg > 1 else [text]
    text_bth, text_lens = ErnieImagePipeline._pad_text(hiddens, "cuda", dtype, text.shape[-1])
    for t in scheduler.timesteps:
        model_input = torch.cat([latents, latents]) if cfg > 1 else latents
        t_batch = torch.full((model_input.shape[0],), t.item(), device="cuda", dtype=dtype)
        pred = transformer(hidden_states=model_input, timestep=t_batch, text_bth=text_bth, text_lens=text_lens,
                           return_dict=False)[0]
        if cfg > 1:
            uncond, cond = pred.chunk(2)
            pred = uncond + cfg * (cond - uncond)
        latents = scheduler.step(pred, t, latents).prev_sample
    return latents


def comfy_sampling(patcher, noise, text, negative, sigmas, cfg, cond_device="cpu"):
    """ComfyUI's sampler (Euler) on the pack's MODEL; conditioning on ``cond_device`` (the text encode node's
    output lives on ComfyUI's intermediate device, the CPU)."""
    import comfy.sample
    import comfy.samplers

    positive, negative_cond = [[text[None].to(cond_device), {}]], [[negative[None].to(cond_device), {}]]
    latent = torch.zeros_like(noise)
    with torch.inference_mode():  # as ComfyUI's executor runs every node
        return comfy.sample.sample_custom(patcher, noise, cfg, comfy.samplers.ksampler("euler"), sigmas,
                                          positive, negative_cond, latent, seed=0)


def main() -> None:
    use_comfyui()
    import comfy.model_management

    from comfyui_ernie_image.nodes.dit.model import make_model_patcher
    from comfyui_ernie_image.nodes.dit.schedule import reference_sigmas

    transformer = random_true_size_dit()
    patcher = make_model_patcher(pack_dit(transformer))  # the pack's DiT on the same weights
    text = torch.randn(PROMPT_TOKENS, 3072, device="cuda", dtype=torch.bfloat16)
    negative = torch.randn(NEGATIVE_TOKENS, 3072, device="cuda", dtype=torch.bfloat16)
    noise = torch.randn(1, 128, LATENT, LATENT)
    rows = []
    for name, steps, cfg in [("Turbo", 8, 1.0), ("Base", 50, 4.0)]:
        sigmas = reference_sigmas(steps)
        plain = partial(diffusers_loop, transformer, noise.cuda().bfloat16(), text, negative, sigmas[:-1], cfg)
        pack = partial(comfy_sampling, patcher, noise, text, negative, sigmas, cfg)
        pack(), plain()  # warm-up at the timed shapes; the first pack run loads the weights to the GPU
        torch.cuda.reset_peak_memory_stats()
        t_plain = cuda_time(plain, repeats=3)
        peak_plain = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
        t_pack = cuda_time(pack, repeats=3)
        peak_pack = torch.cuda.max_memory_allocated() / 2**30
        rows.append(dict(run=name, steps=steps, cfg=cfg, plain_s=t_plain, pack_s=t_pack,
                         plain_ms_per_step=1000 * t_plain / steps, pack_ms_per_step=1000 * t_pack / steps,
                         overhead_pct=100 * (t_pack / t_plain - 1), peak_plain_gib=peak_plain, peak_pack_gib=peak_pack))
    comfy.model_management.unload_all_models()

    print(f"\n{machine()}\n")
    print("| run | steps | CFG | diffusers loop | pack (ComfyUI SamplerCustom) | ms/step plain / pack | overhead | "
          "peak GiB plain / pack |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['steps']} | {r['cfg']} | {r['plain_s']:.3f} s | {r['pack_s']:.3f} s | "
              f"{r['plain_ms_per_step']:.1f} / {r['pack_ms_per_step']:.1f} | {r['overhead_pct']:+.1f} % | "
              f"{r['peak_plain_gib']:.1f} / {r['peak_pack_gib']:.1f} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_dit_sampling.json"), "w") as f:
            json.dump({"machine": machine(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
