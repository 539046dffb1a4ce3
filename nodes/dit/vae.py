"""The ERNIE-Image VAE as a core ComfyUI VAE that decodes exactly like the diffusers pipeline (adapter).

The decoder stays eager: compiled, it decoded 1024² in 39-42 ms instead of 91-94 on the H200, but its first decode
took from 18 s to 154 s (bench/RESULTS.md, "Fast path on Hopper"), too long and too unpredictable for a default.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ErnieImageError
from ..host.vae import core_vae
from ..model_files import builds_weights, read_safetensors

# The VAE's batch-norm epsilon as trained and as diffusers applies it; ComfyUI's Flux.2 VAE assumes 1e-4,
# which shifts every decoded latent channel whose running variance is small.
TRAINED_BN_EPS = 1e-5
@builds_weights
def make_vae(state_dict: dict[str, torch.Tensor], source: str):
    """A core ``VAE`` from the Flux.2 VAE weights (diffusers or ComfyUI keys), with the trained BN epsilon."""
    vae = core_vae(state_dict)
    if getattr(vae.first_stage_model, "bn", None) is None:
        raise ErnieImageError(
            f"{source} is not the Flux.2 VAE that ERNIE-Image uses (no batch-norm latent statistics). "
            "Use the vae/ of an ERNIE-Image snapshot or flux2-vae.safetensors."
        )
    vae.first_stage_model.bn_eps = TRAINED_BN_EPS
    # Core's estimate of the decode's memory stays: 4.25 GiB at 1024² in bf16, where the decode takes 1.07 GiB on
    # an H200 under inference mode (bench/RESULTS.md, 2026-12-01 session 9).
    return vae


@builds_weights  # the weights read as normal tensors too: core's dynamic-VRAM VAE assigns them as its parameters
def load_vae(path: Path):
    return make_vae(read_safetensors(path), str(path))


def load_snapshot_vae(snapshot: Path):
    path = snapshot / "vae" / "diffusion_pytorch_model.safetensors"
    if not path.is_file():
        raise ErnieImageError(
            f"The snapshot {snapshot} has no vae/diffusion_pytorch_model.safetensors. "
            "The download is incomplete: download the whole snapshot."
        )
    return load_vae(path)
