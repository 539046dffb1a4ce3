"""One grammar for every loader's model list (``nodes/choices.py``): ``<folder>/<path inside it>``.

Each loader lists its models so; a workflow saved with a loader's old spelling (before the grammar, the all-in-one
loader and the text encoder's named a snapshot bare, the DiT's and the VAE's a file bare) still validates and runs
through a real headless ComfyUI, and loads the same model as the listed spelling. The PE loader's spellings
(``diffusers/<snapshot>``, ``text_encoders/<name>``) were already the grammar's.
"""

from __future__ import annotations

import pytest

from comfyui_ernie_image.nodes.dit.nodes import VAE_MODELS, ErnieImageVAELoader
from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.inputs import check_inputs
from comfyui_ernie_image.nodes.loaders import DIT_MODELS, SNAPSHOT_MODELS, ErnieImageDiTLoader, ErnieImageLoader
from comfyui_ernie_image.nodes.pe.locate import PE_MODELS
from comfyui_ernie_image.nodes.pe.nodes import ErnieImagePELoader
from comfyui_ernie_image.nodes.text.nodes import TEXT_ENCODER_MODELS, ErnieImageTextEncoderLoader
from helpers.workflows import text_to_image

SNAPSHOT = "ERNIE-Image-Turbo-tiny"
DIT_FILE = "ernie-image-turbo-tiny.safetensors"
TEXT_ENCODER_FILE = "ministral-3-3b-tiny.safetensors"
VAE_FILE = "flux2-vae-tiny.safetensors"

# node, its model list, the input, what it lists for the tiny models, {old spelling: listed spelling}
LOADERS = [
    (ErnieImageLoader, SNAPSHOT_MODELS, "model_name", [f"diffusers/{SNAPSHOT}"], {SNAPSHOT: f"diffusers/{SNAPSHOT}"}),
    (ErnieImageDiTLoader, DIT_MODELS, "model_name", [f"diffusion_models/{DIT_FILE}", f"diffusers/{SNAPSHOT}"],
     {DIT_FILE: f"diffusion_models/{DIT_FILE}", f"diffusers/{SNAPSHOT}": f"diffusers/{SNAPSHOT}"}),
    (ErnieImageTextEncoderLoader, TEXT_ENCODER_MODELS, "model_name",
     [f"diffusers/{SNAPSHOT}", f"text_encoders/{TEXT_ENCODER_FILE}"],
     {SNAPSHOT: f"diffusers/{SNAPSHOT}", f"text_encoders/{TEXT_ENCODER_FILE}": f"text_encoders/{TEXT_ENCODER_FILE}"}),
    (ErnieImageVAELoader, VAE_MODELS, "vae_name", [f"vae/{VAE_FILE}"], {VAE_FILE: f"vae/{VAE_FILE}"}),
    (ErnieImagePELoader, PE_MODELS, "model_name",
     [f"diffusers/{SNAPSHOT}", "text_encoders/ernie-image-prompt-enhancer-tiny",
      "text_encoders/ernie-image-prompt-enhancer-tiny.safetensors"],
     {f"diffusers/{SNAPSHOT}": f"diffusers/{SNAPSHOT}",
      "text_encoders/ernie-image-prompt-enhancer-tiny": "text_encoders/ernie-image-prompt-enhancer-tiny"}),
]
IDS = [node.__name__ for node, *_ in LOADERS]


@pytest.fixture(scope="module")
def model_folders(comfy_paths, tiny_models):
    comfy_paths.add_model_folder_path("vae", str(tiny_models["models_dir"] / "vae"), is_default=True)
    return comfy_paths


@pytest.mark.parametrize(("node", "models", "input_name", "listed", "saved"), LOADERS, ids=IDS)
def test_every_loader_lists_folder_slash_name(model_folders, node, models, input_name, listed, saved):
    spec = next(i for i in node.define_schema().inputs if i.id == input_name)
    assert spec.options == models.options()
    assert sorted(spec.options) == sorted(listed)
    for option in spec.options:
        folder, _, name = option.partition("/")
        assert name and folder in model_folders.folder_names_and_paths, option


@pytest.mark.parametrize(("node", "models", "input_name", "listed", "saved"), LOADERS, ids=IDS)
def test_old_spellings_validate_and_load_the_listed_model_unlisted(model_folders, node, models, input_name, listed,
                                                                   saved):
    for old, new in saved.items():
        assert node.validate_inputs(**{input_name: old}) is True, old
        check_inputs(node, {input_name: old})  # the pack's own check at execute lets it through too
        assert models.resolve(old) == models.resolve(new)
        assert models.canonical(old) == new
    assert set(saved) - set(listed) == {old for old, new in saved.items() if old != new}


@pytest.mark.parametrize(("node", "models", "input_name", "listed", "saved"), LOADERS, ids=IDS)
def test_a_name_the_list_does_not_hold_is_still_refused(model_folders, node, models, input_name, listed, saved):
    for value in ("missing.safetensors", "vae/missing.safetensors", "diffusers/missing", 7):
        assert "was not found in ComfyUI's models/" in node.validate_inputs(**{input_name: value}), value
        with pytest.raises(ErnieImageError, match=f"input '{input_name}' = .* is not one of its options"):
            check_inputs(node, {input_name: value})


@pytest.mark.parametrize(("models", "folder"), [(SNAPSHOT_MODELS, "diffusers"), (DIT_MODELS, "diffusion_models"),
                                                (DIT_MODELS, "diffusers"), (TEXT_ENCODER_MODELS, "diffusers"),
                                                (TEXT_ENCODER_MODELS, "text_encoders"), (VAE_MODELS, "vae"),
                                                (PE_MODELS, "diffusers"), (PE_MODELS, "text_encoders")])
def test_listed_spellings_cannot_leave_the_folder(model_folders, models, folder):
    """The path rule of ``paths.inside`` holds in the grammar's own spelling too (the tests of strangers' files use
    the old ones)."""
    for name in ("../outside", "x/../../outside", "/etc/passwd", "C:/outside", "a\\..\\..\\outside"):
        with pytest.raises(ErnieImageError, match=f"is not a model name under ComfyUI's models/{folder}"):
            models.resolve(f"{folder}/{name}")


def _graph_with(loader_name: str, old: str) -> dict:
    """A text-to-image workflow as saved before the grammar, with ``loader_name`` holding its old spelling ``old``."""
    if loader_name == "ErnieImageLoader":
        return text_to_image(snapshot=old, prompt="a cat", steps=1)
    graph = text_to_image(snapshot=f"diffusers/{SNAPSHOT}", prompt="a cat", steps=1,
                          dit_file=old if loader_name == "ErnieImageDiTLoader" else None)
    if loader_name == "ErnieImageTextEncoderLoader":
        graph["text_encoder"] = {"class_type": loader_name, "inputs": {"model_name": old}}
        for encode in ("positive", "negative"):
            graph[encode]["inputs"]["text_encoder"] = ["text_encoder", 0]
    if loader_name == "ErnieImageVAELoader":
        graph["vae"] = {"class_type": loader_name, "inputs": {"vae_name": old}}
        graph["decode"]["inputs"]["vae"] = ["vae", 0]
    return graph


@pytest.mark.parametrize(("loader_name", "old"), [
    ("ErnieImageLoader", SNAPSHOT),
    ("ErnieImageDiTLoader", DIT_FILE),
    ("ErnieImageTextEncoderLoader", SNAPSHOT),
    ("ErnieImageVAELoader", VAE_FILE),
])
def test_a_workflow_saved_in_the_old_spelling_runs_in_the_server(comfy_server, loader_name, old):
    graph = _graph_with(loader_name, old)
    assert sum(node["class_type"] == loader_name and old in node["inputs"].values() for node in graph.values()) == 1
    result = comfy_server.run(graph)
    assert result.status == "success", result.messages
    assert [p for p in comfy_server.output_images(result) if p.is_file()]
