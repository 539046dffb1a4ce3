"""LoRAs on the pack's MODEL in every layout found in the wild, against the same deltas merged into the weights.

Each LoRA is written by the test in its layout's real key pattern; sampling is ComfyUI's own (``comfy.sample``) on
the tiny DiT, and a merged reference is the same DiT with ``strength · scale · up @ down`` added to its weights.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import comfy.sd
import pytest
import torch
from safetensors.torch import save_file

from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.lora.patching import apply_lora
from helpers.accel import sample, tiny_patcher
from helpers.lora import ALPHA, BLOCK_LINEARS, LAYERS, LAYOUTS, OTHER_LAYERS, RANK, deltas, lora_file, merged, rewrite
from helpers.parses import count_header_parses
from helpers.reference import max_level_difference, reference_image, saved_image
from helpers.workflows import text_to_image


@pytest.fixture(scope="module")
def plain_latent(tiny_models):
    return sample(tiny_patcher(tiny_models["snapshot"]))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_each_layout_equals_its_deltas_merged(tiny_models, layout, strength, plain_latent):
    lora = deltas(LAYERS, seed=1)
    patched, report = apply_lora(tiny_patcher(tiny_models["snapshot"]), lora_file(layout, lora), strength, layout)
    assert (report.applied, report.dit_layers, report.text_encoder_layers) == (3, 3, 0)
    scale = ALPHA.get(layout, RANK) / RANK
    expected = sample(merged(tiny_models["snapshot"], (lora, strength, scale)))
    ours = sample(patched)
    assert (ours - plain_latent).abs().max() > 10 / 255  # the LoRA changes the result well past the tolerance
    torch.testing.assert_close(ours, expected, atol=1 / 255, rtol=0)


def test_strength_zero_is_no_lora_exactly(tiny_models, plain_latent):
    patched, _ = apply_lora(tiny_patcher(tiny_models["snapshot"]), lora_file("peft", deltas(LAYERS, 1)), 0.0, "x")
    assert torch.equal(sample(patched), plain_latent)


def test_two_stacked_loras_equal_both_merged_and_the_unpatched_model_is_untouched(tiny_models, plain_latent):
    first, second = deltas(LAYERS, seed=1), deltas(OTHER_LAYERS, seed=2)
    model = tiny_patcher(tiny_models["snapshot"])
    once, _ = apply_lora(model, lora_file("onetrainer", first), 0.7, "first")
    twice, _ = apply_lora(once, lora_file("kohya", second), 1.0, "second")
    expected = sample(merged(tiny_models["snapshot"], (first, 0.7, 2.0), (second, 1.0, 0.5)))
    torch.testing.assert_close(sample(twice), expected, atol=1 / 255, rtol=0)
    assert torch.equal(sample(model), plain_latent)  # the loader taken out of the graph: no patch left behind


@pytest.mark.parametrize("layout", ["ai-toolkit", "kohya"])
def test_cores_own_lora_loader_takes_comfyuis_and_kohyas_layouts(tiny_models, layout):
    """What core's LoraLoaderModelOnly runs (``comfy.sd.load_lora_for_models``), on the pack's MODEL."""
    lora = deltas(LAYERS, seed=3)
    patched, _ = comfy.sd.load_lora_for_models(tiny_patcher(tiny_models["snapshot"]), None, lora_file(layout, lora),
                                               1.0, 0.0)
    expected = sample(merged(tiny_models["snapshot"], (lora, 1.0, ALPHA.get(layout, RANK) / RANK)))
    torch.testing.assert_close(sample(patched), expected, atol=1 / 255, rtol=0)


@pytest.mark.parametrize("layout", ["peft", "peft-base-model", "onetrainer"])
def test_cores_own_lora_loader_applies_nothing_of_the_other_layouts(tiny_models, plain_latent, layout):
    """What the README says: these layouts need the pack's loader."""
    patched, _ = comfy.sd.load_lora_for_models(tiny_patcher(tiny_models["snapshot"]), None,
                                               lora_file(layout, deltas(LAYERS, seed=3)), 1.0, 0.0)
    assert not patched.patches
    assert torch.equal(sample(patched), plain_latent)


def test_a_foreign_lora_is_counted_and_named(tiny_models, plain_latent):
    flux = {f"diffusion_model.double_blocks.{i}.img_attn.qkv.lora_A.weight": torch.zeros(RANK, 64) for i in range(4)}
    flux |= {f"diffusion_model.double_blocks.{i}.img_attn.qkv.lora_B.weight": torch.zeros(192, RANK) for i in range(4)}
    flux |= {"lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(RANK, 64),
             "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(64, RANK)}
    patched, report = apply_lora(tiny_patcher(tiny_models["snapshot"]), flux, 1.0, "flux_style.safetensors")
    assert report.text() == (
        "LoRA flux_style.safetensors: applied 0 of its 4 diffusion-model layers; 1 text-encoder layers not applied "
        "(the pack's text encoder takes no LoRA). Few or none match ERNIE-Image: this LoRA looks made for Flux")
    assert torch.equal(sample(patched), plain_latent)


def test_a_quantized_dit_refuses_loras_with_what_to_do(tiny_models):
    from comfyui_ernie_image.nodes.host.patchers import WholeModelPatcher

    model = tiny_patcher(tiny_models["snapshot"])
    quantized = WholeModelPatcher(model.model, load_device=model.load_device, offload_device=model.offload_device)
    for apply in (lambda lora: apply_lora(quantized, lora, 1.0, "x"),
                  lambda lora: comfy.sd.load_lora_for_models(quantized, None, lora, 1.0, 0.0)):
        with pytest.raises(ErnieImageError, match=r"ErnieImageModel cannot take LoRA patches: its weights are "
                                                  r"quantized .* load it with quantization none \(weight_dtype "
                                                  r"fp8_e4m3fn halves its memory and takes LoRAs\)"):
            apply(lora_file("ai-toolkit", deltas(LAYERS, 1)))


def test_the_node_in_a_graph_applies_the_lora_and_says_so(comfy_server, tiny_models):
    loras = tiny_models["models_dir"] / "loras"
    loras.mkdir(exist_ok=True)
    save_file(lora_file("peft", deltas(LAYERS, seed=4)), loras / "ernie_style.safetensors")
    node = ("ErnieImageLoraLoader", {"lora_name": "ernie_style.safetensors", "strength_model": 1.0})
    graph = text_to_image(snapshot="ERNIE-Image-Turbo-tiny", prompt="a cat", steps=2, seed=3, prefix="lora",
                          model_nodes=(node,))
    result = comfy_server.run(graph)
    assert result.status == "success", result.messages
    assert len(comfy_server.output_images(result)) == 1
    assert "ERNIE-Image LoRA ernie_style.safetensors: applied 3 of its 3 diffusion-model layers" in comfy_server.log()


def test_a_lora_on_fp8_weights_lands_within_fp8_rounding_of_the_merged_weights(tiny_models):
    """fp8 storage (``weight_dtype`` fp8_e4m3fn) takes LoRAs: core patches the weights in fp32 and rounds them back.
    The result is far nearer the merged weights' than the same fp8 DiT without the LoRA is."""
    from comfyui_ernie_image.nodes.dit.build import load_dit
    from comfyui_ernie_image.nodes.dit.model import make_model_patcher

    def fp8_model():
        return make_model_patcher(load_dit(tiny_models["snapshot"], torch.float32, torch.float8_e4m3fn))

    def distance(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    lora = deltas(LAYERS, seed=5)
    patched, report = apply_lora(fp8_model(), lora_file("ai-toolkit", lora), 3.0, "style")
    expected = sample(merged(tiny_models["snapshot"], (lora, 3.0, 1.0)))
    assert report.applied == 3
    assert distance(sample(patched), expected) < 0.2 * distance(sample(fp8_model()), expected)


@pytest.mark.parametrize("layout", ["ai-toolkit", "peft"])
def test_the_graph_with_a_lora_matches_diffusers_load_lora_weights(comfy_server, tiny_models, layout):
    """Where diffusers takes the layout: its pipeline with ``load_lora_weights`` and the pack's graph with the LoRA
    loader give the same image (within one 8-bit level), and it is not the image without the LoRA."""
    loras = tiny_models["models_dir"] / "loras"
    loras.mkdir(exist_ok=True)
    path = loras / f"parity_{layout}.safetensors"
    save_file(lora_file(layout, deltas(LAYERS, seed=6)), path)
    settings = dict(prompt="a red cat on a blue mat", negative="dark", width=128, height=128, steps=3, cfg=4.0,
                    seed=7)
    node = ("ErnieImageLoraLoader", {"lora_name": path.name, "strength_model": 1.0})
    result = comfy_server.run(text_to_image(snapshot="ERNIE-Image-Turbo-tiny", prefix=f"lora_{layout}",
                                            model_nodes=(node,), **settings))
    assert result.status == "success", result.messages
    (png,) = comfy_server.output_images(result)
    image = saved_image(png)
    assert max_level_difference(image, reference_image(tiny_models["snapshot"], lora=path, **settings)) <= 1.0
    assert max_level_difference(image, reference_image(tiny_models["snapshot"], **settings)) > 4.0


def test_a_model_that_is_not_an_ernie_dit_is_named():
    class NotErnie:
        model = torch.nn.Module()

    words = (r"This MODEL \(Module\) is not an ERNIE-Image DiT: its diffusion model has no 'layers' block list\. "
             r"Connect the MODEL of an ERNIE-Image loader")
    with pytest.raises(ErnieImageError, match=words):
        apply_lora(NotErnie(), lora_file("peft", deltas(LAYERS, 1)), 1.0, "x")


def _adapter(kind: str, rows: int, cols: int, generator: torch.Generator) -> tuple[dict, Callable]:
    """One layer's tensors of a LyCORIS adapter (the suffixes after the layer's name) and the weight it makes of the
    layer's weight ``w``, by the adapter's own formula (written here, not taken from core)."""
    def rand(*shape):
        return torch.randn(*shape, generator=generator) * 0.5

    if kind == "loha":  # Hadamard product of two rank-4 products, scaled by alpha / rank
        w1a, w1b, w2a, w2b = rand(rows, RANK), rand(RANK, cols), rand(rows, RANK), rand(RANK, cols)
        tensors = dict(hada_w1_a=w1a, hada_w1_b=w1b, hada_w2_a=w2a, hada_w2_b=w2b, alpha=torch.tensor(2.0))
        return tensors, lambda w: w + (w1a @ w1b) * (w2a @ w2b) * (2.0 / RANK)
    if kind == "lokr":  # Kronecker product of two full factors (no alpha: scale 1)
        w1, w2 = rand(rows // 8, cols // 8), rand(8, 8)
        return dict(lokr_w1=w1, lokr_w2=w2), lambda w: w + torch.kron(w1, w2)
    # DoRA: the LoRA-updated weight's columns rescaled to the trained magnitudes (dora_scale [1, in])
    down, up, magnitude = rand(RANK, cols), rand(rows, RANK), rand(1, cols).abs() + 0.5
    tensors = {"lora_A.weight": down, "lora_B.weight": up, "dora_scale": magnitude}
    return tensors, lambda w: (w + up @ down) * magnitude / ((w + up @ down).norm(dim=0, keepdim=True)
                                                             + torch.finfo(w.dtype).eps)


@pytest.mark.parametrize("kind", ["loha", "lokr", "dora"])
def test_lycoris_adapters_and_dora_reach_cores_weight_adapters(tiny_models, plain_latent, kind):
    """LoHa, LoKr and DoRA tensors under the diffusers prefix (a layout core's own mapping misses) are applied by the
    pack's node through core's weight adapters: the result is each adapter's formula merged into the weights."""
    generator = torch.Generator().manual_seed(8)
    shapes = {"layers.0.self_attention.to_q": (64, 64), "layers.3.mlp.up_proj": (128, 64)}
    tensors, merges = {}, {}
    for layer, (rows, cols) in shapes.items():
        layer_tensors, merges[layer] = _adapter(kind, rows, cols, generator)
        tensors |= {f"transformer.{layer}.{suffix}": t for suffix, t in layer_tensors.items()}
    patched, report = apply_lora(tiny_patcher(tiny_models["snapshot"]), tensors, 1.0, kind)
    assert report.applied == 2
    reference = rewrite(tiny_patcher(tiny_models["snapshot"]), merges)
    parameters = dict(reference.model.diffusion_model.named_parameters())
    patched.patch_model()  # core merges the patches into the weights, as a load does
    try:
        weights = dict(patched.model.diffusion_model.named_parameters())
        for layer in shapes:
            torch.testing.assert_close(weights[f"{layer}.weight"], parameters[f"{layer}.weight"])
    finally:
        patched.unpatch_model()
    ours = sample(patched)
    assert (ours - plain_latent).abs().max() > 10 / 255
    torch.testing.assert_close(ours, sample(reference), atol=1 / 255, rtol=0)


def test_a_lora_one_column_too_wide_is_reported_as_applied_to_none_of_its_layers(comfy_server, placed):
    """Core takes such patches and, when the model loads, logs an ERROR line for each and leaves the weight alone:
    the node said "applied 70 of its 70 layers" over 70 ERROR lines. Now none is handed to core, the node says
    so, and the image is the one without the LoRA."""
    generator = torch.Generator().manual_seed(9)
    lora = {}
    for block in range(10):
        for layer, (rows, cols) in BLOCK_LINEARS.items():
            name = f"diffusion_model.layers.{block}.{layer}"
            lora[f"{name}.lora_A.weight"] = torch.randn(RANK, cols + 1, generator=generator)  # one column too many
            lora[f"{name}.lora_B.weight"] = torch.randn(rows, RANK, generator=generator)
    save_file(lora, placed("loras", "one_column_too_wide.safetensors"))
    settings = dict(snapshot="ERNIE-Image-Turbo-tiny", prompt="a cat", steps=2, seed=11)
    node = ("ErnieImageLoraLoader", {"lora_name": "one_column_too_wide.safetensors", "strength_model": 1.0})
    result, log = comfy_server.run_logged(text_to_image(prefix="lora_wide", model_nodes=(node,), **settings))
    assert result.status == "success", result.messages
    assert ("ERNIE-Image LoRA one_column_too_wide.safetensors: applied 0 of its 70 diffusion-model layers; 70 layers "
            "do not fit the DiT's shapes (first: diffusion_model.layers.0.mlp.gate_proj: the LoRA makes [128, 65], "
            "the weight is [128, 64]), so they are not applied") in log
    assert "ERROR lora" not in log
    without = comfy_server.run(text_to_image(prefix="lora_wide_none", **settings))
    (with_png,), (without_png,) = comfy_server.output_images(result), comfy_server.output_images(without)
    assert (saved_image(with_png) == saved_image(without_png)).all()


def _misfit(kind: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One layer's tensors of an adapter that does not fit ``layers.0.self_attention.to_q`` (64 × 64)."""
    def rand(*shape):
        return torch.randn(*shape, generator=generator)

    return {
        "lora, same numbers in another shape": {"lora_A.weight": rand(RANK, 128), "lora_B.weight": rand(32, RANK)},
        "lora, factors that do not multiply": {"lora_A.weight": rand(RANK + 1, 64), "lora_B.weight": rand(64, RANK)},
        "loha": dict(hada_w1_a=rand(64, RANK), hada_w1_b=rand(RANK, 65), hada_w2_a=rand(64, RANK),
                     hada_w2_b=rand(RANK, 65)),
        "lokr": dict(lokr_w1=rand(8, 8), lokr_w2=rand(8, 9)),
        "diff": {"diff": rand(64, 63)},
        "dora of another width": {"lora_A.weight": rand(RANK, 64), "lora_B.weight": rand(64, RANK),
                                  "dora_scale": rand(1, 65).abs()},
    }[kind]


@pytest.mark.parametrize("kind", ["lora, same numbers in another shape", "lora, factors that do not multiply",
                                  "loha", "lokr", "diff", "dora of another width"])
def test_an_adapter_whose_shapes_do_not_fit_is_not_applied_and_said(tiny_models, kind):
    """Per adapter kind, the shape core's formula makes against the weight's: core would reshape a patch of as many
    numbers in another shape into the weight (a silently different image), or log an ERROR and apply nothing; both
    were counted as applied."""
    layer, fitting = "transformer.layers.0.self_attention.to_q", "transformer.layers.5.self_attention.to_q"
    tensors = {f"{fitting}.lora_A.weight": torch.full((RANK, 64), 0.01),
               f"{fitting}.lora_B.weight": torch.full((64, RANK), 0.01)}
    tensors |= {f"{layer}.{suffix}": t for suffix, t in _misfit(kind, torch.Generator().manual_seed(10)).items()}
    patched, report = apply_lora(tiny_patcher(tiny_models["snapshot"]), tensors, 1.0, kind)
    assert (report.applied, report.misfits, report.dit_layers) == (1, 1, 2), report
    assert report.first_misfit.startswith(f"{layer}: ")
    assert "do not fit the DiT's shapes (first: transformer.layers.0.self_attention.to_q: " in report.text()
    assert list(patched.patches) == ["diffusion_model.layers.5.self_attention.to_q.weight"]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_lora_with_non_finite_values_is_refused_by_key(tiny_models, placed, value):
    """A NaN in a LoRA made a black image, with the LoRA reported as applied."""
    from comfyui_ernie_image.nodes.lora.nodes import ErnieImageLoraLoader

    tensors = lora_file("peft", deltas(LAYERS, seed=12))
    tensors["transformer.layers.3.mlp.up_proj.lora_B.weight"][5, 1] = value
    save_file(tensors, placed("loras", f"non_finite_{value}.safetensors"))
    with pytest.raises(ErnieImageError, match=r"LoRA non_finite_(nan|inf)\.safetensors: transformer\.layers\.3\.mlp\."
                                              r"up_proj\.lora_B\.weight holds NaN or infinite values, which would "
                                              r"make a black image\. The file is damaged"):
        ErnieImageLoraLoader.execute(tiny_patcher(tiny_models["snapshot"]), f"non_finite_{value}.safetensors", 1.0)


def test_a_lora_header_of_150000_names_is_refused_before_it_is_parsed(tiny_models, placed):
    """A 13 MB file of 150 000 empty tensors: each was read, mapped and counted (seconds of CPU, and safetensors
    parses up to 100 MB of such names). Refused from its first 8 bytes."""
    from comfyui_ernie_image.nodes.lora.nodes import ErnieImageLoraLoader

    entry = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
    header = json.dumps({f"lora_unet_layers_{i}_x.alpha": entry for i in range(150_000)}).encode()
    header += b" " * (-len(header) % 8)
    placed("loras", "many_names.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ErnieImageError, match=r"many_names\.safetensors declares a 13 MiB list of tensors \(model "
                                              r"files have well under 8 MiB\): it is not a model file this pack loads"):
        ErnieImageLoraLoader.execute(tiny_patcher(tiny_models["snapshot"]), "many_names.safetensors", 1.0)


# Issue 41: a LoRA's header parsed once, its tensors capped, its numbers bounded, its layers counted, its names cut.

def _node(tiny_models, lora_name: str):
    """What an ``ErnieImageLoraLoader`` node runs at strength 1 on the tiny DiT (its file from models/loras), but
    showing its report on the node: the patched MODEL."""
    from comfyui_ernie_image.nodes.lora.files import read_lora
    from comfyui_ernie_image.nodes.paths import model_file_path

    lora = read_lora(model_file_path("loras", lora_name), lora_name)
    return apply_lora(tiny_patcher(tiny_models["snapshot"]), lora, 1.0, lora_name)[0]


def test_a_lora_of_10000_tensors_has_its_header_parsed_once(tiny_models, placed, monkeypatch):
    """Main parsed the whole header again for each tensor: 10 000 empty tensors took 92 s on the audit's machine."""
    tensors = lora_file("ai-toolkit", deltas(LAYERS, seed=13))
    tensors |= {f"diffusion_model.layers.0.extra_{i}.lora_A.weight": torch.zeros(0) for i in range(10_000 - 6)}
    save_file(tensors, placed("loras", "ten_thousand.safetensors"))
    parses = count_header_parses(monkeypatch)
    start = time.perf_counter()
    patched = _node(tiny_models, "ten_thousand.safetensors")
    print(f"10 000 tensors: loaded in {time.perf_counter() - start:.2f} s")
    assert parses["ten_thousand.safetensors"] == 1
    assert len(patched.patches) == 3


def test_a_lora_of_more_tensors_than_any_ernie_lora_is_refused_before_one_is_read(tiny_models, placed, monkeypatch):
    from comfyui_ernie_image.nodes.lora.files import MAX_TENSORS

    tensors = {f"diffusion_model.layers.0.extra_{i}.lora_A.weight": torch.zeros(0) for i in range(MAX_TENSORS + 1)}
    save_file(tensors, placed("loras", "too_many.safetensors"))
    count_header_parses(monkeypatch)
    with pytest.raises(ErnieImageError, match=r"LoRA too_many\.safetensors holds 20001 tensors; a LoRA for every layer "
                                              r"of ERNIE-Image's DiT and text encoder has some 4 000, so this file is "
                                              r"not an ERNIE-Image LoRA \(at most 20000 are read\)\. Pick another"):
        _node(tiny_models, "too_many.safetensors")


@pytest.mark.parametrize("layout, key, value", [
    ("peft", "transformer.layers.3.mlp.up_proj.lora_B.weight", 1e20),
    ("onetrainer", "transformer.layers.3.mlp.up_proj.alpha", 3e38),
])
def test_a_lora_past_the_weights_range_is_refused_naming_the_file_and_key(tiny_models, placed, layout, key, value):
    """Finite but absurd: main reported "applied 3 of 3" and every output was NaN. The same file with sane numbers
    still applies."""
    tensors = lora_file(layout, deltas(LAYERS, seed=14))
    save_file(tensors, placed("loras", f"sane_{layout}.safetensors"))
    assert len(_node(tiny_models, f"sane_{layout}.safetensors").patches) == 3
    if key.endswith("alpha"):
        tensors[key] = torch.tensor(value)
    else:
        tensors[key][5, 1] = value
    save_file(tensors, placed("loras", f"absurd_{layout}.safetensors"))
    words = (rf"LoRA absurd_{layout}\.safetensors: transformer\.layers\.3\.mlp\.up_proj would change its weight by "
             r"up to [0-9.e+]+ at strength 1, past the largest number half precision holds \(65504; a LoRA changes a "
             r"weight by well under 1\): the image would be black or noise\. Its largest number is "
             rf"{re.escape(f'{value:.3g}')}, in {re.escape(key)}\. The file is damaged or its training diverged: pick "
             r"another LoRA\.")
    with pytest.raises(ErnieImageError, match=words):
        _node(tiny_models, f"absurd_{layout}.safetensors")


def test_an_alpha_of_three_numbers_is_refused_in_words(tiny_models, placed):
    """Main raised core's RuntimeError ("a Tensor with 3 elements cannot be converted to Scalar")."""
    tensors = lora_file("kohya", deltas(LAYERS, seed=15))
    tensors["lora_unet_layers_0_self_attention_to_q.alpha"] = torch.tensor([2.0, 2.0, 2.0])
    save_file(tensors, placed("loras", "alpha_of_three.safetensors"))
    with pytest.raises(ErnieImageError, match=r"LoRA alpha_of_three\.safetensors: lora_unet_layers_0_self_attention_"
                                              r"to_q\.alpha has shape \[3\]; a LoRA's alpha is one number \(its "
                                              r"layer's scale is alpha / rank\)\. The file is damaged"):
        _node(tiny_models, "alpha_of_three.safetensors")


def test_a_diff_and_a_diff_b_on_one_layer_count_as_one_layer(tiny_models):
    """Main said "applied 2 of its 1 diffusion-model layers": it counted patches (weight and bias), not layers."""
    model = tiny_patcher(tiny_models["snapshot"])
    parameters = dict(model.model.diffusion_model.named_parameters())
    lora = {f"diffusion_model.final_linear.{suffix}": torch.full_like(parameters[f"final_linear.{name}"], 0.01)
            for suffix, name in (("diff", "weight"), ("diff_b", "bias"))}
    patched, report = apply_lora(model, lora, 1.0, "diffs")
    assert report.text() == "LoRA diffs: applied 1 of its 1 diffusion-model layers"
    assert sorted(patched.patches) == ["diffusion_model.final_linear.bias", "diffusion_model.final_linear.weight"]


def test_an_8_mib_key_is_quoted_cut_short(tiny_models, placed):
    """Main echoed the name whole into an 8-million-character error."""
    key = "transformer.layers.0." + "x" * (8 * 2**20 - 2**16) + ".lora_A.weight"
    save_file({key: torch.tensor([float("nan")])}, placed("loras", "long_key.safetensors"))
    with pytest.raises(ErnieImageError) as error:
        _node(tiny_models, "long_key.safetensors")
    message = str(error.value)
    assert len(message) < 2000, message[:300]
    assert message.startswith(f"LoRA long_key.safetensors: {key[:200]}… ({len(key)} characters) holds NaN")
