"""Regional compile of a DiT that ComfyUI loaded in part (a card too small for it), on the CPU.

Core's partial loading leaves some layers' weights off the GPU and casts them at each call, flagging those layers
with instance attributes. Compiled, each pattern of flags was a graph of its own, compiled again whenever a prompt
loaded a different part. ``meta`` stands in for the GPU where only the placement is checked.
"""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from comfyui_ernie_image.nodes.accel.compile import RegionalCompile, compile_settings, streams_weights
from helpers.accel import text, tiny_patcher

CPU, GPU = torch.device("cpu"), torch.device("meta")


def _load(patcher, share: float) -> None:
    """Load the DiT onto the CPU as core does with ``share`` of its size free (1: whole)."""
    patcher.unpatch_model(CPU)
    patcher.load(CPU, lowvram_model_memory=int(patcher.model_size() * share), full_load=share == 1)


def _predict(patcher, compiled: bool) -> tuple[torch.Tensor, int]:
    """One forward (blocks compiled or eager) and the number of graphs dynamo compiled for it."""
    layers, before = patcher.model.diffusion_model.layers, counters["stats"]["unique_graphs"]
    regional = RegionalCompile(layers, device=CPU)
    torch.manual_seed(5)
    x, prompt = torch.randn(1, 128, 4, 4), text(6, 1)
    try:
        if compiled:
            regional.install()
        with torch.inference_mode(), compile_settings():
            out = patcher.model.diffusion_model(x, torch.tensor([500.0]), prompt, [6])
    finally:
        regional.remove()
    return out, counters["stats"]["unique_graphs"] - before


def test_blocks_whose_weights_stream_run_eager_and_the_rest_compiled(tiny_models):
    patcher = tiny_patcher(tiny_models["snapshot"])
    patcher.load(GPU, lowvram_model_memory=int(patcher.model_size() * 0.9))
    layers = patcher.model.diffusion_model.layers
    streaming = [streams_weights(block, GPU) for block in layers]
    assert any(streaming), "the partial load kept every block whole: the test needs a smaller share"
    state = [{k: id(v) for k, v in vars(m).items()} for m in layers.modules()]
    regional = RegionalCompile(layers, device=GPU)
    regional.install()
    assert ["_compiled_call_impl" not in vars(block) for block in layers] == streaming
    regional.remove()
    assert [{k: id(v) for k, v in vars(m).items()} for m in layers.modules()] == state, "the run left a trace"


def test_a_switch_core_sets_during_the_run_stays(tiny_models):
    """Core may stream a layer in the middle of a run (it then sets the layer's switch): removing the compiled
    blocks keeps core's setting."""
    layers = tiny_patcher(tiny_models["snapshot"]).model.diffusion_model.layers
    layer = layers[0].mlp.up_proj
    assert "comfy_cast_weights" not in vars(layer)
    regional = RegionalCompile(layers, device=CPU)
    regional.install()
    assert vars(layer)["comfy_cast_weights"] is False and vars(layer)["weight_function"] == []
    layer.comfy_cast_weights = True
    layer.weight_function.append(print)  # a per-call patch, in the list the run pinned
    regional.remove()
    assert vars(layer)["comfy_cast_weights"] is True and vars(layer)["weight_function"] == [print]
    assert type(layer).weight_function == [], "the class's shared list changed"


def test_a_device_named_without_its_index_holds_the_blocks_on_it(tiny_models):
    """ComfyUI may name the load device ``cuda`` while the weights are on ``cuda:0``: they are on it."""
    block = tiny_patcher(tiny_models["snapshot"]).model.diffusion_model.layers[0]
    assert not streams_weights(block, torch.device("cpu", 0))
    assert streams_weights(block, GPU)


def test_a_whole_load_after_a_partial_one_reuses_the_first_graph(tiny_models):
    """A prompt that loads the DiT whole again (the text encoder unloaded) compiles nothing new, although core's
    partial load left its flags on the layers; and the partially loaded DiT predicts the same compiled or not."""
    torch._dynamo.reset()
    patcher = tiny_patcher(tiny_models["snapshot"])
    _load(patcher, 1)
    whole, first_graphs = _predict(patcher, compiled=True)
    assert first_graphs == 1
    _load(patcher, 1 / 3)
    torch.testing.assert_close(_predict(patcher, compiled=True)[0], _predict(patcher, compiled=False)[0])
    _load(patcher, 1)
    again, graphs = _predict(patcher, compiled=True)
    assert graphs == 0, "the whole DiT compiled again after a partial load"
    torch.testing.assert_close(again, whole)
