"""Core's VAE (``comfy.sd.VAE``): it recognises the Flux.2 VAE that ERNIE-Image uses from its weights.

Its decoder's convolutions can compute in slabs of rows (``convolve_in_row_slabs``). A whole 1024² decode peaked
2.13 GiB above its start on the H200, 1 GiB of it allocated inside one convolution call (the last Upsample's, 256
channels at 1024², whose input and output are 0.5 GiB each; bench/RESULTS.md, session 20): the peak of every 8 and
12 GB recipe. A convolution that keeps the height (stride 1, kernel 2·padding + 1 rows) gives each output row from
the input rows around it alone, so a slab of output rows computed from its input rows and ``padding`` rows either
side is those rows of the whole result: only the scratch of a call shrinks, not the numbers. Normalisations, which
need the whole image, are left as they are.
"""

from __future__ import annotations

import math

import comfy.sd
import torch

# A convolution whose input and output rows together exceed this runs in slabs that each stay under it. A 1024²
# decode on the H200 (bench_vae --slab-mib, session 21): whole convolutions 2.13 GiB, 0.092 s; slabs of 128 MiB 1.55
# GiB, 0.099 s; of 32 MiB 1.33 GiB, 0.108 s (the rest of the peak is the blocks' own tensors).
SLAB_BYTES = 128 * 2**20


def core_vae(state_dict: dict[str, torch.Tensor]) -> comfy.sd.VAE:
    """Core's VAE for these weights (diffusers' or ComfyUI's keys)."""
    return comfy.sd.VAE(sd=state_dict)


class _RowSlabs:
    """Put before a 2-D convolution class of core's (``comfy.ops``): its forward, a slab of rows at a time."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        rows = x.shape[-2] if x.ndim == 4 else 0
        row_bytes = (x.shape[1] + self.out_channels) * x.shape[0] * x.shape[-1] * x.element_size() if rows else 0
        slabs = min(rows, math.ceil(row_bytes * rows / SLAB_BYTES))
        if slabs <= 1:
            return super().forward(x, *args, **kwargs)
        step, halo = math.ceil(rows / slabs), self.padding[0]
        out = None
        for top in range(0, rows, step):
            bottom = min(top + step, rows)
            first, last = max(top - halo, 0), min(bottom + halo, rows)
            # Rows first..last-1 in, as many out (the height is kept); of those, top..bottom-1 saw every input row
            # they depend on, and the image's own edges get the convolution's own zero padding.
            part = super().forward(x[:, :, first:last], *args, **kwargs)
            if out is None:
                out = part.new_empty((*part.shape[:2], rows, part.shape[-1]))
            out[:, :, top:bottom] = part[:, :, top - first:bottom - first]
        return out


_SLABBED: dict[type, type] = {}


def _keeps_rows(layer: torch.nn.Conv2d) -> bool:
    return (layer.stride[0] == 1 and layer.dilation[0] == 1 and layer.padding_mode == "zeros"
            and not isinstance(layer.padding, str) and layer.kernel_size[0] == 2 * layer.padding[0] + 1)


def convolve_in_row_slabs(module: torch.nn.Module) -> int:
    """Every height-keeping 2-D convolution under ``module`` computes large inputs in slabs of rows (same numbers,
    less scratch); returns how many convolutions that is."""
    count = 0
    for layer in module.modules():
        if isinstance(layer, torch.nn.Conv2d) and not isinstance(layer, _RowSlabs) and _keeps_rows(layer):
            base = type(layer)
            if base not in _SLABBED:
                _SLABBED[base] = type(f"RowSlab{base.__name__}", (_RowSlabs, base), {})
            layer.__class__ = _SLABBED[base]
            count += 1
    return count
