"""Text encoder and Prompt Enhancer files from strangers, in all four layouts, through the loader nodes a user picks
them with: a missing weight, a stray layer, a config the shards do not bear out, an unknown tensor are each refused in
words before the model is built (transformers would have filled what is missing with random values and reported
success: a text encoder without its layer 1 made an image 68/255 off); the attention implementation is sdpa
whatever a config.json says.

The hostile files are written here with safetensors. Loads that a faulty loader would turn into a memory bomb run in
a child process with its address space capped (``helpers.bounded``).
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.pe.nodes import ErnieImagePELoader
from comfyui_ernie_image.nodes.pe.protocol import PromptSpec, SamplingParams
from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncode, ErnieImageTextEncoderLoader
from helpers.bounded import run_bounded
from helpers.files import linked_copy, replace_bytes, rewrite_safetensors
from helpers.quant_files import comfy_quant_fp8, scaled_fp8

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)
# Where each layout keeps its language model's layers (what precedes ``layers.`` in its keys).
LAYOUTS = {
    "text encoder snapshot": "language_model.model.",
    "text encoder single file": "model.",
    "PE folder": "model.",
    "PE single file": "model.",
}


def hostile(tiny_models, placed, layout: str, name: str, change=None, config_changes=None) -> str:
    """A copy of the tiny model in ``layout`` among ComfyUI's models, its weights changed by ``change`` (tensors →
    tensors) and its config.json updated with ``config_changes``; the name its loader node lists it under."""
    if layout == "text encoder snapshot":
        folder = linked_copy(tiny_models["snapshot"], placed("diffusers", name))
        weights, config, listed = folder / "text_encoder" / "model.safetensors", folder / "text_encoder", name
    elif layout == "PE folder":
        folder = linked_copy(tiny_models["pe_folder"], placed("text_encoders", f"ernie-image-prompt-enhancer-{name}"))
        weights, config, listed = folder / "model.safetensors", folder, f"text_encoders/{folder.name}"
    else:
        source = tiny_models["text_encoder_file" if layout.startswith("text") else "pe_single_file"]
        stem = "ministral-3-3b" if layout.startswith("text") else "ernie-image-prompt-enhancer"
        weights = linked_copy(source, placed("text_encoders", f"{stem}-{name}.safetensors"))
        config, listed = None, f"text_encoders/{weights.name}"
    if change is not None:
        rewrite_safetensors(weights, change)
    if config_changes:
        data = json.loads((config / "config.json").read_text())
        for key, value in config_changes.items():
            *parents, leaf = key.split(".")
            target = data
            for parent in parents:
                target = target[parent]
            target[leaf] = value
        replace_bytes(config / "config.json", json.dumps(data).encode())
    return listed


def load(layout: str, name: str):
    """What ComfyUI runs for the layout's loader node, and for the PE its first use (its weights load lazily):
    the loaded language model."""
    if layout.startswith("text"):
        return ErnieImageTextEncoderLoader.execute(name).result[0].encoder.language_model
    (handle,) = ErnieImagePELoader.execute(name, "cpu", "float32").result
    handle.enhance([PromptSpec("a cat", 1024, 1024)], GREEDY)
    return handle._model


def _drop(part: str):
    return lambda tensors: {k: v for k, v in tensors.items() if not k.startswith(part)}


def _add(part: str, tensor: torch.Tensor):
    return lambda tensors: {**tensors, part: tensor}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attack, part, change, words", [
    ("layer 1 removed", "layers.1.", _drop,
     r"is not a whole Ministral 3 {what}: it has no block 1 \({prefix}layers\.1\.…\) but has blocks up to 2"),
    ("one weight removed", "layers.2.mlp.down_proj.weight", _drop,
     r"is not a whole Ministral 3 {what}: {prefix}layers\.2\.mlp\.down_proj\.weight is missing \(block 0 has it\)"),
    ("the final norm removed", "norm.weight", _drop,
     r"is not a whole Ministral 3 {what}: {prefix}norm\.weight is missing\. Download it again"),
    ("a stray 128-byte layer 500", "layers.500.input_layernorm.weight", lambda key: _add(key, torch.ones(32)),
     r"is not a whole Ministral 3 {what}: it has no block 3 \({prefix}layers\.3\.…\) but has blocks up to 500"),
    ("an unknown tensor", "extra_norm.weight", lambda key: _add(key, torch.ones(32)),
     r"holds {prefix}extra_norm\.weight, which the Ministral 3 {what} does not have: the file is from another"),
])
def test_a_damaged_language_model_is_refused_naming_its_first_bad_key(tiny_models, placed, layout, attack, part,
                                                                      change, words):
    """Missing weights used to be left at random values, stray layers added as random ones, unknown tensors
    dropped: each loaded and reported success."""
    prefix = LAYOUTS[layout]
    what = "text encoder" if layout.startswith("text") else "prompt enhancer"
    name = hostile(tiny_models, placed, layout, attack.replace(" ", "-"), change(prefix + part))
    with pytest.raises(ErnieImageError, match=words.format(what=what, prefix=prefix.replace(".", r"\."))):
        load(layout, name)


@pytest.mark.parametrize("layout, config_changes, words", [
    ("text encoder snapshot", {"text_config.hidden_size": 48},
     r"language_model\.model\.embed_tokens\.weight has shape \[400, 32\], the Ministral 3 text encoder needs "
     r"\[400, 48\]"),
    ("text encoder snapshot", {"text_config.num_hidden_layers": 2},
     r"its config says num_hidden_layers 2, but its weights hold 3 layers"),
    ("PE folder", {"num_hidden_layers": 2}, r"its config says num_hidden_layers 2, but its weights hold 3 layers"),
    ("PE folder", {"vocab_size": 512},
     r"model\.embed_tokens\.weight has shape \[400, 32\], the Ministral 3 prompt enhancer needs \[512, 32\]"),
])
def test_a_config_that_disagrees_with_its_shards_is_refused(tiny_models, placed, layout, config_changes, words):
    """A config with fewer layers than the shards silently dropped the rest (another model); a wider one raised
    transformers' raw size-mismatch error."""
    name = hostile(tiny_models, placed, layout, "config-" + "-".join(config_changes).replace(".", "-"),
                   config_changes=config_changes)
    with pytest.raises(ErnieImageError, match=words):
        load(layout, name)


@pytest.mark.parametrize("layout", ["text encoder snapshot", "PE folder"])
@pytest.mark.parametrize("implementation", ["eager", "flash_attention_2"])
def test_the_attention_is_sdpa_whatever_the_config_says(tiny_models, placed, layout, implementation):
    """A config.json naming ``eager`` made the model run eager attention; one naming ``flash_attention_2`` (not
    installed) failed the load with transformers' ImportError."""
    name = hostile(tiny_models, placed, layout, f"attention-{implementation}",
                   config_changes={"attn_implementation": implementation})
    assert load(layout, name).config._attn_implementation == "sdpa"


def _layers(count: int):
    return lambda tensors: {**tensors, f"model.layers.{count}.input_layernorm.weight": torch.ones(32)}


@pytest.mark.parametrize("layout, change, config_changes, words", [
    ("PE single file", _layers(1_000_000_000), None,
     r"declares block 1000000000 \(model\.layers\.1000000000\.input_layernorm\.weight\): a Ministral 3 prompt "
     r"enhancer has at most 512 blocks"),
    ("text encoder single file", _layers(1_000_000_000), None,
     r"declares block 1000000000 \(model\.layers\.1000000000\.input_layernorm\.weight\): a Ministral 3 text encoder "
     r"has at most 512 blocks"),
    ("PE folder", None, {"num_hidden_layers": 20000}, r"its config says num_hidden_layers 20000, but its weights "
                                                      r"hold 3 layers"),
    ("text encoder snapshot", None, {"text_config.num_hidden_layers": 20000},
     r"its config says num_hidden_layers 20000, but its weights hold 3 layers"),
])
def test_a_memory_bomb_language_model_is_refused_with_no_memory_taken(tiny_models, placed, layout, change,
                                                                       config_changes, words):
    """One stray 128-byte tensor naming layer 10⁹, or a config of 20 000 layers, made transformers build (and fill
    with random values) that many layers. Here in a child capped at 512 MiB above its imports: refused by the header
    check, resident memory up < 50 MB."""
    name = hostile(tiny_models, placed, layout, "bomb", change, config_changes)
    folders = {folder: tiny_models["models_dir"] / folder for folder in ("diffusers", "text_encoders")}
    setup = ("from comfyui_ernie_image.nodes.pe.nodes import ErnieImagePELoader\n"
             "from comfyui_ernie_image.nodes.pe.protocol import PromptSpec, SamplingParams\n"
             "from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader")
    statement = (f"ErnieImageTextEncoderLoader.execute({name!r})" if layout.startswith("text") else
                 f"ErnieImagePELoader.execute({name!r}, 'cpu', 'float32').result[0].enhance("
                 "[PromptSpec('a cat', 1024, 1024)], SamplingParams(temperature=0.0, max_new_tokens=4))")
    report = run_bounded(statement, setup=setup, folders=folders)
    assert report["outcome"] in ("ErnieImageError", "EnhancerError"), report
    assert re.search(words, report["message"]), report
    assert report["rss_growth_mb"] < 50, report


def test_a_text_encoder_snapshot_keeps_its_vision_tower_unread(tiny_models, placed):
    """The vision tower and projector are parts the pack does not use: ignored by name, never read, so damage there
    (here: a vision layer removed, a projector of another shape) changes nothing."""
    def damage_vision(tensors):
        tensors = {k: v for k, v in tensors.items() if not k.startswith("vision_tower.transformer.layers.0.")}
        return {**tensors, "multi_modal_projector.linear_1.weight": torch.ones(3, 3)}

    reference = load("text encoder snapshot", "ERNIE-Image-Turbo-tiny")
    name = hostile(tiny_models, placed, "text encoder snapshot", "vision-damaged", damage_vision)
    ours = load("text encoder snapshot", name)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), reference.state_dict().values(),
                                                 strict=True))


@pytest.mark.parametrize("layout, config_changes, words", [
    ("PE folder", {"rms_norm_eps": -1.0}, r"config\.json: rms_norm_eps is -1\.0, which no Ministral 3 prompt enhancer "
                                          r"runs with"),
    ("PE folder", {"rms_norm_eps": float("nan")}, r"config\.json: rms_norm_eps is nan"),
    ("PE folder", {"rope_parameters.rope_theta": 0.0}, r"config\.json: rope_parameters\.rope_theta is 0\.0"),
    ("PE folder", {"rope_parameters.factor": float("inf")}, r"config\.json: rope_parameters\.factor is inf"),
    ("PE folder", {"head_dim": "128"}, r"config\.json is not a config of a Ministral 3 prompt enhancer \(Validation "
                                       r"error for field 'head_dim'"),
    ("text encoder snapshot", {"text_config.rms_norm_eps": float("nan")},
     r"text_encoder/config\.json: text_config\.rms_norm_eps is nan, which no Ministral 3 text encoder runs with"),
])
def test_a_config_with_numbers_no_model_runs_with_is_refused(tiny_models, placed, layout, config_changes, words):
    """A NaN or negative norm epsilon, a zero rope theta or an infinite rope factor loaded and made NaN outputs with
    no error; a field of the wrong type raised huggingface_hub's raw validation error."""
    name = hostile(tiny_models, placed, layout, "numbers-" + "-".join(config_changes).replace(".", "-"),
                   config_changes=config_changes)
    with pytest.raises(ErnieImageError, match=words):
        load(layout, name)


UP = "model.layers.1.mlp.up_proj"  # 64 rows of 32 in the tiny text encoder


def _fp8_file(layout, key: str | None = None, value: torch.Tensor | None = None):
    """The text encoder in core's fp8 ``layout`` (``helpers.quant_files``) with ``key`` set to ``value``."""
    def change(tensors):
        changed = layout(tensors, prefix="model.layers.")
        return changed if key is None else {**changed, key: value}
    return change


@pytest.mark.parametrize("attack, change, words", [
    ("a scale of 3e38", _fp8_file(scaled_fp8, f"{UP}.scale_weight", torch.tensor(3e38)),
     rf"the scale {UP}\.scale_weight is 3e\+38; a scale must be a finite positive number from 1\.18e-38 \(smaller "
     r"ones are subnormal\) to 7\.6e\+35 \(float8_e4m3fn's largest value 448 times it must stay within .*\): the "
     r"weights are multiplied by it, so this one would make a black or garbage image\. Download it again"),
    ("a subnormal scale", _fp8_file(scaled_fp8, f"{UP}.scale_weight", torch.tensor(1e-45)),
     rf"the scale {UP}\.scale_weight is 1\.4013e-45; a scale must be a finite positive number"),
    ("a row scale of zero", _fp8_file(comfy_quant_fp8, f"{UP}.weight_scale",
                                      torch.cat([torch.full((63, 1), 0.01), torch.zeros(1, 1)])),
     rf"the scale {UP}\.weight_scale is 0; a scale must be a finite positive number"),
    ("scales of another shape", _fp8_file(comfy_quant_fp8, f"{UP}.weight_scale", torch.full((8, 8), 0.01)),
     rf"{UP}\.weight_scale has shape \[8, 8\], but this pack loads float8_e4m3fn layers with one scale per weight \(a "
     r"single number\) or one per row"),
    ("e5m2 weights under an e4m3 configuration",
     lambda t: {**_fp8_file(comfy_quant_fp8)(t), f"{UP}.weight": torch.ones(64, 32).to(torch.float8_e5m2)},
     rf"{UP}\.weight is stored as F8_E5M2, but its quantization configuration says float8_e4m3fn"),
])
def test_an_fp8_text_encoder_scale_out_of_its_format_is_refused_by_key(tiny_models, placed, attack, change, words):
    """An fp8 scale of 3e38 or 1e-45 loaded and made NaN or zero embeddings (a black image); a row scale of 0 or an
    [8, 8] block of 64 scales was taken as 64 row scales; e5m2 bytes under an e4m3 configuration loaded as e5m2."""
    name = hostile(tiny_models, placed, "text encoder single file", "fp8-" + attack.replace(" ", "-"), change)
    with pytest.raises(ErnieImageError, match=words):
        load("text encoder single file", name)


def test_a_text_encoder_that_makes_non_finite_embeddings_is_named(tiny_models, placed):
    """Weights within every bound on their own can still overflow together: a norm weight of 1e30 made infinite
    hidden states and a black image with no message. The embeddings are checked as they are made."""
    name = hostile(tiny_models, placed, "text encoder single file", "overflowing",
                   _add("model.layers.0.post_attention_layernorm.weight", torch.full((32,), 1e30)))
    with pytest.raises(ErnieImageError, match=r"The text encoder .*ministral-3-3b-overflowing\.safetensors made text "
                                              r"embeddings that are not finite \(NaN or infinity\)"):
        ErnieImageTextEncode.execute(ErnieImageTextEncoderLoader.execute(name).result[0], "a cat")
