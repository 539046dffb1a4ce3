"""A LoRA on a GGUF DiT without the slowdown (``nodes/host/gguf_layers.py``): core's plain LoRA on a GGUF layer is
held as its factors beside the blocks, on the device the layer loads to, added to the layer's output (as PEFT's
unmerged layer does) within core's own distance from the exact result, with its scale a tensor: the pack's compile
traces those blocks, and a new strength or another LoRA of the same ranks compiles nothing. The factors count in the
patcher's size, whole or partial loads. Through the pack's MODEL, its LoRA node's patching and ComfyUI 0.3.75's own
patcher and sampler, on the CPU; ``meta`` stands in for the GPU where only placement counts."""

from __future__ import annotations

import logging
import re

import comfy.lora
import comfy.model_management
import pytest
import torch
import torch.nn.functional as F

from comfyui_ernie_image.nodes.dit.gguf import load_gguf_dit
from comfyui_ernie_image.nodes.dit.model import make_model_patcher
from comfyui_ernie_image.nodes.gguf.dequant import dequantize
from comfyui_ernie_image.nodes.lora.patching import apply_lora
from helpers import lora as lora_helpers
from helpers.accel import predict, sample
from scripts.tiny_models import TINY_DIT, write_gguf_dit

CPU, GPU = torch.device("cpu"), torch.device("meta")
BLOCKS = TINY_DIT["num_layers"]
EVERY_BLOCK = tuple(f"layers.{i}.{name}" for i in range(BLOCKS) for name in ("self_attention.to_q", "mlp.up_proj"))
TURBO = dict(steps=2, cfg=1.0)


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    return write_gguf_dit(tmp_path_factory.mktemp("gguf") / "ernie-image-tiny-Q4_K_M.gguf")


def _gguf_model(path):
    return make_model_patcher(load_gguf_dit(path, torch.float32))


def _lora(layers: tuple[str, ...], seed: int, layout: str = "ai-toolkit") -> tuple[dict, dict]:
    deltas = lora_helpers.deltas(layers, seed)
    return deltas, lora_helpers.lora_file(layout, deltas)


def _loha(layer: str, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """A LoHa on one layer: an adapter that stays with core's ``calculate_weight`` at each call."""
    generator = torch.Generator().manual_seed(9)
    shapes = dict(hada_w1_a=(rows, 4), hada_w1_b=(4, cols), hada_w2_a=(rows, 4), hada_w2_b=(4, cols))
    return {f"diffusion_model.{layer}.{k}": torch.randn(*s, generator=generator) * 0.3 for k, s in shapes.items()}


def _patched_layers(patcher) -> dict[str, torch.nn.Module]:
    dit = patcher.model.diffusion_model
    return {key: dit.get_submodule(key.removeprefix("diffusion_model.").removesuffix(".weight"))
            for key in patcher.patches}


def _assert_as_cores(layer, patches: list, key: str, dtype: torch.dtype) -> None:
    """The layer's output for a random input in ``dtype`` is as close to the exact one (core's formula in float64)
    as core's is (``calculate_weight`` merged into the decoded weight in ``dtype``, then the product): within twice
    core's error, or four roundings of the largest output where core happens to be closer. Core rounds the merged
    weight to ``dtype``; the layer adds the LoRA's two narrow products to its output, as PEFT does."""
    x = torch.randn(5, layer.gguf_shape[1], generator=torch.Generator().manual_seed(3)).to(dtype)
    blocks = layer.weight.data

    def merged(weight_dtype: torch.dtype) -> torch.Tensor:
        decoded = dequantize(blocks, layer.gguf_type, layer.gguf_shape, weight_dtype)
        return comfy.lora.calculate_weight(patches, decoded, key)

    bias = None if layer.bias is None else layer.bias.double()
    exact = F.linear(x.double(), merged(torch.float64), bias)
    ours = layer(x)
    cores_error = (F.linear(x, merged(dtype), None if bias is None else layer.bias.to(dtype)).double() - exact)
    limit = max(2 * cores_error.abs().max().item(), 4 * torch.finfo(dtype).eps * exact.abs().max().item())
    error = (ours.double() - exact).abs().max().item()
    assert ours.dtype == dtype and torch.isfinite(ours).all() and error <= limit, (key, dtype, error, limit)


def test_a_plain_lora_adds_to_each_layers_output_what_cores_calculate_weight_adds_to_its_weight(gguf_path):
    """Two LoRAs stacked (kohya's with an alpha, at -1.3; ai-toolkit's at 0.7) on every block: each layer's output
    is as close to the output of core's ``calculate_weight`` merge (exact, in float64) as core's own merge in the
    dtype is, in float32 and in bf16, and the layer does not call core per call. Unpatching gives back the DiT's
    outputs exactly."""
    plain = _gguf_model(gguf_path)
    before = predict(plain)
    _, first = _lora(EVERY_BLOCK, seed=1, layout="kohya")
    _, second = _lora(EVERY_BLOCK[::3], seed=2)
    patched = apply_lora(apply_lora(plain, first, -1.3, "first")[0], second, 0.7, "second")[0]
    patched.patch_model()  # core loads it whole (on the CPU here)
    try:
        layers = _patched_layers(patched)
        assert len(layers) == len(EVERY_BLOCK)
        assert not any(layer.patches_per_call for layer in layers.values()), "core's calculate_weight runs per call"
        for key, layer in layers.items():
            for dtype in (torch.float32, torch.bfloat16):
                _assert_as_cores(layer, patched.patches[key], key, dtype)
        assert (predict(patched) - before).abs().max() > 1e-2, "the LoRA changed nothing"
    finally:
        patched.unpatch_model(CPU)
    torch.testing.assert_close(predict(plain), before, rtol=0, atol=0)


def test_in_half_precision_a_large_up_factor_with_a_small_change_stays_finite(gguf_path):
    """A LoRA whose ``up`` holds numbers past half precision's range (2e5) and whose ``down`` is tiny (1e-6), so that
    its change is small (the LoRA node lets it through): in fp16 the layer still adds what core adds, finite (the
    LoRA's products in float32 there), where the scale folded into ``up`` in fp16 would be infinite and ``down``'s
    product would underflow. A guard: core's merge (its product in float32) passes it too."""
    plain = _gguf_model(gguf_path)
    deltas = {layer: (down * 1e-6, up * 2e5) for layer, (down, up) in lora_helpers.deltas(EVERY_BLOCK[:2], 5).items()}
    patched = apply_lora(plain, lora_helpers.lora_file("ai-toolkit", deltas), 1.0, "wide")[0]
    patched.patch_model()
    try:
        for key, layer in _patched_layers(patched).items():
            _assert_as_cores(layer, patched.patches[key], key, torch.float16)
    finally:
        patched.unpatch_model(CPU)


def test_other_adapters_stay_with_cores_calculate_weight_at_each_call(gguf_path):
    """A LoHa stacked on a LoRA in one layer: that layer goes through ``calculate_weight`` (as today, exactly), the
    others take the factors."""
    plain = _gguf_model(gguf_path)
    _, lora = _lora(EVERY_BLOCK, seed=1)
    patched = apply_lora(apply_lora(plain, lora, 0.5, "lora")[0], _loha("layers.0.mlp.up_proj", 128, 64), 1.0,
                         "loha")[0]
    patched.patch_model()
    try:
        layers = _patched_layers(patched)
        per_call = {key for key, layer in layers.items() if layer.patches_per_call}
        assert per_call == {"diffusion_model.layers.0.mlp.up_proj.weight"}
        for key, layer in layers.items():
            if key in per_call:
                decoded = dequantize(layer.weight.data, layer.gguf_type, layer.gguf_shape, torch.float32)
                cores = comfy.lora.calculate_weight(patched.patches[key], decoded, key)
                assert torch.equal(layer.decoded_weight(torch.float32, CPU), cores)
            else:
                _assert_as_cores(layer, patched.patches[key], key, torch.float32)
    finally:
        patched.unpatch_model(CPU)


def test_the_patchers_size_counts_the_lora_factors_in_whole_and_partial_loads(gguf_path):
    """What core plans a load with (``model_size()``, through ``LoadedModel``) is the blocks plus the factors' bytes,
    once for a clone too; a whole load puts the factors on the load device and counts them loaded; a partial load
    counts those of the layers it loads, and leaves the streamed layers' LoRA to core's ``LowVramPatch``, as today."""
    plain = _gguf_model(gguf_path)
    weights = plain.model_size()
    deltas, lora = _lora(EVERY_BLOCK, seed=3)
    patched = apply_lora(plain, lora, 0.8, "tiny")[0]
    factor_bytes = sum(down.nbytes + up.nbytes for down, up in deltas.values())
    assert comfy.model_management.LoadedModel(patched).model_memory() == weights + factor_bytes
    assert patched.model_size() == weights + factor_bytes == patched.clone().model_size()
    assert plain.model_size() == weights

    from comfyui_ernie_image.nodes.host.gguf_layers import FACTORS, lora_patch_bytes

    assert lora_patch_bytes(plain) == 0 and lora_patch_bytes(patched) == factor_bytes > 0

    patched.load(GPU, full_load=True)
    layers = _patched_layers(patched)
    assert all(t.device == GPU for layer in layers.values() for f in getattr(layer.weight, FACTORS) for t in f)
    assert patched.model.model_loaded_weight_memory == weights + factor_bytes
    patched.unpatch_model()  # (``meta`` holds no numbers to move back)
    assert not any(hasattr(layer.weight, FACTORS) for layer in layers.values()), "unpatching left factors behind"

    patched = apply_lora(_gguf_model(gguf_path), lora, 0.8, "tiny")[0]
    patched.load(GPU, lowvram_model_memory=weights // 3)
    layers = _patched_layers(patched)
    loaded = {key for key, layer in layers.items() if layer.weight.device == GPU}
    assert 0 < len(loaded) < len(layers) and patched.model.model_lowvram
    assert all(layers[key].weight_function for key in layers.keys() - loaded)  # core's LowVramPatch
    on_device = sum(t.nbytes for t in patched.model.state_dict().values() if t.device == GPU)
    loaded_factors = sum(t.nbytes for key in loaded for f in getattr(layers[key].weight, FACTORS) for t in f[:2])
    print(f"partial load: {len(loaded)} of {len(layers)} LoRA layers loaded, {on_device} bytes of weights and "
          f"{loaded_factors} of factors on the device")
    assert patched.model.model_loaded_weight_memory == on_device + loaded_factors


def test_blocks_with_a_lora_compile_and_a_new_strength_or_lora_compiles_nothing(gguf_path, caplog):
    """The pack's regional compile (inductor on the CPU): with a LoRA on every block, every block compiles, into one
    graph; another strength and another LoRA of the same ranks reuse it, and each gives what the eager DiT gives. A
    block with a LoHa besides runs eager, the others still compiled. (The plain DiT compiled: ``test_gguf_dit``.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from comfyui_ernie_image.nodes.accel.patching import apply_compile

    def compiled_sample(model) -> tuple[torch.Tensor, list[str]]:
        """The image and the log's lines on compiling: how many blocks, then how long new graphs took, if any."""
        with caplog.at_level(logging.INFO, logger="comfyui_ernie_image.nodes.accel.patching"):
            caplog.clear()
            return sample(apply_compile(model, "default"), **TURBO), [m for m in caplog.messages if "compiled" in m]

    torch._dynamo.reset()
    counters.clear()  # dynamo's counts are the process's: earlier tests' graphs are not this test's
    plain = _gguf_model(gguf_path)
    layers = tuple(f"layers.{i}.mlp.up_proj" for i in range(BLOCKS))
    results, graphs = [], []
    for seed, strength in ((1, 0.7), (1, 0.3), (4, 0.7)):
        patched = apply_lora(plain, _lora(layers, seed)[1], strength, "tiny")[0]
        compiled, said = compiled_sample(patched)
        assert said[0] == f"ERNIE-Image: compiled {BLOCKS} of {BLOCKS} DiT blocks"
        if not results:  # the first run waits for the compiler and says how long; the others compile nothing
            assert len(said) == 2 and re.fullmatch(r"ERNIE-Image: this sampling run compiled 1 new graph\(s\) of "
                                                   r"the DiT's blocks and took \d+\.\d s with them \(.*\)", said[1])
        else:
            assert said[1:] == []
        torch.testing.assert_close(compiled, sample(patched, **TURBO), rtol=1e-4, atol=1e-5)
        results.append(compiled)
        graphs.append(counters["stats"]["unique_graphs"])
    print(f"unique graphs after the LoRA at 0.7, at 0.3, another LoRA at 0.7: {graphs}")
    assert graphs == [1, 1, 1], "a LoRA's strength or factors were compiled into a graph"
    assert (results[0] - results[1]).abs().max() > 1e-3 and (results[0] - results[2]).abs().max() > 1e-3

    with_loha = apply_lora(patched, _loha("layers.0.mlp.up_proj", 128, 64), 1.0, "loha")[0]
    compiled, said = compiled_sample(with_loha)
    assert len(said) == 1 and said[0].startswith(f"ERNIE-Image: compiled {BLOCKS - 1} of {BLOCKS} DiT blocks")
    torch.testing.assert_close(compiled, sample(with_loha, **TURBO), rtol=1e-4, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
