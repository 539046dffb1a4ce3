"""The PE's stacked gate/up projections compute what transformers' MLP computes, on the tiny real PE."""

from __future__ import annotations

import torch

from comfyui_ernie_image.nodes.pe.local.enhancer import LocalPromptEnhancer
from comfyui_ernie_image.nodes.pe.local.fused import FusedGatedMLP, fuse_mlp_projections
from comfyui_ernie_image.nodes.pe.local.weights import snapshot_source
from comfyui_ernie_image.nodes.pe.protocol import PromptSpec, SamplingParams
from comfyui_ernie_image.nodes.pe.runtime import Runtime


@torch.inference_mode()
def test_fusing_keeps_the_logits_and_the_parameter_count(tiny_models):
    model, _ = snapshot_source(tiny_models["snapshot"]).load(torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    before = model(input_ids=ids).logits
    count = sum(p.numel() for p in model.parameters())
    up = model.model.layers[0].mlp.up_proj.weight.clone()

    assert fuse_mlp_projections(model) == model.config.num_hidden_layers
    after = model(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in model.parameters()) == count  # the old gate/up weights are gone
    assert torch.equal(model.model.layers[0].mlp.gate_up_proj.weight[up.shape[0]:], up)  # gate rows, then up
    assert fuse_mlp_projections(model) == 0  # a second call changes nothing


def test_the_local_enhancer_decodes_on_the_fused_layers(tiny_models):
    pe = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], decode="static", runtime=Runtime())
    pe.enhance([PromptSpec("a cat", 1024, 1024)], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert all(isinstance(layer.mlp, FusedGatedMLP) for layer in pe._model.model.layers)
