"""Core's VAE (``comfy.sd.VAE``): it recognises the Flux.2 VAE that ERNIE-Image uses from its weights.

Its decoder can compute large images in slabs of rows (``decode_in_row_slabs``). A convolution that keeps the height
(stride 1, kernel 2·padding + 1 rows) gives each output row from the input rows around it alone, so a slab of output
rows computed from its input rows and ``padding`` rows either side is those rows of the whole result. So do the steps
that feed one: a nearest 2× upsampling (each row is a row of its input), and a GroupNorm and SiLU once the norm's
statistics are taken over the whole image. Slabs shrink the tensors a decode holds at once, not the numbers:

- each height-keeping convolution runs a slab at a time (a whole 1024² decode peaked 2.13 GiB above its start on the
  H200, 1 GiB of it scratch inside one convolution call; in slabs 1.55: bench/RESULTS.md, sessions 20 and 21);
- a ``ResnetBlock`` normalises its input a slab at a time as its convolution takes it, instead of holding a
  normalised copy beside the input (at 1024² the first full-size block held 0.5 GiB of input, 0.5 normalised, 0.25
  out: the decode's peak after the convolutions' slabs);
- an ``Upsample`` upsamples a slab at a time as its convolution takes it (the last one held a 0.5 GiB upsampled copy),
  and first empties torch's cache of the smaller blocks it could not reuse.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import comfy.ldm.modules.diffusionmodules.model as vae_model
import comfy.model_management as mm
import comfy.ops
import comfy.sd
import torch
import torch.nn.functional as F

from .patchers import keeps_host_copy

# A step whose input and output rows together exceed this runs in slabs that each stay under it. A 1024² decode on
# the H200 (bench_vae --slab-mib, session 22): whole 2.13 GiB, 0.089 s; in slabs of 128 MiB 1.17 GiB, 0.084 s; of 32
# MiB 1.05 GiB, 0.123 s (the convolutions alone in slabs of 128 MiB, session 21: 1.55 GiB, 0.099 s).
SLAB_BYTES = 128 * 2**20


def core_vae(state_dict: dict[str, torch.Tensor]) -> comfy.sd.VAE:
    """Core's VAE for these weights (diffusers' or ComfyUI's keys). Where the sampler and the decode cannot share
    the card, ComfyUI unloads it for each sampling and loads it for each decode: it keeps its host copy
    (``patchers.keeps_host_copy``; otherwise 0.2 GB is copied out and in at the pageable rate each prompt: 0.11 s out
    alone on an emulated 8 GB card with a LoRA, bench/RESULTS.md, session 30)."""
    vae = comfy.sd.VAE(sd=state_dict)
    keeps_host_copy(vae.patcher)
    return vae


def _rows_per_slab(rows: int, row_bytes: int) -> int:
    """How many rows a slab takes so that each stays under ``SLAB_BYTES``: all of them when they do at once."""
    slabs = min(rows, math.ceil(row_bytes * rows / SLAB_BYTES))
    return math.ceil(rows / slabs) if slabs > 1 else rows


def _in_row_slabs(rows: int, step: int, halo: int, compute: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """The ``rows`` output rows, ``step`` at a time: ``compute(first, last)`` gives output rows first..last-1, of
    which those ``halo`` rows away from a slab's cut saw every input row they depend on (the image's own edges get
    the convolution's own zero padding)."""
    out = None
    for top in range(0, rows, step):
        bottom = min(top + step, rows)
        first, last = max(top - halo, 0), min(bottom + halo, rows)
        part = compute(first, last)
        if out is None:
            out = part.new_empty((*part.shape[:2], rows, part.shape[-1]))
        out[:, :, top:bottom] = part[:, :, top - first:bottom - first]
    return out


def _keeps_rows(layer: torch.nn.Module) -> bool:
    return (isinstance(layer, torch.nn.Conv2d) and layer.stride[0] == 1 and layer.dilation[0] == 1
            and layer.padding_mode == "zeros" and not isinstance(layer.padding, str)
            and layer.kernel_size[0] == 2 * layer.padding[0] + 1)


def _row_bytes(x: torch.Tensor, channels_out: int, extra_per_channel_in: int = 0) -> int:
    return x.shape[0] * x.shape[-1] * (x.shape[1] * (x.element_size() + extra_per_channel_in)
                                       + channels_out * x.element_size())


class _RowSlabConv:
    """Put before a 2-D convolution class of core's (``comfy.ops``): its forward, a slab of rows at a time."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if x.ndim != 4:
            return super().forward(x, *args, **kwargs)
        step = _rows_per_slab(x.shape[-2], _row_bytes(x, self.out_channels))
        if step == x.shape[-2]:
            return super().forward(x, *args, **kwargs)
        convolve = super().forward
        return _in_row_slabs(x.shape[-2], step, self.padding[0],
                             lambda first, last: convolve(x[:, :, first:last], *args, **kwargs))


def _norm_weights(norm: torch.nn.GroupNorm, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if getattr(norm, "comfy_cast_weights", False) or getattr(norm, "weight_function", None) \
            or getattr(norm, "bias_function", None):
        return comfy.ops.cast_bias_weight(norm, x)  # where core casts them (partial loading, dynamic VRAM)
    return norm.weight, norm.bias


def _norm_scale_shift(x: torch.Tensor, norm: torch.nn.GroupNorm, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The GroupNorm of ``x`` as ``x·scale + shift`` per image and channel (float), as torch computes it; the
    statistics gathered a slab of rows at a time (Chan's pairwise combination), never on a float copy of ``x``."""
    batch, channels, rows = x.shape[:3]
    count, mean, squares = 0, None, None
    for top in range(0, rows, step):
        part = x[:, :, top:top + step].float().reshape(batch, norm.num_groups, -1)
        var, mu = torch.var_mean(part, dim=-1, correction=0)
        n = part.shape[-1]
        if mean is None:
            count, mean, squares = n, mu, var * n
            continue
        delta, total = mu - mean, count + n
        mean = mean + delta * (n / total)
        squares = squares + var * n + delta.square() * (count * n / total)
        count = total
    per_group = channels // norm.num_groups
    rstd = torch.rsqrt(squares / count + norm.eps).repeat_interleave(per_group, dim=1)
    weight, bias = _norm_weights(norm, x)
    scale = rstd * weight.float()
    shift = bias.float() - scale * mean.repeat_interleave(per_group, dim=1)
    return scale[..., None, None], shift[..., None, None]


def _norm_silu_conv(x: torch.Tensor, norm: torch.nn.GroupNorm, conv: torch.nn.Conv2d) -> torch.Tensor:
    """``conv(silu(norm(x)))``, the normalised input made a slab of rows at a time (a float slab as scratch)."""
    step = _rows_per_slab(x.shape[-2], _row_bytes(x, conv.out_channels, extra_per_channel_in=4))
    scale, shift = _norm_scale_shift(x, norm, step)

    def compute(first: int, last: int) -> torch.Tensor:
        normalised = torch.addcmul(shift, x[:, :, first:last].float(), scale).to(x.dtype)
        return conv(F.silu(normalised, inplace=True))

    return _in_row_slabs(x.shape[-2], step, conv.padding[0], compute)


def _no_carry(args: tuple, kwargs: dict) -> bool:
    """Whether a block's call passes no video carry: current cores call ``block(h, temb, conv_carry_in,
    conv_carry_out)`` and ``upsample(h, conv_carry_in, conv_carry_out)``, both None for an image (model.py
    @9b6bab1b); 0.3.75 passes nothing."""
    return all(value is None for value in (*args, *kwargs.values()))


def _slabbable_norm(norm: torch.nn.Module) -> bool:
    return isinstance(norm, torch.nn.GroupNorm) and norm.affine


class _RowSlabResnetBlock:
    """Put before core's ``ResnetBlock``: for a large image, each norm → SiLU → convolution a slab at a time."""

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
        plain = (x.ndim == 4 and temb is None and _no_carry(args, kwargs)
                 and (not self.training or self.dropout.p == 0)
                 and _slabbable_norm(self.norm1) and _slabbable_norm(self.norm2)
                 and _keeps_rows(self.conv1) and _keeps_rows(self.conv2))
        if not plain or x.shape[-2] == _rows_per_slab(x.shape[-2], _row_bytes(x, self.out_channels)):
            return super().forward(x, temb, *args, **kwargs)
        h = _norm_silu_conv(x, self.norm1, self.conv1)
        h = _norm_silu_conv(h, self.norm2, self.conv2)
        if self.in_channels != self.out_channels:
            x = self.conv_shortcut(x) if self.use_conv_shortcut else self.nin_shortcut(x)
        return h.add_(x)  # core's x + h, into h


class _RowSlabUpsample:
    """Put before core's ``Upsample``: for a large image, the nearest 2× upsampling a slab at a time."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        scale = getattr(self, "scale_factor", 2.0)
        scale = tuple(scale) if isinstance(scale, (tuple, list)) else (scale, scale)
        plain = (x.ndim == 4 and _no_carry(args, kwargs) and self.with_conv
                 and scale == (2.0, 2.0) and _keeps_rows(self.conv))
        rows = 2 * x.shape[-2]
        # An output row: a row of the upsampled input and of the convolution's output, both twice as wide.
        step = _rows_per_slab(rows, 2 * _row_bytes(x, self.conv.out_channels)) if plain else rows
        if step == rows:
            return super().forward(x, *args, **kwargs)
        # The tensors from here on are the decode's largest; torch's cache holds the sampler's and the lower
        # resolutions' freed blocks, too small for them. Released first, that memory serves these instead of adding
        # to them: on an emulated 8 GB card the decode's reserved peak was 0.78 GiB above its allocated peak.
        mm.soft_empty_cache()

        def compute(first: int, last: int) -> torch.Tensor:
            source = x[:, :, first // 2:(last + 1) // 2]  # output row r is input row r // 2
            up = F.interpolate(source, scale_factor=2.0, mode="nearest")
            offset = first - 2 * (first // 2)
            return self.conv(up[:, :, offset:offset + last - first])

        return _in_row_slabs(rows, step, self.conv.padding[0], compute)


_SLABBED: dict[type, type] = {}


def decode_in_row_slabs(decoder: torch.nn.Module) -> int:
    """Every height-keeping 2-D convolution, ``ResnetBlock`` and ``Upsample`` under ``decoder`` computes large
    images in slabs of rows (the same numbers, up to the GroupNorm's float rounding; less memory); returns how many
    modules that is."""
    mixins = ((vae_model.ResnetBlock, _RowSlabResnetBlock), (vae_model.Upsample, _RowSlabUpsample))
    count = 0
    for module in decoder.modules():
        if isinstance(module, (_RowSlabConv, _RowSlabResnetBlock, _RowSlabUpsample)):
            continue
        mixin = next((mixin for core, mixin in mixins if isinstance(module, core)), None)
        if mixin is None and _keeps_rows(module):
            mixin = _RowSlabConv
        if mixin is None:
            continue
        base = type(module)
        if base not in _SLABBED:
            _SLABBED[base] = type(f"RowSlab{base.__name__}", (mixin, base), {})
        module.__class__ = _SLABBED[base]
        count += 1
    return count
