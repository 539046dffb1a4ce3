"""One matrix product for the gate and up projections of each PE layer's MLP (engine; plain torch, no ComfyUI).

Why: a batch-1 decode step is memory-bound, one matrix-vector product per weight matrix, and cuBLAS runs the PE's
(9216 x 3072) products as split-K kernels plus a reduce kernel each, streaming the weights at about half the GPU's
bandwidth. The gate and up matrices are half of the PE's weights and read the same input, so stacking them into one
(18432 x 3072) matrix halves those launches and reductions and gives cuBLAS a larger product (measured in
``bench/RESULTS.md``). The output is the same up to summation order.

The weights are stacked after loading, in place: the loaded state dict keeps transformers' names, and nothing
saves the fused model. Layers without separate gate and up projections are left alone.

fp8 weights (``fp8_linear.Fp8Linear``) stack too, as they are: the fp8 rows one after the other and their scales as
one per row (a per-tensor scale repeated over its rows), so the stacked layer dequantizes to exactly the two it
replaces and a decode step still makes one product for both.
"""

from __future__ import annotations

import torch
from torch import nn

from ...fp8_linear import Fp8Linear


class FusedGatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with ``gate`` and ``up`` stacked into ``gate_up_proj``."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        self.gate_up_proj = _stacked(gate, up)
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _stacked(gate: nn.Module, up: nn.Module) -> nn.Module:
    """One layer computing ``cat([gate(x), up(x)], -1)``: a ``Linear``, or an ``Fp8Linear`` for fp8 ones."""
    # Made on the meta device: no random initialisation of a matrix about to be overwritten.
    kind = Fp8Linear if isinstance(gate, Fp8Linear) else nn.Linear
    stacked = kind(gate.in_features, 2 * gate.out_features, bias=False, device="meta")
    with torch.no_grad():
        weight = torch.cat([gate.weight, up.weight])
        if kind is Fp8Linear:
            stacked.weight_scale = torch.cat([_row_scales(gate), _row_scales(up)])
    stacked.weight = nn.Parameter(weight, requires_grad=gate.weight.requires_grad)
    return stacked


def _row_scales(layer: Fp8Linear) -> torch.Tensor:
    """The layer's scale as one per row, ``[out, 1]``, whether it has one per tensor or per row."""
    return layer.weight_scale.reshape(-1, 1).expand(layer.out_features, 1)


def _fusable(mlp: nn.Module) -> bool:
    parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    linear = (nn.Linear, Fp8Linear)
    if not all(isinstance(p, linear) and p.bias is None for p in parts) or not hasattr(mlp, "act_fn"):
        return False
    # gate and up of one kind: stacked as they are stored (a down projection of either kind is kept as it is)
    same_kind = isinstance(parts[0], Fp8Linear) == isinstance(parts[1], Fp8Linear)
    return same_kind and parts[0].weight.shape == parts[1].weight.shape


def fuse_mlp_projections(model: nn.Module) -> int:
    """Replace every decoder layer's gated MLP of ``model`` (a transformers causal LM) by a ``FusedGatedMLP``;
    returns how many were fused (0 when called again)."""
    fused = 0
    for layer in model.model.layers:
        if _fusable(layer.mlp):
            layer.mlp = FusedGatedMLP(layer.mlp)  # the old gate/up weights go with the old module
            fused += 1
    return fused
