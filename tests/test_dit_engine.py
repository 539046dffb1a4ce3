"""The DiT engine without a server: weight layouts, config inference, the reference schedule."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from comfyui_ernie_image.nodes.dit import weights
from comfyui_ernie_image.nodes.dit.build import load_dit
from comfyui_ernie_image.nodes.dit.schedule import reference_sigmas, snapshot_shift
from comfyui_ernie_image.nodes.dit.weights import config_from_state_dict, expected_shapes
from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.model_files import read_safetensors
from helpers.bounded import run_bounded
from helpers.files import linked_copy, replace_bytes, snapshot_with_truncated_file
from helpers.quant_files import scaled_fp8


def test_single_file_config_is_the_snapshot_config(tiny_models):
    saved = json.loads((tiny_models["snapshot"] / "transformer" / "config.json").read_text())
    inferred = config_from_state_dict(read_safetensors(tiny_models["single_file"]), "tiny")
    for key, value in inferred.items():
        expected = saved[key]
        assert (list(value) if isinstance(value, tuple) else value) == expected, key


def test_a_folder_with_a_transformer_folder_but_no_model_index_is_read_where_the_plan_reads_it(tiny_models, tmp_path):
    """One rule for a DiT folder (``model_files.dit_folder``): a snapshot without ``model_index.json`` (copied in
    part) is read from its ``transformer/`` by the loader as by the plan and the saved quantized DiTs; the loader
    read the folder itself before, where it found no weights."""
    from comfyui_ernie_image.nodes.quant.saved import weight_files

    partial = linked_copy(tiny_models["snapshot"], tmp_path / "partial",
                          ignore=lambda folder, names: [n for n in names if n == "model_index.json"])
    assert not (partial / "model_index.json").exists()
    tensors, config = weights.read_dit(partial, torch.float32)
    expected, expected_config = weights.read_dit(tiny_models["snapshot"], torch.float32)
    assert config == expected_config == weights.dit_config(partial)
    assert tensors.keys() == expected.keys() and all(torch.equal(tensors[k], expected[k]) for k in expected)
    assert {f.parent for f in weight_files(partial)} == {partial / "transformer"}


def test_released_model_shapes_give_the_released_config():
    """Shapes of the 8B DiT (docs/ARCHITECTURE.md §2) give its config, rope axes (32, 48, 48) included."""
    shapes = {
        "x_embedder.proj.weight": (4096, 128, 1, 1),
        "layers.0.adaLN_sa_ln.weight": (4096,),
        "layers.0.self_attention.norm_q.weight": (128,),
        "layers.35.mlp.gate_proj.weight": (12288, 4096),
        "layers.0.mlp.gate_proj.weight": (12288, 4096),
        "text_proj.weight": (4096, 3072),
        "final_linear.weight": (128, 4096),
    }
    config = config_from_state_dict({k: torch.empty(s, device="meta") for k, s in shapes.items()}, "released")
    assert config == {
        "hidden_size": 4096, "num_attention_heads": 32, "num_layers": 36, "ffn_hidden_size": 12288,
        "in_channels": 128, "out_channels": 128, "patch_size": 1, "text_in_dim": 3072,
        "rope_axes_dim": (32, 48, 48),
    }


def test_single_file_and_snapshot_load_the_same_weights(tiny_models):
    from_file = load_dit(tiny_models["single_file"], torch.float32)
    from_snapshot = load_dit(tiny_models["snapshot"], torch.float32)
    a, b = from_file.state_dict(), from_snapshot.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_bf16_weight_dtype_is_applied(tiny_models):
    model = load_dit(tiny_models["single_file"], torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_non_safetensors_file_is_refused(tmp_path):
    pickle = tmp_path / "ernie.ckpt"
    pickle.write_bytes(b"not loaded")
    with pytest.raises(ErnieImageError, match=r"ernie\.ckpt is not a \.safetensors file"):
        load_dit(pickle, torch.float32)


@pytest.mark.parametrize("config", ["transformer/config.json", "scheduler/scheduler_config.json"])
def test_truncated_config_is_named(tiny_models, tmp_path, config):
    snapshot = snapshot_with_truncated_file(tiny_models["snapshot"], tmp_path, config, keep_bytes=20)
    with pytest.raises(ErnieImageError, match=rf"{config.split('/')[1]} .*damaged or incomplete.*download it again"):
        load_dit(snapshot, torch.float32) if config.startswith("transformer") else snapshot_shift(snapshot)


def test_a_config_that_is_not_a_json_object_is_named(tiny_models, tmp_path):
    snapshot = linked_copy(tiny_models["snapshot"], tmp_path / "snapshot")
    replace_bytes(snapshot / "scheduler" / "scheduler_config.json", b"[4.0]")
    with pytest.raises(ErnieImageError, match=r"scheduler_config\.json \(a JSON list, not an object\)\. The file is "
                                              r"damaged or incomplete"):
        snapshot_shift(snapshot)


@pytest.mark.parametrize("shift", [b"NaN", b"-4.0", b"0", b"true", b'"4.0"', b"1e999"])
def test_a_schedulers_shift_that_is_no_number_above_zero_is_refused(tiny_models, tmp_path, shift):
    """A shared snapshot's scheduler config sets every sigma: NaN gives a black image, a negative shift reversed
    sigmas."""
    snapshot = linked_copy(tiny_models["snapshot"], tmp_path / "snapshot")
    replace_bytes(snapshot / "scheduler" / "scheduler_config.json", b'{"shift": ' + shift + b"}")
    with pytest.raises(ErnieImageError, match=r"scheduler_config\.json gives the shift .*, not a number above 0 "
                                              r"\(ERNIE-Image's is 4\.0\)\. The file is damaged"):
        snapshot_shift(snapshot)


def test_one_shard_of_a_sharded_dit_says_to_use_the_snapshot(tiny_models, tmp_path):
    state = read_safetensors(tiny_models["single_file"])
    shard = tmp_path / "diffusion_pytorch_model-00001-of-00002.safetensors"
    save_file({k: v for k, v in state.items() if not k.startswith(("final_", "layers.1."))}, shard)
    with pytest.raises(ErnieImageError, match=r"holds only part of an ERNIE-Image DiT \(no final_linear.weight\): "
                                              r"it looks like one shard .* whole snapshot folder under models/diffus"):
        load_dit(shard, torch.float32)


def test_a_wrong_model_is_named_from_the_file_header_before_its_tensors_are_read(tmp_path, monkeypatch):
    """An SDXL checkpoint (it holds a CLIP text encoder too): refused from its header alone, so a many-gigabyte wrong
    file is never read into memory."""
    sdxl = tmp_path / "sd_xl_base.safetensors"
    save_file({"conditioner.embedders.0.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight":
               torch.ones(64, 64), "model.diffusion_model.input_blocks.0.0.weight": torch.ones(64, 64)}, sdxl)
    reads = []
    monkeypatch.setattr(weights, "read_safetensors", lambda path: reads.append(path) or read_safetensors(path))
    with pytest.raises(ErnieImageError, match=r"sd_xl_base.safetensors is not an ERNIE-Image diffusion model \(it "
                                              r"looks like a Stable Diffusion checkpoint\)"):
        load_dit(sdxl, torch.float32)
    assert reads == []


def test_truncated_shard_in_snapshot_is_named(tiny_models, tmp_path):
    shard = "transformer/diffusion_pytorch_model.safetensors"
    snapshot = snapshot_with_truncated_file(tiny_models["snapshot"], tmp_path, shard)
    with pytest.raises(ErnieImageError, match=r"diffusion_pytorch_model\.safetensors .*damaged or incomplete"):
        load_dit(snapshot, torch.float32)


@pytest.mark.parametrize("steps", [1, 8, 50])
def test_reference_sigmas_are_the_shifted_linspace(steps):
    t = torch.linspace(1.0, 0.0, steps + 1)[:-1]
    expected = torch.cat([4.0 * t / (1 + 3.0 * t), torch.zeros(1)])
    assert torch.allclose(reference_sigmas(steps), expected, atol=1e-7)


@pytest.mark.parametrize("steps", [4, 8, 50])
def test_core_simple_schedule_equals_reference_when_steps_divide_1000(steps):
    """Why KSampler(euler, simple) matches the reference at these step counts (and the model's shift is 4.0)."""
    import comfy.samplers

    from comfyui_ernie_image.nodes.dit.model import ErnieImageConfig, ErnieImageModel

    class Tiny(torch.nn.Module):
        dtype = torch.float32

    model = ErnieImageModel(ErnieImageConfig(ErnieImageConfig.unet_config), Tiny())
    simple = comfy.samplers.simple_scheduler(model.model_sampling, steps)
    assert torch.allclose(simple, reference_sigmas(steps), atol=1e-6)


def _block_linear_dtypes(model) -> set[torch.dtype]:
    """The dtypes of the blocks' linear weights (core's mixed-precision Linear is no ``torch.nn.Linear``)."""
    return {m.weight.dtype for n, m in model.named_modules()
            if n.startswith("layers.") and getattr(m, "weight", None) is not None and m.weight.ndim == 2}


def _prediction(model) -> torch.Tensor:
    torch.manual_seed(3)
    latents, text = torch.randn(1, 128, 4, 4), torch.randn(1, 5, 32)
    with torch.no_grad():
        return model._forward(latents, torch.tensor([600.0]), text, [5])


def test_an_fp8_single_file_stays_fp8_and_predicts_like_its_source(tiny_models, tmp_path):
    """The community's fp8 files (block weights in fp8, no scales): loaded as they are (bytes measured), cast per
    layer as it runs; the prediction stays within fp8 rounding of the full-precision source's."""
    source = read_safetensors(tiny_models["single_file"])
    fp8_file = tmp_path / "ernie-image-turbo-fp8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) if k.startswith("layers.") and v.ndim == 2 else v
               for k, v in source.items()}, fp8_file)
    full, fp8 = load_dit(tiny_models["single_file"], torch.float32), load_dit(fp8_file, torch.float32)
    assert _block_linear_dtypes(fp8) == {torch.float8_e4m3fn} and fp8.dtype == torch.float8_e4m3fn

    def weight_bytes(model):
        return sum(p.nbytes for p in model.parameters())

    blocks = sum(m.weight.numel() for n, m in full.named_modules() if isinstance(m, torch.nn.Linear)
                 and n.startswith("layers."))
    assert weight_bytes(full) - weight_bytes(fp8) == 3 * blocks  # 4 bytes per weight -> 1
    expected, ours = _prediction(full), _prediction(fp8)
    error = ((ours - expected).norm() / expected.norm()).item()
    assert 0 < error < 0.1


def test_an_fp8_weight_dtype_stores_the_blocks_in_fp8(tiny_models):
    model = load_dit(tiny_models["single_file"], torch.float32, torch.float8_e5m2)
    assert _block_linear_dtypes(model) == {torch.float8_e5m2}
    assert model.x_embedder.proj.weight.dtype == torch.float32  # the rest computes as it is


def test_a_scaled_fp8_file_stays_fp8_and_predicts_like_its_source(tiny_models, tmp_path):
    source = read_safetensors(tiny_models["single_file"])
    scaled_file = tmp_path / "ernie-image-turbo-fp8-scaled.safetensors"
    save_file(scaled_fp8(source), scaled_file)
    full, scaled = load_dit(tiny_models["single_file"], torch.float32), load_dit(scaled_file, torch.float32)
    assert _block_linear_dtypes(scaled) == {torch.float8_e4m3fn}
    expected, ours = _prediction(full), _prediction(scaled)
    assert 0 < ((ours - expected).norm() / expected.norm()).item() < 0.1
    # The same file upcast (as a quantization method starts from it): the scales folded into the weights.
    upcast = load_dit(scaled_file, torch.float32, torch.float32)
    assert _block_linear_dtypes(upcast) == {torch.float32}
    torch.testing.assert_close(_prediction(upcast), ours, rtol=1e-4, atol=1e-5)


def test_a_comfyui_without_scaled_fp8_layers_holds_a_scaled_file_in_fp8_with_its_mixed_precision_layers(
        tiny_models, tmp_path, monkeypatch):
    """Current cores removed ``scaled_fp8_ops`` (comfy/ops.py @0271a469) and read scaled fp8 files as comfy_quant
    float8_e4m3fn layers (comfy/utils.py @09708eae ``convert_old_quants``): the 0.3.75 core, driven so, keeps the
    weights in fp8 through ``mixed_precision_ops`` and predicts as with the scaled layers."""
    import comfy.ops

    scaled_file = tmp_path / "ernie-image-turbo-fp8-scaled.safetensors"
    save_file(scaled_fp8(read_safetensors(tiny_models["single_file"])), scaled_file)
    with_layers = _prediction(load_dit(scaled_file, torch.float32))
    monkeypatch.delattr(comfy.ops, "scaled_fp8_ops")
    model = load_dit(scaled_file, torch.float32)
    assert _block_linear_dtypes(model) == {torch.float8_e4m3fn}
    assert model.quant_formats == {"float8_e4m3fn"}  # held by core's mixed-precision layers
    torch.testing.assert_close(_prediction(model), with_layers, rtol=1e-4, atol=1e-5)


def test_a_checkpoint_style_single_file_loads_under_its_prefix(tiny_models, tmp_path):
    source = read_safetensors(tiny_models["single_file"])
    prefixed = tmp_path / "ernie-image-checkpoint.safetensors"
    other_models = {"first_stage_model.decoder.conv_in.weight": torch.ones(4)}  # a checkpoint's VAE: not read
    save_file({f"model.diffusion_model.{k}": v for k, v in source.items()} | other_models, prefixed)
    ours = load_dit(prefixed, torch.float32).state_dict()
    assert ours.keys() == source.keys() and all(torch.equal(ours[k], source[k]) for k in source)


def test_a_dit_cast_to_fp8_as_it_loads_holds_one_tensor_of_its_file_at_a_time(tmp_path):
    """A bf16 DiT loaded with fp8 block weights (the plan's choice on an 8 GB card) in a child process: its peak
    resident memory grows by its fp8 weights and less than half its file. Each of the file's tensors is a map of its
    pages; while the build held them all until it returned, the whole file's pages stayed resident beside the cast
    weights (the true-size Turbo DiT's first load on an 8 GB card: 14.2 GiB of file beside 10.6 GiB, 2026-12-06)."""
    config = dict(hidden_size=1024, num_attention_heads=8, num_layers=6, ffn_hidden_size=4096, in_channels=128,
                  out_channels=128, text_in_dim=64, rope_axes_dim=(32, 48, 48))
    generator = torch.Generator().manual_seed(0)
    state = {name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
             for name, shape in expected_shapes(config).items()}
    path = tmp_path / "ernie-image-bf16.safetensors"
    save_file(state, path)
    file_bytes = path.stat().st_size
    blocks = sum(t.numel() for name, t in state.items() if name.startswith("layers.") and t.ndim == 2)
    fp8_bytes = file_bytes - blocks  # the block weights' one byte each instead of two
    del state
    report = run_bounded(f"model = load_dit(Path({str(path)!r}), torch.bfloat16, torch.float8_e4m3fn)",
                         folders={}, headroom_mb=1 << 20, timeout_s=180,
                         setup="from pathlib import Path\nimport torch\n"
                               "from comfyui_ernie_image.nodes.dit.build import load_dit")
    assert report["outcome"] == "loaded", report
    growth = report["rss_growth_mb"] * 2**20
    print(f"file {file_bytes / 2**20:.0f} MiB, fp8 weights {fp8_bytes / 2**20:.0f} MiB, "
          f"peak RSS +{growth / 2**20:.0f} MiB")
    assert growth < fp8_bytes + file_bytes / 2
