"""The text encoder in both layouts users have: a snapshot's text_encoder/ + tokenizer/, and ComfyUI's repack
(one ``.safetensors`` with the tokenizer inside) — the same embeddings for any prompt."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.text.encoder import ErnieTextEncoder
from comfyui_ernie_image.nodes.text.managed import ManagedTextEncoder
from helpers.files import snapshot_with_truncated_file

PROMPTS = ["a red cat sits on a blue mat", "", "一只 红色 的 猫", 'quotes "and" \\ backslashes\nnewline']


@pytest.fixture(scope="module")
def encoders(tiny_models):
    return (ErnieTextEncoder.from_snapshot(tiny_models["snapshot"], torch.float32),
            ErnieTextEncoder.from_single_file(tiny_models["text_encoder_file"], torch.float32))


@pytest.mark.parametrize("prompt", PROMPTS)
def test_single_file_encodes_like_the_snapshot(encoders, prompt):
    snapshot, single = encoders
    assert single.token_ids(prompt) == snapshot.token_ids(prompt)
    expected, actual = snapshot.encode(prompt, torch.device("cpu")), single.encode(prompt, torch.device("cpu"))
    assert actual.shape == expected.shape and expected.abs().max() > 0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_snapshot_encoder_matches_the_pipeline(tiny_models, encoders):
    from diffusers import ErnieImagePipeline

    pipe = ErnieImagePipeline.from_pretrained(tiny_models["snapshot"], dtype=torch.float32)
    (expected,) = pipe.encode_prompt(PROMPTS[0], torch.device("cpu"))
    torch.testing.assert_close(encoders[0].encode(PROMPTS[0], torch.device("cpu")), expected)


def test_single_file_without_tokenizer_says_what_to_load(tiny_models, tmp_path):
    broken = tmp_path / "ministral-no-tokenizer.safetensors"
    state = load_file(tiny_models["text_encoder_file"])
    save_file({k: v for k, v in state.items() if k != "tekken_model"}, str(broken))
    with pytest.raises(ErnieImageError, match=r"ministral-no-tokenizer\.safetensors carries no tokenizer .*snapshot"):
        ErnieTextEncoder.from_single_file(broken, torch.float32)


def test_a_file_of_another_model_is_named_as_such(tiny_models):
    with pytest.raises(ErnieImageError, match=r"ernie-image-turbo-tiny\.safetensors is not a Ministral 3 text "
                                              r"encoder \(it has no token embeddings\)"):
        ErnieTextEncoder.from_single_file(tiny_models["single_file"], torch.float32)  # the DiT


def test_loader_lists_text_encoder_files_but_not_prompt_enhancers(comfy_paths):
    from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader

    options = ErnieImageTextEncoderLoader.define_schema().inputs[0].options
    assert "diffusers/ERNIE-Image-Turbo-tiny" in options
    assert "text_encoders/ministral-3-3b-tiny.safetensors" in options
    assert not [o for o in options if "enhancer" in o]


def test_truncated_single_file_is_named(tiny_models, tmp_path):
    source = tiny_models["text_encoder_file"]
    broken = tmp_path / "ministral-truncated.safetensors"
    broken.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    with pytest.raises(ErnieImageError, match=r"ministral-truncated\.safetensors .*damaged or incomplete"):
        ErnieTextEncoder.from_single_file(broken, torch.float32)


@pytest.mark.parametrize("relative, keep_bytes", [("text_encoder/model.safetensors", 1000),
                                                  ("text_encoder/config.json", 20)])
def test_truncated_snapshot_file_is_named(tiny_models, tmp_path, relative, keep_bytes):
    snapshot = snapshot_with_truncated_file(tiny_models["snapshot"], tmp_path, relative, keep_bytes)
    with pytest.raises(ErnieImageError, match=rf"{relative} .*damaged or incomplete"):
        ErnieTextEncoder.from_snapshot(snapshot, torch.float32)


def test_a_file_gone_when_the_plan_changes_the_form_is_named_and_read_again_once_back(tiny_models, tmp_path):
    """The plan asks a text encoder loaded with weight_dtype ``auto`` for fp8 (``set_form``), which drops the weights
    held and reads the file again; the file is gone (moved between prompts). That read and the next encode fail in
    words naming the file, not with an AttributeError of the half-dropped encoder; with the file back, the next encode
    reads it again and gives the embedding of before."""
    path = tmp_path / "ministral-3-3b.safetensors"
    path.write_bytes(tiny_models["text_encoder_file"].read_bytes())
    encoder = ManagedTextEncoder.from_single_file(path, follows_plan=True, form_follows_plan=True)
    expected = encoder.encode(PROMPTS[0])
    moved = path.rename(tmp_path / "moved.safetensors")
    with pytest.raises(ErnieImageError, match="ministral-3-3b"):
        encoder.set_form(fp8=True)
    with pytest.raises(ErnieImageError, match="ministral-3-3b"):
        encoder.encode(PROMPTS[0])
    moved.rename(path)
    torch.testing.assert_close(encoder.encode(PROMPTS[0]), expected, rtol=0, atol=0)
