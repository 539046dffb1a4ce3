"""Bad inputs through the running server: a clear error that names the file or value, and the server
goes on to run the next good prompt."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.files import linked_copy
from helpers.workflows import text_to_image

SNAPSHOT = "ERNIE-Image-Turbo-tiny"


def _good_prompt_still_runs(server) -> None:
    result = server.run(text_to_image(snapshot=SNAPSHOT, prompt="a dog", steps=1, seed=3, prefix="after_error"))
    assert result.status == "success", result.messages


def _execution_error(server, graph) -> str:
    result = server.run(graph)
    assert result.status == "error", result.messages
    error = result.error
    assert error is not None, result.messages
    return error["exception_message"]


def _dit_graph(name: str) -> dict:
    graph = text_to_image(snapshot=SNAPSHOT, prompt="a cat", steps=1, dit_file=name)
    graph["sampler"]["inputs"]["noise_seed"] = 77  # never served from ComfyUI's cache
    return graph


def test_missing_snapshot_folder_is_a_validation_error(comfy_server):
    graph = text_to_image(snapshot="no-such-snapshot", prompt="a cat")
    response = comfy_server.submit(graph)
    assert response.status_code == 400
    details = str(response.json()["node_errors"]["loader"])
    assert "'no-such-snapshot' was not found in ComfyUI's models/diffusers folder" in details
    assert "ERNIE-Image-Turbo-tiny" in details  # what is there instead
    _good_prompt_still_runs(comfy_server)


def test_truncated_safetensors_names_the_file(comfy_server, tiny_models, placed):
    source = tiny_models["single_file"]
    broken = placed(source.parent.name, "ernie-truncated.safetensors")
    broken.write_bytes(source.read_bytes()[: source.stat().st_size // 2])
    message = _execution_error(comfy_server, _dit_graph(broken.name))
    assert "ernie-truncated.safetensors" in message
    assert "damaged or incomplete" in message and "download it again" in message
    _good_prompt_still_runs(comfy_server)


def test_file_of_another_architecture_is_refused(comfy_server, tiny_models, placed):
    vae = tiny_models["snapshot"] / "vae" / "diffusion_pytorch_model.safetensors"
    wrong = placed("diffusion_models", "flux2-vae.safetensors")
    linked_copy(vae, wrong)
    message = _execution_error(comfy_server, _dit_graph(wrong.name))
    assert "flux2-vae.safetensors is not an ERNIE-Image diffusion model" in message
    assert "looks like a VAE" in message
    _good_prompt_still_runs(comfy_server)


def test_snapshot_without_transformer_says_so(comfy_server, tiny_models, placed):
    broken = placed("diffusers", "ERNIE-Image-no-transformer")
    linked_copy(tiny_models["snapshot"], broken, ignore=shutil.ignore_patterns("transformer"))
    graph = text_to_image(snapshot=broken.name, prompt="a cat", steps=1)
    message = _execution_error(comfy_server, graph)
    assert "ERNIE-Image-no-transformer has no transformer/ folder" in message
    _good_prompt_still_runs(comfy_server)


def test_text_encoder_of_another_model_is_named_as_the_cause(comfy_server, tiny_models, placed):
    """A Ministral-layout file of another width (as Flux.2's Mistral text encoder is) loads and encodes; sampling
    then says that the text encoder is the wrong model, not that the wiring is."""
    from transformers import Ministral3ForCausalLM

    from scripts.tiny_models import _ministral3_config

    source = load_file(tiny_models["text_encoder_file"])
    wider = Ministral3ForCausalLM(_ministral3_config(source["model.embed_tokens.weight"].shape[0], 48))
    state = {k: v.contiguous() for k, v in wider.state_dict().items() if k != "lm_head.weight"}
    save_file({**state, "tekken_model": source["tekken_model"]},
              str(placed("text_encoders", "mistral_3_small_flux2_bf16.safetensors")))
    graph = text_to_image(snapshot=SNAPSHOT, prompt="a cat", steps=1, seed=78)
    graph["te"] = {"class_type": "ErnieImageTextEncoderLoader",
                   "inputs": {"model_name": "text_encoders/mistral_3_small_flux2_bf16.safetensors"}}
    for key in ("positive", "negative"):
        graph[key]["inputs"]["text_encoder"] = ["te", 0]
    message = _execution_error(comfy_server, graph)
    assert "This conditioning has 48-wide embeddings; ERNIE-Image needs 32-wide ones" in message
    assert "the text encoder that made it is another model. Load ministral-3-3b.safetensors" in message
    _good_prompt_still_runs(comfy_server)


@pytest.mark.parametrize("channels", [4, 16])
def test_latent_of_another_model_is_refused(comfy_server, channels):
    input_dir = comfy_server.base_dir / "input"
    input_dir.mkdir(exist_ok=True)
    name = f"sd_latent_{channels}ch.latent"
    save_file({"latent_tensor": torch.randn(1, channels, 16, 16), "latent_format_version_0": torch.tensor([])},
              str(input_dir / name))
    graph = text_to_image(snapshot=SNAPSHOT, prompt="a cat", steps=1, seed=channels)
    graph["latent"] = {"class_type": "LoadLatent", "inputs": {"latent": name}}
    message = _execution_error(comfy_server, graph)
    assert f"ERNIE-Image needs a 128-channel latent (Flux.2 format), got shape (1, {channels}, 16, 16)" in message
    assert "EmptyFlux2LatentImage" in message
    _good_prompt_still_runs(comfy_server)
