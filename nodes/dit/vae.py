"""The ERNIE-Image VAE as a core ComfyUI VAE that decodes exactly like the diffusers pipeline (adapter).

The decoder stays eager: compiled, it decoded 1024² in 39-42 ms instead of 91-94 on the H200, but its first decode
took from 18 s to 154 s (bench/RESULTS.md, "Fast path on Hopper"), too long and too unpredictable for a default.
"""

from __future__ import annotations

import functools
import weakref
from pathlib import Path

import torch

from ..errors import ErnieImageError
from ..host.vae import core_vae, decode_in_row_slabs
from ..model_files import builds_weights, read_safetensors
from ..plan import session

# The VAE's batch-norm epsilon as trained and as diffusers applies it; ComfyUI's Flux.2 VAE assumes 1e-4,
# which shifts every decoded latent channel whose running variance is small.
TRAINED_BN_EPS = 1e-5
# What a whole decode of one 1024² image (a 64×64 Flux.2 latent) needs beside the VAE's weights, in bf16: its
# activations peak at 1.25 GiB (bench/vae_activation_peak.py); plus 30 %. On the GPU, with the decoder in slabs of
# rows (host/vae.py), the decode peaks 1.17 GiB over its start, in bench/bench_vae.py as in ComfyUI's executor on
# emulated 8 and 12 GB cards (warm prompts: 5.18 → 6.35 and 8.83 → 10.00 GiB; bench/RESULTS.md, session 22); torch's
# reserved memory rises 1.66 GiB from an emptied cache. Whole, it took 2.13 GiB, 1 GiB of it scratch inside the last
# Upsample's convolution call, over this estimate; at 2.35 ComfyUI unloaded the text encoder before every decode on
# 12 GB (warm 1.50 s became 2.7-4.2 s) and part of the DiT on 8 GB (session 18). Core's estimate for this VAE is
# 4.25 GiB, which pushed a resident DiT or text encoder off a 16 or 24 GB card for every decode.
DECODE_BYTES_1024_BF16 = int(1.64 * 2**30)
LATENT_PIXELS_1024 = 64 * 64


def decode_memory(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes one image of a ``shape`` latent (``[batch, 128, h, w]``) needs to decode in ``dtype``: scaled by its
    pixels and the dtype's size from the 1024² bf16 figure. Per image, as core's estimates are (core divides the
    free memory by it to choose the decode's batch)."""
    return int(DECODE_BYTES_1024_BF16 * shape[-2] * shape[-1] / LATENT_PIXELS_1024 * dtype.itemsize / 2)


@builds_weights
def make_vae(state_dict: dict[str, torch.Tensor], source: str):
    """A core ``VAE`` from the Flux.2 VAE weights (diffusers or ComfyUI keys), with the trained BN epsilon; its
    decoder computes large images in slabs of rows (``host/vae.py``: the same image up to float rounding; at 1024² a
    peak of 1.17 GiB, not 2.13)."""
    vae = core_vae(state_dict)
    if getattr(vae.first_stage_model, "bn", None) is None:
        raise ErnieImageError(
            f"{source} is not the Flux.2 VAE that ERNIE-Image uses (no batch-norm latent statistics). "
            "Use the vae/ of an ERNIE-Image snapshot or flux2-vae.safetensors."
        )
    vae.first_stage_model.bn_eps = TRAINED_BN_EPS
    decode_in_row_slabs(vae.first_stage_model.decoder)
    vae.memory_used_decode = decode_memory  # core reads it before each decode (VAE.decode and decode_tiled)
    vae.decode = _timed(vae)
    return vae


def _timed(vae):
    """``vae``'s decode, after which the log states the prompt's time beside the plan's prediction (the decode ends a
    prompt). It refers to ``vae`` weakly: held by the VAE itself, a strong reference would make a cycle that keeps
    the VAE alive until a garbage collection after its last user drops it."""
    decode = weakref.WeakMethod(vae.decode)

    @functools.wraps(type(vae).decode)
    def timed(*args, **kwargs):
        images = decode()(*args, **kwargs)
        session.prompt_finished()
        return images
    return timed


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
