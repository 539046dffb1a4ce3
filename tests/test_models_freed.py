"""A model a loader made is freed once ComfyUI drops the loader's output (a workflow switched, a file changed): a
garbage collection, as ComfyUI's server runs between prompts (0.3.75 ``main.py``, ``prompt_worker``), leaves none of
it alive. Run through the loaders' nodes in a real 0.3.75 core, on the tiny models. What a GPU holds goes without
waiting for that collection (at most every 10 s, after a prompt): it holds no reference cycle.

cache-dit keeps the exception of its SVDQuant kernels' first load for the process's life, with a traceback whose
frames keep their callers' locals: made from the DiT loader, the first DiT of a process was never freed (session 28,
2026-12-05). Each test starts as a fresh process does, before that first load (cache-dit's and the pack's caches of
it cleared)."""

from __future__ import annotations

import gc
import importlib
import types
import weakref

import pytest
import torch

from comfyui_ernie_image.nodes.dit.build import load_dit
from comfyui_ernie_image.nodes.dit.weights import tensor_locations
from comfyui_ernie_image.nodes.loaders import ErnieImageDiTLoader, ErnieImageLoader
from comfyui_ernie_image.nodes.pe.nodes import ErnieImagePELoader
from comfyui_ernie_image.nodes.quant import capability
from comfyui_ernie_image.nodes.quant.quantize import quantize_torchao
from comfyui_ernie_image.nodes.quant.requantize import Requantizer
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


def _freed_without_a_collection(make) -> bool:
    """Whether what ``make()`` returns is freed as soon as its last reference is dropped, collections off."""
    made = make()
    freed = weakref.ref(made)
    gc.disable()
    try:
        del made
        return freed() is None
    finally:
        gc.enable()


def test_a_vae_is_freed_without_waiting_for_a_collection(comfy_paths, tiny_models):
    """The VAE holds no reference cycle (the timed decode the pack sets on it refers to it weakly): it goes as soon
    as its last user drops it, not at ComfyUI's next collection (at most every 10 s between prompts)."""
    from comfyui_ernie_image.nodes.dit.vae import load_snapshot_vae

    assert _freed_without_a_collection(lambda: load_snapshot_vae(tiny_models["snapshot"]))


@pytest.fixture
def cache_dit_answers_cuda(monkeypatch):
    """cache-dit's torchao path refuses a machine without CUDA before it quantizes; here its platform answers as
    CUDA's (a fault the CPU cannot produce otherwise). ``int8_weight_only``, which torchao computes on the CPU too."""
    quantize_ao = importlib.import_module("cache_dit.quantization.torchao.quantize_ao")
    monkeypatch.setattr(quantize_ao, "current_platform",
                        types.SimpleNamespace(is_accelerator_available=lambda: True, device_type="cuda"))


def test_a_dit_torchao_quantized_at_load_is_freed_without_waiting_for_a_collection_cuda_check_faked(
        tiny_models, cache_dit_answers_cuda):
    """torchao's ``quantize_`` binds an ``extra_repr`` to each layer it quantizes, in the layer's own dictionary: a
    reference cycle. On the H100, a DiT quantized at load left 7.35 GiB on the GPU into the next graph's first
    prompt until a collection (bench/RESULTS.md, session 42)."""
    def quantized_weight():
        dit = quantize_torchao(load_dit(tiny_models["snapshot"], torch.bfloat16), "int8_weight_only",
                               torch.device("cpu"))
        weight = dit.layers[0].mlp.up_proj.weight
        assert Requantizer.holds(weight)  # quantized: the layer went through torchao
        return weight

    assert _freed_without_a_collection(quantized_weight)


def test_a_layer_made_again_for_a_lora_is_freed_with_its_weight_without_waiting_for_a_collection(tiny_models):
    """A LoRA's patched layer of a torchao DiT is quantized again in a layer of its own (``Requantizer``), which
    torchao's ``quantize_`` leaves in a reference cycle with the weight: each change of the LoRA stack would leave
    the replaced weights on the GPU until a collection."""
    requantizer = Requantizer(tiny_models["snapshot"], "int8_weight_only", torch.bfloat16, tensor_locations)
    assert _freed_without_a_collection(lambda: requantizer.quantized(torch.randn(64, 32)))
