"""A GGUF DiT (``nodes/dit/gguf.py``, ``nodes/host/gguf_layers.py``): its linear layers keep the file's blocks (bytes
measured), it samples as the same DiT built from ``gguf.quants.dequantize``'s weights, core's partial loading streams
its layers, and a LoRA on it equals the LoRA merged into those weights. Through the pack's MODEL and ComfyUI's own
sampler (``comfy.sample.sample_custom``), on the CPU; ``meta`` stands in for the GPU where only placement counts."""

from __future__ import annotations

import math

import pytest
import torch

from comfyui_ernie_image.nodes.dit.build import build_diffusion_model
from comfyui_ernie_image.nodes.dit.gguf import load_gguf_dit
from comfyui_ernie_image.nodes.dit.model import make_model_patcher
from comfyui_ernie_image.nodes.host.gguf_layers import GGUFModelPatcher, weight_shapes
from comfyui_ernie_image.nodes.host.sizes import module_bytes
from comfyui_ernie_image.nodes.lora.patching import apply_lora
from helpers import lora as lora_helpers
from helpers.accel import predict, sample
from helpers.gguf_files import gguf_bytes, reference_state
from scripts.gguf_writer import mixed_kind, uniform_kind, write_gguf
from scripts.tiny_models import TINY_DIT, tiny_dit_state, write_gguf_dit

CPU, GPU = torch.device("cpu"), torch.device("meta")
# The other types ComfyUI-GGUF reads, in one file to keep the tests quick: the legacy types quantized by the gguf
# package, Q2_K and IQ4 as random valid blocks; the patch embedding (decoded at load) Q4_0.
OTHERS = {"to_q": "Q4_0", "to_k": "Q4_1", "to_v": "Q5_0", "to_out": "Q5_1", "gate_proj": "IQ4_NL",
          "up_proj": "IQ4_XS", "linear_fc2": "Q2_K", "adaLN_modulation": "Q5_1", "final_linear": "IQ4_NL"}
FILES = {"Q8_0": uniform_kind("Q8_0"), "Q4_K_M": mixed_kind, "Q5_K": uniform_kind("Q5_K"), "Q3_K": uniform_kind("Q3_K"),
         "legacy_IQ4_Q2_K": lambda name, value: mixed_kind(name, value, OTHERS, "Q4_0")}
HELD_TYPES = {"Q8_0": {"Q8_0"}, "Q4_K_M": {"Q4_K", "Q5_K", "Q6_K"}, "Q5_K": {"Q5_K"}, "Q3_K": {"Q3_K"},
              "legacy_IQ4_Q2_K": {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q2_K"}}


@pytest.fixture(scope="module", params=list(FILES))
def gguf_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / f"ernie-image-tiny-{request.param}.gguf"
    return write_gguf(path, tiny_dit_state(), FILES[request.param])


def _gguf_model(path):
    return make_model_patcher(load_gguf_dit(path, torch.float32))


def _reference_model(path):
    """The same DiT built from the weights the gguf package reads back (dequantized), as plain float32 layers."""
    return make_model_patcher(build_diffusion_model(reference_state(path), TINY_DIT, torch.float32))


def _held_blocks(dit) -> dict[str, tuple[str, int]]:
    return {f"{name}.weight": (m.gguf_type, m.weight.nbytes) for name, m in dit.named_modules()
            if getattr(m, "gguf_type", None)}


def test_the_linear_layers_keep_the_files_blocks(gguf_file):
    patcher = _gguf_model(gguf_file)
    dit = patcher.model.diffusion_model
    assert isinstance(patcher, GGUFModelPatcher)
    in_file = gguf_bytes(gguf_file)
    held = _held_blocks(dit)
    quantized = {k: v for k, v in in_file.items() if v[0] not in ("F32", "F16", "BF16")}
    # Every quantized linear weight is held as its blocks, byte for byte the file's; the patch embedding (a conv)
    # is decoded at load.
    assert held == {k: v for k, v in quantized.items() if k != "x_embedder.proj.weight"}
    assert {kind for kind, _ in held.values()} == HELD_TYPES[gguf_file.stem[17:]]
    assert all(p.device == CPU for p in dit.parameters())
    shapes = weight_shapes(dit)
    assert shapes["layers.0.mlp.gate_proj.weight"] == (128, 64)
    blocks, blocks_bf16 = sum(n for _, n in held.values()), 2 * sum(math.prod(shapes[k]) for k in held)
    total_bf16 = 2 * sum(math.prod(s) for s in shapes.values())
    print(f"{gguf_file.name}: the {len(held)} GGUF layers hold {blocks} bytes ({blocks_bf16} in bf16, "
          f"{blocks / blocks_bf16:.3f}); the DiT {module_bytes(dit)} bytes (the rest float32; {total_bf16} in bf16)")
    assert blocks / blocks_bf16 <= {"Q8_0": 34 / 64, "Q4_K_M": 210 / 512, "Q5_K": 176 / 512, "Q3_K": 110 / 512,
                                  "legacy_IQ4_Q2_K": 24 / 64}[gguf_file.stem[17:]]
    assert patcher.model_size() == module_bytes(patcher.model)  # what core plans its loads with: the same bytes


def test_it_samples_as_the_dit_built_from_the_dequantized_weights(gguf_file):
    gguf_latent = sample(_gguf_model(gguf_file), steps=4)
    reference = sample(_reference_model(gguf_file), steps=4)
    error = (gguf_latent - reference).abs().max().item()
    print(f"{gguf_file.name}: max |GGUF - dequantized reference| = {error:.3g} over {reference.numel()} values")
    assert torch.isfinite(reference).all() and reference.abs().max() > 0.1
    torch.testing.assert_close(gguf_latent, reference, rtol=1e-5, atol=1e-5)


def test_a_partial_load_streams_layers_and_predicts_as_the_whole_load(gguf_file):
    part = _gguf_model(gguf_file)
    part.load(GPU, lowvram_model_memory=part.model_size() // 3)
    held = {name: m for name, m in part.model.diffusion_model.named_modules() if getattr(m, "gguf_type", None)}
    left = [name for name, m in held.items() if m.weight.device == CPU]
    print(f"{gguf_file.name}: {len(left)} of {len(held)} GGUF layers left on the CPU, streamed per call")
    assert 0 < len(left) < len(held) and part.model.model_lowvram
    assert all(held[name].comfy_cast_weights for name in left)

    whole, part = _gguf_model(gguf_file), _gguf_model(gguf_file)
    whole.load(CPU, full_load=True)
    part.load(CPU, lowvram_model_memory=part.model_size() // 3)
    streamed = [m for m in part.model.diffusion_model.modules() if getattr(m, "gguf_type", None)
                and m.comfy_cast_weights]
    assert streamed and part.model.model_lowvram
    error = (predict(part) - predict(whole)).abs().max().item()
    print(f"{gguf_file.name}: max |partial - whole| = {error:.3g}")
    assert error <= 1 / 255


def _lora_file(layers=lora_helpers.LAYERS, seed=1):
    deltas = lora_helpers.deltas(layers, seed)
    return deltas, lora_helpers.lora_file("ai-toolkit", deltas)


def _merged_reference(path, deltas, strength):
    state = reference_state(path)
    for layer, (down, up) in deltas.items():
        state[f"{layer}.weight"] = state[f"{layer}.weight"] + strength * (up @ down)
    return make_model_patcher(build_diffusion_model(state, TINY_DIT, torch.float32))


def test_a_lora_equals_the_lora_merged_into_the_dequantized_weights(gguf_file):
    deltas, lora = _lora_file()
    plain = _gguf_model(gguf_file)
    patched, report = apply_lora(plain, lora, 0.7, "tiny.safetensors")
    assert report.applied == len(deltas) and report.misfits == 0, report.text()  # the true shapes, not the blocks'
    latent = sample(patched, steps=4)
    reference = sample(_merged_reference(gguf_file, deltas, 0.7), steps=4)
    error = (latent - reference).abs().max().item()
    print(f"{gguf_file.name}: max |GGUF + LoRA - merged| = {error:.3g}")
    torch.testing.assert_close(latent, reference, rtol=1e-4, atol=1e-5)
    blocks = {name: m.weight.data_ptr() for name, m in plain.model.diffusion_model.named_modules()
              if getattr(m, "gguf_type", None)}
    assert {n: m.weight.data_ptr() for n, m in plain.model.diffusion_model.named_modules()
            if getattr(m, "gguf_type", None)} == blocks, "the blocks were rewritten"


def test_a_lora_on_streamed_layers_and_its_removal(gguf_file):
    """Streamed layers take core's LowVramPatch, loaded ones the patcher's patches; unpatching takes both off.
    Core loads the layers it plans the most memory for first, and it plans LoRA layers larger: a LoRA on many layers
    leaves some of them loaded and some streamed."""
    layers = tuple(f"layers.{i}.{name}" for i in range(TINY_DIT["num_layers"])
                   for name in ("self_attention.to_q", "mlp.up_proj"))
    deltas, lora = _lora_file(layers, seed=2)
    base = _gguf_model(gguf_file)
    before = predict(base)
    patched, _ = apply_lora(base, lora, 1.0, "tiny.safetensors")
    patched.load(CPU, lowvram_model_memory=patched.model_size() // 3)
    assert patched.model.lowvram_patch_counter > 0, "no LoRA layer was streamed: the test needs a smaller share"
    assert any(patched.backup), "no LoRA layer was loaded whole"
    merged = _merged_reference(gguf_file, deltas, 1.0)
    with_lora = predict(patched)
    assert (with_lora - before).abs().max() > 1e-3, "the LoRA changed nothing"
    error = (with_lora - predict(merged)).abs().max().item()
    print(f"{gguf_file.name}: {patched.model.lowvram_patch_counter} streamed LoRA layers, "
          f"{len(patched.backup)} loaded; max |GGUF + LoRA - merged| = {error:.3g}")
    assert error < 1e-4
    patched.unpatch_model(CPU)
    torch.testing.assert_close(predict(base), before, rtol=0, atol=0)


def test_compiled_it_samples_as_eager(tmp_path):
    """The GGUF layers under the pack's regional compile (where the whole DiT is on the GPU the loader compiles it
    by default): the decode is traced with the block. One file, of mixed types (Q4_K, Q6_K, F32). With a LoRA:
    ``test_lora_gguf_compiled``."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from comfyui_ernie_image.nodes.accel.patching import apply_compile

    torch._dynamo.reset()
    path = write_gguf_dit(tmp_path / "ernie-image-tiny-Q4_K_M.gguf")
    plain, turbo = _gguf_model(path), dict(steps=2, cfg=1.0)
    eager = sample(plain, **turbo)
    torch.testing.assert_close(sample(apply_compile(plain, "default"), **turbo), eager, rtol=1e-4, atol=1e-4)
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"


def test_the_out_of_memory_advice_offers_gguf_to_a_plain_dit_only(tmp_path):
    """``memory_choices`` (what the advice reads): a bf16 DiT whose block rows are whole 256-value blocks, as the
    released one's, would save its block bytes less Q4_K_M's 176 per 256 values; a GGUF DiT saves nothing more."""
    from diffusers import ErnieImageTransformer2DModel

    from comfyui_ernie_image.nodes.memory_advice import q4_k_m_bytes

    config = dict(hidden_size=256, num_attention_heads=2, num_layers=2, ffn_hidden_size=512, in_channels=128,
                  out_channels=128, text_in_dim=512, rope_axes_dim=(32, 48, 48))
    torch.manual_seed(0)
    state = {k: v.to(torch.bfloat16) for k, v in ErnieImageTransformer2DModel(**config).state_dict().items()}
    plain = make_model_patcher(build_diffusion_model(state, config, torch.bfloat16)).model
    blocks = [m.weight for name, m in plain.diffusion_model.named_modules()
              if isinstance(m, torch.nn.Linear) and name.startswith("layers.")]
    expected = sum(w.nbytes - q4_k_m_bytes(w) for w in blocks)
    assert plain.memory_choices().gguf_saving == expected > 0.6 * sum(w.nbytes for w in blocks)
    path = write_gguf(tmp_path / "ernie-image-tiny-Q4_K_M.gguf", tiny_dit_state(), mixed_kind)
    assert _gguf_model(path).model.memory_choices().gguf_saving == 0
