"""fp8 storage for the Ministral 3 models' decoder linears, cast to the compute dtype as each layer runs (engine).

As core holds its own fp8 text encoders: the weight stays ``float8_e4m3fn`` (half of bf16's bytes) with a scale;
``forward`` casts it to the input's dtype and scales the product (in fp16, the weight). Plain torch, so it runs on
every GPU (no fp8 matmul needed: RTX 20/30 too) and the CPU, and torch.compile traces it; a decode step's few rows on
a CUDA GPU take one Triton kernel instead, which reads each weight byte once (``fp8_gemv``). Embeddings, norms and
the head stay in the compute dtype: they are a small part of the bytes and the embedding lookup is not a matmul.

Weights come either from an fp8 file (core's scaled-fp8 or comfy_quant layout: its fp8 weight and scale as they are)
or from a bf16/fp32 file quantized here one tensor at a time, with a per-row absmax scale.
"""

from __future__ import annotations

import re

import torch

from .fp8_gemv import fp8_rows

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# Compute dtypes in which the unscaled product (fp8 values up to 448 times the input, summed over a row) cannot
# overflow; in fp16 (max 65,504) the weight is scaled first.
WIDE_RANGE = (torch.bfloat16, torch.float32)
# The decoder layers' projections: what is stored in fp8 (``model.layers.<i>.self_attn.q_proj.weight`` …, or
# ``layers.<i>.…`` in the language model alone, the text encoder).
DECODER_LINEAR = re.compile(r"^(model\.)?layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
# The PE stacks each layer's gate and up projections into one after loading (``pe/local/fused.py``).
FUSED_LINEAR = re.compile(r"^(model\.)?layers\.\d+\.mlp\.gate_up_proj\.weight$")


class Fp8Linear(torch.nn.Module):
    """A ``Linear`` whose weight is held in fp8 with a scale (one per tensor, ``[]``, or per row, ``[out, 1]``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device),
                                         requires_grad=False)
        self.register_buffer("weight_scale", torch.ones((), device=device))
        self.bias = torch.nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        out = fp8_rows(x, self.weight, self.weight_scale)  # a decode step on a CUDA GPU: one kernel (fp8_gemv)
        if out is not None:
            return out if bias is None else out + bias
        if x.dtype not in WIDE_RANGE:
            weight = self.weight.to(x.dtype) * self.weight_scale.to(x.dtype)
            return torch.nn.functional.linear(x, weight, bias)
        # A row's scale is its output column's: scaling the product instead of the weight saves a pass over the
        # weight (read 1 byte, write 2, read 2 for the product, against 9 bytes a weight when the scaled copy is
        # written too), which is what a decode step's time is made of.
        out = torch.nn.functional.linear(x, self.weight.to(x.dtype))
        out = out * self.weight_scale.reshape(-1).to(x.dtype)
        return out if bias is None else out + bias


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, fp32 [out, 1] scale)``: each row scaled so its largest magnitude is fp8's largest value."""
    absmax = weight.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    return (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def use_fp8_linears(model: torch.nn.Module) -> list[str]:
    """Replace the decoder linears of ``model`` (built on the meta device) by ``Fp8Linear``s; their weight names."""
    names = []
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and DECODER_LINEAR.match(f"{name}.weight"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Fp8Linear(module.in_features, module.out_features,
                                                                  module.bias is not None, device="meta"))
            names.append(f"{name}.weight")
    return names


def holds_fp8(model: torch.nn.Module) -> bool:
    """Whether ``model`` has fp8 linears (asked for, or read from a file in core's fp8 layout): what runs it may
    depend on it (a compiler that cannot cast fp8)."""
    return any(isinstance(module, Fp8Linear) for module in model.modules())


def linear_bytes(model: torch.nn.Module) -> int:
    """The bytes the decoder linears' weights hold (fp8 or not; stacked gate and up ones too), for the reports that
    compare them with bf16."""
    return sum(t.nelement() * t.element_size() for name, t in model.named_parameters()
               if DECODER_LINEAR.match(name) or FUSED_LINEAR.match(name))
