"""The VAE decode on a 24 GB card beside 14 GiB of other loaded models: the pack's memory estimate vs core's.

As in ``bench_quantize.measure_run``, torch may allocate no more than 24 GiB and ComfyUI's model management reserves
the rest of the GPU. Two stand-in models of 7 GiB each (empty bf16 tensors under ComfyUI's management: the text
encoder and an FP8 DiT weigh about that) are loaded, then the loader's VAE decodes one 1024x1024 image, first with
the pack's estimate of the decode's memory (``nodes/dit/vae.decode_memory``), then with core's (4.25 GiB for this
VAE). Each decode is warmed up once; the timed round reloads the stand-ins first, so its time includes moving back
whatever ComfyUI unloaded (from untouched host memory: slower than a real model's reload). Prints time, peak GiB
and the models loaded after.

    cd bench && python3 bench_vae_card.py
"""

from __future__ import annotations

import time

import torch
from common import use_comfyui

GIB = 2**30
CORE_ESTIMATE = 4.25 * GIB  # core's memory_used_decode for this VAE at 1024² in bf16 (bench_vae.py)


def main() -> None:
    use_comfyui()
    import comfy.model_management as mm
    from diffusers import AutoencoderKLFlux2

    from comfyui_ernie_image.nodes.dit.vae import make_vae
    from comfyui_ernie_image.nodes.managed import text_model_patcher

    total = torch.cuda.get_device_properties(0).total_memory
    vae = make_vae(AutoencoderKLFlux2().state_dict(), "random weights")
    latent = torch.randn(1, 128, 64, 64)

    def stand_in():
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.empty(7 * GIB // 2, dtype=torch.bfloat16), requires_grad=False)
        return text_model_patcher(module)

    others = [stand_in(), stand_in()]
    mm.EXTRA_RESERVED_VRAM += total - 24 * GIB
    torch.cuda.set_per_process_memory_fraction(24 * GIB / total)
    for name, estimate in (("pack", vae.memory_used_decode), ("core", lambda shape, dtype: CORE_ESTIMATE)):
        vae.memory_used_decode = estimate
        for _ in range(2):  # warm-up, then the timed round
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for patcher in others:
                mm.load_model_gpu(patcher)
            vae.decode(latent)
            torch.cuda.synchronize()
        loaded = [type(m.model.model).__name__ for m in mm.current_loaded_models]
        print(name, f"{time.perf_counter() - start:.3f} s, peak {torch.cuda.max_memory_allocated() / GIB:.2f} GiB, "
              f"loaded {loaded}", flush=True)


if __name__ == "__main__":
    main()
