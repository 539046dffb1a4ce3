"""Does ComfyUI's unload (what ``POST /free`` with ``unload_models`` runs) release the pack's GPU memory?

True-size random DiT: load it through ComfyUI's model management by sampling one step, then call
``unload_all_models`` + ``soft_empty_cache`` as the server's worker does, and report allocated GPU memory.

    python bench/bench_free.py
"""

from __future__ import annotations

import torch
from common import machine, pack_dit, random_true_size_dit, use_comfyui


def gib() -> float:
    return torch.cuda.memory_allocated() / 2**30


def main() -> None:
    use_comfyui()
    import comfy.model_management as mm
    import comfy.sample
    import comfy.samplers

    from comfyui_ernie_image.nodes.dit.model import make_model_patcher
    from comfyui_ernie_image.nodes.dit.schedule import reference_sigmas

    patcher = make_model_patcher(pack_dit(random_true_size_dit(device="cpu")))
    print(f"{machine()}\nbuilt on the CPU: {gib():.2f} GiB on the GPU")
    text = [[torch.randn(1, 64, 3072, dtype=torch.bfloat16), {}]]
    noise = torch.randn(1, 128, 64, 64)
    comfy.sample.sample_custom(patcher, noise, 1.0, comfy.samplers.ksampler("euler"), reference_sigmas(1), text,
                               text, torch.zeros_like(noise), seed=0)
    loaded = [type(m.model.model).__name__ for m in mm.current_loaded_models]
    print(f"after one sampling step: {gib():.2f} GiB allocated; ComfyUI's loaded models: {loaded}")
    mm.unload_all_models()
    mm.soft_empty_cache()
    loaded = [type(m.model.model).__name__ for m in mm.current_loaded_models]
    print(f"after unload_all_models (POST /free): {gib():.2f} GiB allocated; ComfyUI's loaded models: {loaded}")


if __name__ == "__main__":
    main()
