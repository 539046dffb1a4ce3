"""The live activations of one whole VAE decode, on the CPU: what a decode must hold at once, without the GPU's
kernel workspaces and allocator caching (which ``bench_vae.py --stages`` sees on a GPU).

The loader's VAE (core's Flux.2 VAE, random weights, real architecture) decodes one image in bf16 under a dispatch
mode that counts each op's output storages while any tensor holds them. Scratch memory inside an op is not counted.

    python bench/vae_activation_peak.py 256 512      # image sides; the peak grows with the pixels
"""

from __future__ import annotations

import sys
import weakref

import torch
from common import use_comfyui
from torch.utils._python_dispatch import TorchDispatchMode

GIB = 2**30


class LiveStorages(TorchDispatchMode):
    """Bytes of the storages that ops returned and some tensor still holds; ``peak`` and the op that reached it."""

    def __init__(self):
        super().__init__()
        self.holders: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0
        self.peak_at = ""

    def _release(self, key: int) -> None:
        self.holders[key] -= 1
        if not self.holders[key]:
            self.live -= self.sizes.pop(key)
            del self.holders[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if not isinstance(tensor, torch.Tensor) or not tensor.untyped_storage().nbytes():
                continue
            key = tensor.untyped_storage().data_ptr()
            if key not in self.holders:
                self.holders[key], self.sizes[key] = 0, tensor.untyped_storage().nbytes()
                self.live += self.sizes[key]
            self.holders[key] += 1
            weakref.finalize(tensor, self._release, key)
            if self.live > self.peak:
                self.peak, self.peak_at = self.live, f"{func} -> {tuple(tensor.shape)}"
        return out


def main() -> None:
    sides = [int(s) for s in sys.argv[1:]] or [256, 512]
    use_comfyui(cpu=True)  # (it clears sys.argv)
    from diffusers import AutoencoderKLFlux2

    from comfyui_ernie_image.nodes.dit.vae import make_vae

    model = make_vae(AutoencoderKLFlux2().state_dict(), "random weights").first_stage_model.to(torch.bfloat16)
    for side in sides:
        latent = torch.randn(1, 128, side // 16, side // 16, dtype=torch.bfloat16)
        with torch.inference_mode(), LiveStorages() as live:
            model.decode(latent)
        print(f"{side}²: activations peak at {live.peak / GIB:.3f} GiB ({live.peak_at})", flush=True)


if __name__ == "__main__":
    main()
