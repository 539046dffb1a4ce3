"""DiT files and snapshots from strangers, through the DiT loader node a user picks them with: each bad one is
refused in words (the file, the first bad key, what to do) before a module is built or a weight read, and none
loads into a DiT that would silently change the image.

The hostile files are written here with safetensors, as an attacker would write them. Loads that a faulty loader
would turn into a memory bomb run in a child process with its address space capped (``helpers.bounded``).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_ernie_image.nodes.dit.weights import REQUIRED_KEYS
from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.loaders import ErnieImageDiTLoader
from helpers.bounded import run_bounded
from helpers.files import linked_copy, replace_bytes
from helpers.quant_files import comfy_quant_fp8, header_fp8, nvfp4, scaled_fp8

SNAPSHOT_CONFIG = "transformer/config.json"


def load(name: str, weight_dtype: str = "default"):
    """What ComfyUI runs for an ``ErnieImageDiTLoader`` node."""
    return ErnieImageDiTLoader.execute(name, weight_dtype, "none").result[0]


def hostile_snapshot(tiny_models, placed, name: str, **config_changes) -> str:
    """A copy of the tiny snapshot whose transformer config.json has ``config_changes``; its loader name."""
    snapshot = linked_copy(tiny_models["snapshot"], placed("diffusers", name))
    config = json.loads((snapshot / SNAPSHOT_CONFIG).read_text())
    replace_bytes(snapshot / SNAPSHOT_CONFIG, json.dumps({**config, **config_changes}).encode())
    return f"diffusers/{name}"


def hostile_file(tiny_models, placed, name: str, change) -> str:
    """The tiny DiT single file with ``change`` made to its tensors, among the diffusion models; its loader name."""
    save_file(change(load_file(tiny_models["single_file"])), placed("diffusion_models", name))
    return name


def billion_block_file(path) -> None:
    """576 bytes: the five keys the loader looks for, all empty, and one empty tensor that names block 10⁹."""
    save_file({k: torch.zeros(0) for k in (*REQUIRED_KEYS, "layers.1000000000.adaLN_sa_ln.weight")}, path)


@pytest.mark.parametrize("attack", ["billion-block single file", "snapshot config of 20000 layers"])
def test_a_memory_bomb_is_refused_by_its_header_with_no_memory_taken(tiny_models, placed, attack):
    """The loader used to take the block count from the highest index (or the config) and build the module tree
    first: 1.25 → 3.76 GiB in 45 s for the billion-block file, deaf to /interrupt, bound for the OOM killer. Here in
    a child capped at 512 MiB above its imports: refused by the header check, resident memory up < 50 MB."""
    if attack == "billion-block single file":
        path = placed("diffusion_models", "bomb-billion-blocks.safetensors")
        billion_block_file(path)
        assert path.stat().st_size < 1024
        name, folders = path.name, {"diffusion_models": path.parent}
        words = ("declares block 1000000000 (layers.1000000000.adaLN_sa_ln.weight): a ERNIE-Image DiT has at most "
                 "256 blocks, so the file is damaged or made to exhaust memory")
    else:
        name = hostile_snapshot(tiny_models, placed, "bomb-20000-layers", num_layers=20000)
        folders = {"diffusers": tiny_models["models_dir"] / "diffusers"}
        words = "transformer/config.json says num_layers 20000, but the weights in"
    report = run_bounded(f"ErnieImageDiTLoader.execute({name!r}, 'default', 'none')", folders=folders,
                         setup="from comfyui_ernie_image.nodes.loaders import ErnieImageDiTLoader")
    assert report["outcome"] == "ErnieImageError", report
    assert words in report["message"]
    assert report["rss_growth_mb"] < 50, report


@pytest.mark.parametrize("change, words", [
    ({"num_layers": 10.0}, r"num_layers is 10\.0; an ERNIE-Image DiT needs a positive whole number"),
    ({"num_layers": "10"}, r"says num_layers '10', but the weights in .* hold 10"),
    ({"hidden_size": 96}, r"says hidden_size 96, but the weights in .* hold 64"),
    ({"rope_theta": float("nan")}, r"rope_theta is nan; an ERNIE-Image DiT needs a finite positive number"),
    ({"eps": -1.0}, r"eps is -1\.0; an ERNIE-Image DiT needs a finite number between 0 and 1"),
    ({"rope_axes_dim": [4, 6, 8]}, r"rope_axes_dim is \[4, 6, 8\]; an ERNIE-Image DiT needs three positive even "
                                   r"numbers that add up to the head width 16"),
    ({"qk_layernorm": False}, r"holds layers\.0\.self_attention\.norm_k\.weight \(and 19 more\), which the "
                              r"ERNIE-Image DiT does not have"),
])
def test_a_snapshot_config_that_disagrees_with_its_weights_is_refused_in_words(tiny_models, placed, change, words):
    """A config the weights do not bear out (or that no DiT can run: a NaN rope, a negative epsilon) made raw
    TypeErrors, or loaded and sampled NaN images."""
    name = hostile_snapshot(tiny_models, placed, "config-" + "-".join(change), **change)
    with pytest.raises(ErnieImageError, match=words):
        load(name)


def _set(key: str, value: torch.Tensor):
    return lambda tensors: {**tensors, key: value}


def _drop(prefix: str):
    return lambda tensors: {k: v for k, v in tensors.items() if not k.startswith(prefix)}


@pytest.mark.parametrize("attack, change, words", [
    ("one stray tensor past the last block", _set("layers.10.adaLN_sa_ln.weight", torch.ones(64)),
     r"is not a whole ERNIE-Image DiT: layers\.10\.adaLN_mlp_ln\.weight is missing \(and 9 more\) \(block 0 has "
     r"it\)"),
    ("a block left out", _drop("layers.3."),
     r"is not a whole ERNIE-Image DiT: it has no block 3 \(layers\.3\.…\) but has blocks up to 9"),
    ("a weight left out of one block", _drop("layers.4.mlp.up_proj.weight"),
     r"is not a whole ERNIE-Image DiT: layers\.4\.mlp\.up_proj\.weight is missing \(block 0 has it\)"),
    ("a weight of another shape", _set("layers.2.mlp.up_proj.weight", torch.ones(129, 64)),
     r"layers\.2\.mlp\.up_proj\.weight has shape \[129, 64\], block 0's has \[128, 64\]"),
    ("integer weights", _set("layers.0.mlp.up_proj.weight", torch.ones(128, 64, dtype=torch.int64)),
     r"stores layers\.0\.mlp\.up_proj\.weight as I64; the ERNIE-Image DiT's weights are BF16, F16, F32, F64, "
     r"F8_E4M3, F8_E5M2"),
    ("an unknown tensor", _set("pos_embed.weight", torch.ones(4)),
     r"holds pos_embed\.weight, which the ERNIE-Image DiT does not have: the file is from another model"),
    ("an empty patch embedding", _set("x_embedder.proj.weight", torch.ones(64, 128, 1, 0)),
     r"x_embedder\.proj\.weight has shape \[64, 128, 1, 0\]; an ERNIE-Image DiT's is \[hidden, in_channels, patch, "
     r"patch\]"),
])
def test_a_damaged_single_file_is_refused_naming_its_first_bad_key(tiny_models, placed, attack, change, words):
    name = hostile_file(tiny_models, placed, f"damaged-{attack.replace(' ', '-')}.safetensors", change)
    with pytest.raises(ErnieImageError, match=words):
        load(name)


def _scaled(layer: str, scale: torch.Tensor):
    """The scaled fp8 tiny DiT with ``layer``'s scale replaced."""
    def change(tensors):
        scaled = scaled_fp8(tensors)
        scaled[f"{layer}.scale_weight"] = scale
        return scaled
    return change


LAYER = "layers.3.mlp.up_proj"  # 128 rows of 64


@pytest.mark.parametrize("weight_dtype", ["default", "fp32"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -0.01, 0.0])
def test_a_scale_that_is_not_a_finite_positive_number_is_refused_by_key(tiny_models, placed, scale, weight_dtype):
    """NaN or infinite scales gave black images, negative or zero ones garbage, with no error."""
    name = hostile_file(tiny_models, placed, f"scale-{scale}-{weight_dtype}.safetensors",
                        _scaled(LAYER, torch.tensor(scale)))
    with pytest.raises(ErnieImageError, match=rf"the scale {LAYER}\.scale_weight is {scale:g}; a scale must be a "
                                              r"finite positive number .* The file is damaged"):
        load(name, weight_dtype)


@pytest.mark.parametrize("weight_dtype", ["default", "fp32"])
@pytest.mark.parametrize("shape", [[128, 1], [128]])
def test_a_scale_per_row_is_refused_in_words(tiny_models, placed, shape, weight_dtype):
    """A scale per row ``[out, 1]`` loaded with fp32 and raised a raw torch size mismatch with ``default``; a 1-D
    ``[out]`` one raised raw torch errors with both (or, on a square layer, broadcast along the wrong axis)."""
    name = hostile_file(tiny_models, placed, f"scale-rows-{len(shape)}-{weight_dtype}.safetensors",
                        _scaled(LAYER, torch.full(shape, 0.01)))
    with pytest.raises(ErnieImageError, match=rf"{LAYER}\.scale_weight has shape \{shape}\, but this pack loads "
                                              r"scaled fp8 files with one scale per weight .* Use the bf16 file"):
        load(name, weight_dtype)


def _quantized(layout, key: str, value: torch.Tensor):
    """The tiny DiT in a comfy_quant ``layout`` (``helpers.quant_files``) with one of its scales replaced."""
    return lambda tensors: {**layout(tensors), key: value}


@pytest.mark.parametrize("layout, key, value, words", [
    (comfy_quant_fp8, f"{LAYER}.weight_scale", torch.tensor(float("nan")), rf"the scale {LAYER}\.weight_scale is nan"),
    (comfy_quant_fp8, f"{LAYER}.weight_scale", torch.tensor(-2.0), rf"the scale {LAYER}\.weight_scale is -2"),
    (comfy_quant_fp8, f"{LAYER}.input_scale", torch.tensor(0.0), rf"the scale {LAYER}\.input_scale is 0"),
    (nvfp4, f"{LAYER}.weight_scale_2", torch.tensor(float("inf")), rf"the scale {LAYER}\.weight_scale_2 is inf"),
    (nvfp4, f"{LAYER}.weight_scale", torch.full((128, 4), float("nan")).to(torch.float8_e4m3fn),
     rf"the block scale {LAYER}\.weight_scale holds nan; block scales must be finite and not negative"),
])
def test_a_comfy_quant_scale_that_is_not_finite_and_positive_is_refused_by_key(tiny_models, placed, layout, key, value,
                                                                                 words):
    """ComfyUI's comfy_quant layout (fp8 with ``weight_scale`` / ``input_scale``, NVFP4 with block scales and a
    global ``weight_scale_2``): its scales are checked as scaled fp8's are, before the weights are read."""
    name = hostile_file(tiny_models, placed, f"comfy-quant-{key.rsplit('.', 1)[1]}-{value.flatten()[0].item()}"
                                             ".safetensors", _quantized(layout, key, value))
    with pytest.raises(ErnieImageError, match=words + r"(; a scale must be a finite positive number)?"):
        load(name)


SQUARE = "layers.2.self_attention.to_q"  # 64 rows of 64: every attention layer of the DiT is square


def _e5m2(layer: str):
    """The scaled fp8 tiny DiT with ``layer`` stored as e5m2 (its scale as it is)."""
    def change(tensors):
        scaled = scaled_fp8(tensors)
        scaled[f"{layer}.weight"] = scaled[f"{layer}.weight"].float().to(torch.float8_e5m2)
        return scaled
    return change


@pytest.mark.parametrize("attack, change, words", [
    ("comfy_quant per-row scale on a square layer", _quantized(comfy_quant_fp8, f"{SQUARE}.weight_scale",
                                                               torch.full((64,), 0.01)),
     rf"{SQUARE}\.weight_scale has shape \[64\], but this pack loads float8_e4m3fn layers with one scale per weight "
     r"\(a single number\); other scales are not loaded \(one along the wrong axis would change the image "
     r"silently\)\. Use the bf16 file"),
    ("comfy_quant per-row scale on a wide layer", _quantized(comfy_quant_fp8, f"{LAYER}.weight_scale",
                                                             torch.full((128,), 0.01)),
     rf"{LAYER}\.weight_scale has shape \[128\], but this pack loads float8_e4m3fn layers with one scale per weight"),
    ("a [2, 2] scale", _quantized(comfy_quant_fp8, f"{LAYER}.weight_scale", torch.full((2, 2), 0.01)),
     rf"{LAYER}\.weight_scale has shape \[2, 2\], but this pack loads float8_e4m3fn layers with one scale"),
    ("an input scale per row", _quantized(comfy_quant_fp8, f"{LAYER}.input_scale", torch.full((128, 1), 0.01)),
     rf"{LAYER}\.input_scale has shape \[128, 1\], but this pack loads float8_e4m3fn layers with one scale"),
    ("a scale of 3e38", _scaled(LAYER, torch.tensor(3e38)),
     rf"the scale {LAYER}\.scale_weight is 3e\+38; a scale must be a finite positive number from 1\.18e-38 \(smaller "
     r"ones are subnormal\) to 7\.6e\+35 \(float8_e4m3fn's largest value 448 times it must stay within float32\): "
     r"the weights are multiplied by it, so this one would make a black or garbage image\. The file is damaged"),
    ("a comfy_quant scale of 3e38", _quantized(comfy_quant_fp8, f"{LAYER}.weight_scale", torch.tensor(3e38)),
     rf"the scale {LAYER}\.weight_scale is 3e\+38; a scale must be a finite positive number"),
    ("a subnormal scale", _scaled(LAYER, torch.tensor(1e-45)),
     rf"the scale {LAYER}\.scale_weight is 1\.4013e-45; a scale must be a finite positive number from 1\.18e-38 "
     r"\(smaller ones are subnormal\)"),
    ("an e5m2 layer whose scale overflows", lambda t: {**_e5m2(LAYER)(t), f"{LAYER}.scale_weight": torch.tensor(1e34)},
     rf"the scale {LAYER}\.scale_weight is 1e\+34; .* to 5\.93e\+33 \(float8_e5m2's largest value 57344 times it"),
    ("an int8 weight under a float8 configuration",
     _quantized(comfy_quant_fp8, f"{LAYER}.weight", torch.ones(128, 64, dtype=torch.int8)),
     rf"{LAYER}\.weight is stored as I8, but its quantization configuration says float8_e4m3fn, stored as F8_E4M3: "
     r"the file is damaged or its weights are of another format"),
    ("float8 weights packed two a byte",
     _quantized(comfy_quant_fp8, f"{LAYER}.weight", torch.ones(128, 32, dtype=torch.uint8)),
     rf"{LAYER}\.weight is stored as U8, but its quantization configuration says float8_e4m3fn"),
    ("float8 weights of half the columns",
     _quantized(comfy_quant_fp8, f"{LAYER}.weight", torch.ones(128, 32).to(torch.float8_e4m3fn)),
     rf"does not fit a ERNIE-Image DiT: {LAYER}\.weight has shape \[128, 32\], block 0's has \[128, 64\]"),
    ("a comfy_quant configuration nested 2000 deep",
     _quantized(comfy_quant_fp8, f"{LAYER}.comfy_quant", torch.tensor(list(b"[" * 2000 + b"]" * 2000),
                                                                       dtype=torch.uint8)),
     rf"{LAYER}\.comfy_quant holds no readable JSON \(nested deeper than any quantization configuration\): the file "
     r"is damaged"),
])
def test_a_quantized_layer_out_of_its_format_is_refused_by_key(tiny_models, placed, attack, change, words):
    """A comfy_quant per-row ``weight_scale`` of shape ``[out]`` was multiplied along the wrong axis of a square
    layer, silently (output 0.018 off the bf16 model against 0.004 for a right file), and raised a raw RuntimeError
    on the others (and a ``[2, 2]`` one); scales of 3e38 or 1e-45 made black images; an int8 weight under a float8
    configuration loaded, packed fp8 weights failed at the first forward. Each is refused by key, in words, before
    the weights are read."""
    name = hostile_file(tiny_models, placed, f"format-{attack.replace(' ', '-')}.safetensors", change)
    with pytest.raises(ErnieImageError, match=words):
        load(name)


def test_quantization_metadata_nested_deeply_is_refused_in_words(tiny_models, placed):
    """0.3.75's header form of comfy_quant with JSON nested 100 000 deep raised a raw RecursionError."""
    tensors, _ = header_fp8(load_file(tiny_models["single_file"]))
    path = placed("diffusion_models", "metadata-nested.safetensors")
    save_file(tensors, path, {"_quantization_metadata": "[" * 100_000 + "]" * 100_000})
    with pytest.raises(ErnieImageError, match=r"_quantization_metadata header is not ComfyUI's quantization metadata "
                                              r"\(ValueError\('nested deeper than any quantization configuration'\)\)"):
        load(path.name)


def test_nvfp4_block_scales_of_zero_are_left_alone(tiny_models, placed):
    """An all-zero block has a block scale of 0: NVFP4 files hold them. The scales pass; 0.3.75 then refuses the
    format itself, in words."""
    name = hostile_file(tiny_models, placed, "nvfp4-zero-blocks.safetensors",
                        _quantized(nvfp4, f"{LAYER}.weight_scale", torch.zeros(128, 4).to(torch.float8_e4m3fn)))
    with pytest.raises(ErnieImageError, match=r"stores layers as nvfp4 .* a quantization format this ComfyUI"):
        load(name)


@pytest.mark.parametrize("attack", ["a tensor in two shards", "an index naming an absent shard"])
def test_a_snapshot_whose_shards_disagree_is_refused(tiny_models, placed, attack):
    """Two shards holding one tensor were merged silently (the last one read won); an index listing a shard that is
    not there (an interrupted download) was not looked at."""
    snapshot = linked_copy(tiny_models["snapshot"], placed("diffusers", "shards-" + attack.replace(" ", "-")))
    transformer = snapshot / "transformer"
    if attack == "a tensor in two shards":
        extra = transformer / "diffusion_pytorch_model-extra.safetensors"
        save_file({"final_linear.weight": torch.zeros(128, 64)}, extra)
        words = (r"final_linear\.weight is in two shards of .*transformer \(diffusion_pytorch_model-extra\.safetensors "
                 r"and diffusion_pytorch_model\.safetensors\): the folder mixes two downloads")
    else:
        index = {"weight_map": {"final_linear.weight": "diffusion_pytorch_model-00002-of-00002.safetensors"}}
        (transformer / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
        words = (r"index\.json lists the shard diffusion_pytorch_model-00002-of-00002\.safetensors, which is not in "
                 r".*transformer: the download is incomplete")
    with pytest.raises(ErnieImageError, match=words):
        load(f"diffusers/{snapshot.name}")


def test_weights_that_overflow_together_are_named_at_the_first_step(tiny_models, placed):
    """Every weight finite, yet their product overflows: the image was black with no message. The first sampled
    step's output is checked (once per run) and the DiT's file named."""
    from helpers.accel import sample

    name = hostile_file(tiny_models, placed, "overflowing.safetensors",
                        _set("layers.0.mlp.up_proj.weight", torch.full((128, 64), 1e38)))
    with pytest.raises(ErnieImageError, match=r"The DiT's first sampled step gave values that are not finite \(NaN or "
                                              r"infinity\): the weights of .*overflowing\.safetensors \(or a LoRA "
                                              r"applied to them\) hold values no image can be made from"):
        sample(load(name), steps=2)
