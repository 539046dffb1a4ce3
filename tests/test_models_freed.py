"""A model a loader made is freed once ComfyUI drops the loader's output (a workflow switched, a file changed): a
garbage collection, as ComfyUI's server runs between prompts (0.3.75 ``main.py``, ``prompt_worker``), leaves none of
it alive. Run through the loaders' nodes in a real 0.3.75 core, on the tiny models.

cache-dit keeps the exception of its SVDQuant kernels' first load for the process's life, with a traceback whose
frames keep their callers' locals: made from the DiT loader, the first DiT of a process was never freed (session 28,
2026-12-05). Each test starts as a fresh process does, before that first load (cache-dit's and the pack's caches of
it cleared)."""

from __future__ import annotations

import gc
import weakref

import pytest

from comfyui_ernie_image.nodes.loaders import ErnieImageDiTLoader, ErnieImageLoader
from comfyui_ernie_image.nodes.pe.nodes import ErnieImagePELoader
from comfyui_ernie_image.nodes.quant import capability
from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader


@pytest.fixture(autouse=True)
def kernels_not_loaded_yet():
    from cache_dit.kernels.cuda import _svdquant

    _svdquant._cached_extension_module = _svdquant._cached_load_error = None
    capability.svdq_kernels.cache_clear()


def _alive_once_dropped(load) -> list[str]:
    """The names of what is still alive of the outputs ``load()`` made (and the models they hold) once they are
    dropped and garbage is collected."""
    outputs = load()
    held = [(type(o).__name__, weakref.ref(o)) for o in outputs]
    held += [(type(o.model).__name__, weakref.ref(o.model)) for o in outputs if hasattr(o, "model")]
    del outputs
    gc.collect()
    return [name for name, ref in held if ref() is not None]


def test_the_all_in_one_loaders_models_are_freed_once_dropped(comfy_paths, tiny_models):
    assert _alive_once_dropped(lambda: ErnieImageLoader.execute("diffusers/ERNIE-Image-Turbo-tiny").result) == []


def test_the_single_loaders_models_are_freed_once_dropped(comfy_paths, tiny_models):
    def load() -> tuple:
        dit = ErnieImageDiTLoader.execute(f"diffusion_models/{tiny_models['single_file'].name}", "default", "none")
        text = ErnieImageTextEncoderLoader.execute(f"text_encoders/{tiny_models['text_encoder_file'].name}", "cpu")
        pe = ErnieImagePELoader.execute(f"text_encoders/{tiny_models['pe_single_file'].name}", "cpu", "auto")
        return (*dit.result, *text.result, *pe.result)

    assert _alive_once_dropped(load) == []



def test_a_vae_is_freed_without_waiting_for_a_collection(comfy_paths, tiny_models):
    """The VAE holds no reference cycle (the timed decode the pack sets on it refers to it weakly): it goes as soon
    as its last user drops it, not at ComfyUI's next collection (at most every 10 s between prompts)."""
    from comfyui_ernie_image.nodes.dit.vae import load_snapshot_vae

    vae = load_snapshot_vae(tiny_models["snapshot"])
    freed = weakref.ref(vae)
    gc.disable()
    try:
        del vae
        assert freed() is None
    finally:
        gc.enable()
