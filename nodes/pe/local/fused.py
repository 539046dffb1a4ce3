"""One matrix product for the gate and up projections of each PE layer's MLP (engine; plain torch, no ComfyUI).

Why: a batch-1 decode step is memory-bound, one matrix-vector product per weight matrix, and cuBLAS runs the PE's
(9216 x 3072) products as split-K kernels plus a reduce kernel each, streaming the weights at about half the GPU's
bandwidth. The gate and up matrices are half of the PE's weights and read the same input, so stacking them into one
(18432 x 3072) matrix halves those launches and reductions and gives cuBLAS a larger product (measured in
``bench/RESULTS.md``). The output is the same up to summation order.

The weights are stacked after loading, in place: the loaded state dict keeps transformers' names, and nothing
saves the fused model. Layers without separate gate and up projections are left alone.
"""

from __future__ import annotations

import torch
from torch import nn


class FusedGatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with ``gate`` and ``up`` stacked into ``gate_up_proj``."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        gate, up = mlp.gate_proj, mlp.up_proj
        # Made on the meta device: no random initialisation of a matrix about to be overwritten.
        self.gate_up_proj = nn.Linear(gate.in_features, 2 * gate.out_features, bias=False, device="meta")
        with torch.no_grad():
            stacked = torch.cat([gate.weight, up.weight])
        self.gate_up_proj.weight = nn.Parameter(stacked, requires_grad=gate.weight.requires_grad)
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _fusable(mlp: nn.Module) -> bool:
    parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) and p.bias is None for p in parts) or not hasattr(mlp, "act_fn"):
        return False
    return parts[0].weight.shape == parts[1].weight.shape


def fuse_mlp_projections(model: nn.Module) -> int:
    """Replace every decoder layer's gated MLP of ``model`` (a transformers causal LM) by a ``FusedGatedMLP``;
    returns how many were fused (0 when called again)."""
    fused = 0
    for layer in model.model.layers:
        if _fusable(layer.mlp):
            layer.mlp = FusedGatedMLP(layer.mlp)  # the old gate/up weights go with the old module
            fused += 1
    return fused
