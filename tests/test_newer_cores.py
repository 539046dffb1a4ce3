"""The pack on the cores users run (ComfyUI 0.19–0.38), reproduced on the real 0.3.75 core.

Each server here loads ``helpers/newer_core`` beside the pack, which makes 0.3.75 call custom nodes the way current
upstream does (each change cites its upstream file and commit there); the graphs run through ComfyUI's executor as
a user's would. The quantized files load on 0.3.75 itself, whose mixed-precision layers read them too.
"""

from __future__ import annotations

import logging

import psutil
import pytest
import torch
from safetensors.torch import save_file

from comfyui_ernie_image.nodes.dit.build import load_dit
from comfyui_ernie_image.nodes.model_files import read_safetensors
from conftest import COMFY_DIR, REPO
from helpers.accel import text
from helpers.lora import LAYERS, deltas, lora_file
from helpers.quant_files import comfy_quant_fp8, header_fp8, nvfp4, scaled_fp8
from helpers.reference import saved_image
from helpers.workflows import text_to_image

SNAPSHOT = "ERNIE-Image-Turbo-tiny"
NEWER_CORE = REPO / "tests" / "helpers" / "newer_core"
CACHE = ("ErnieImageCacheDiT", dict(preset="custom", Fn_compute_blocks=2, Bn_compute_blocks=0,
                                    residual_diff_threshold=0.2, max_warmup_steps=1, max_cached_steps=-1,
                                    max_continuous_cached_steps=-1, taylorseer_order=1, steps_mask="off",
                                    steps_mask_cache="dynamic"))
QUANTIZED = {"scaled": "ernie-image-turbo-fp8-scaled.safetensors", "comfy_quant": "ernie-image-turbo-fp8.safetensors",
             "nvfp4": "ernie-image-turbo-nvfp4.safetensors"}
PEFT_LORA = "ernie-image-peft-lora.safetensors"


@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    """The tiny models, plus the DiT in quantized layouts and a LoRA in diffusers' PEFT layout."""
    root = tmp_path_factory.mktemp("newer_core_models")
    for folder in ("diffusers", "text_encoders", "vae"):
        (root / folder).symlink_to(tiny_models["models_dir"] / folder, target_is_directory=True)
    (root / "diffusion_models").mkdir()
    (root / "loras").mkdir()
    source = read_safetensors(tiny_models["single_file"])
    save_file(scaled_fp8(source), root / "diffusion_models" / QUANTIZED["scaled"])
    save_file(comfy_quant_fp8(source), root / "diffusion_models" / QUANTIZED["comfy_quant"])
    save_file(nvfp4(source), root / "diffusion_models" / QUANTIZED["nvfp4"])
    save_file(lora_file("peft", deltas(LAYERS, seed=7)), root / "loras" / PEFT_LORA)
    return root


def newer_core_server(models, base, changes: str):
    from scripts.comfy_headless import ComfyServer

    (base / "custom_nodes").mkdir(parents=True)
    (base / "custom_nodes" / "newer_core").symlink_to(NEWER_CORE, target_is_directory=True)
    # The pack's dynamic-VRAM path is off by default until a GPU run shows it (host/patchers.py): on here.
    return ComfyServer(COMFY_DIR, base, REPO, models,
                       env={"ERNIE_TEST_NEWER_CORE": changes, "ERNIE_IMAGE_DYNAMIC_VRAM": "on"})


@pytest.fixture(scope="module")
def prepare_sampling_server(models, tmp_path_factory):
    """A server whose sampler passes PREPARE_SAMPLING wrappers the keywords current cores pass, and nothing else."""
    server = newer_core_server(models, tmp_path_factory.mktemp("core_prepare_sampling"), "prepare_sampling")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def current_core(models, tmp_path_factory):
    """A server with all of current cores' conventions this file reproduces at once."""
    server = newer_core_server(models, tmp_path_factory.mktemp("current_core"),
                               "prepare_sampling,memory_required,no_scaled_fp8,dynamic,ernie_image")
    server.start()
    yield server
    server.stop()


def _run(server, **graph):
    result, log = server.run_logged(text_to_image(snapshot=SNAPSHOT, prompt="a lighthouse at dawn", **graph))
    assert result.status == "success", result.messages
    return result, log


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_cache_dit_samples_when_the_core_passes_force_full_load_and_force_offload(prepare_sampling_server, cfg):
    """Core since v0.6.0 passes ``force_full_load=``/``force_offload=`` to PREPARE_SAMPLING wrappers: Cache-DiT
    failed with a TypeError on every core a user runs."""
    _, log = _run(prepare_sampling_server, model_nodes=(CACHE,), steps=6, cfg=cfg, negative="blurry")
    assert "Cache-DiT [custom] 6 steps" in log


def test_cache_dits_memory_estimate_keeps_the_attention_profile_core_passes(tiny_models, monkeypatch):
    """Current cores pass a memory estimate the attention profile set on the model (``memory_efficient_attention``,
    where the estimate's signature takes it), and pick their formula by it. Cache-DiT's estimate for the run
    dropped it (its signature took none, so core did not pass it); now the model's own estimate gets it. (The
    stand-in passes it where upstream's ``estimate_memory`` does: for the load before sampling.)"""
    from comfyui_ernie_image.nodes.accel.cache_presets import resolve
    from comfyui_ernie_image.nodes.accel.patching import CacheJob, apply_cache
    from helpers.accel import sample, tiny_patcher
    from helpers.newer_core import APPLY, PROFILES_SEEN

    APPLY["memory_required"](lambda obj, name, value: monkeypatch.setattr(obj, name, value, raising=False))
    PROFILES_SEEN.clear()
    sample(apply_cache(tiny_patcher(tiny_models["snapshot"]), CacheJob(resolve("fast"), "fast", None)), steps=8)
    assert PROFILES_SEEN[:2] == [True, True], PROFILES_SEEN  # the estimates for the load before sampling


def test_a_scaled_fp8_file_stays_fp8_where_the_core_has_no_scaled_fp8_layers(current_core):
    _, log = _run(current_core, dit_file=QUANTIZED["scaled"], steps=2)
    assert "DiT layers stay in float8_e4m3fn, held by ComfyUI's mixed-precision layers" in log
    assert "held in torch.float32" not in log


def test_an_nvfp4_file_is_refused_by_its_format_and_the_core_that_loads_it(current_core):
    result = current_core.run(text_to_image(snapshot=SNAPSHOT, prompt="x", dit_file=QUANTIZED["nvfp4"]))
    message = result.error["exception_message"]
    assert result.status == "error" and result.error["node_type"] == "ErnieImageDiTLoader"
    assert "stores layers as nvfp4 (first: layers.0." in message
    assert "this ComfyUI (0.3.75) cannot load; ComfyUI 0.38.1 loads it" in message
    assert "damaged" not in message


def test_the_compile_node_gives_a_dynamic_model_a_resident_copy_and_compiles_every_block(current_core):
    """Core's dynamic patcher streams weights per layer, which compiled blocks cannot use: the node demotes the
    MODEL as core's compile node does (``clone(disable_dynamic=True)``), and the log counts the blocks."""
    _, log = _run(current_core, model_nodes=(("ErnieImageCompile", dict(mode="default")),), steps=2)
    assert "ERNIE-Image: compiled 10 of 10 DiT blocks" in log


def test_cores_own_lora_loader_applies_a_diffusers_lora_where_the_core_has_native_ernie(current_core):
    """Core maps diffusers' ``transformer.*`` LoRA names for ``model_base.ErnieImage`` (comfy/lora.py @17358c8f),
    which the pack's model is on such cores: core's node now applies a PEFT LoRA as the pack's node does."""
    core = ("LoraLoaderModelOnly", dict(lora_name=PEFT_LORA, strength_model=1.0))
    pack = ("ErnieImageLoraLoader", dict(lora_name=PEFT_LORA, strength_model=1.0))
    images = {}
    for name, node in (("core", core), ("pack", pack), ("none", None)):
        result, log = _run(current_core, model_nodes=(node,) if node else (), steps=2, prefix=name)
        assert "lora key not loaded" not in log
        (path,) = current_core.output_images(result)
        images[name] = saved_image(path)
    assert (images["core"] == images["pack"]).all() and (images["core"] != images["none"]).any()


def test_a_comfy_quant_fp8_file_loads_in_fp8_on_0_3_75(tiny_models, tmp_path):
    """ComfyUI's mixed-precision layout, per-layer tensors (current cores) and the header form (0.3.75): the block
    weights stay one byte each, and the prediction is the bf16 file's within fp8's rounding."""
    source = read_safetensors(tiny_models["single_file"])
    tagged, (headed, metadata) = comfy_quant_fp8(source), header_fp8(source)
    save_file(tagged, tmp_path / "tagged.safetensors")
    save_file(headed, tmp_path / "headed.safetensors", metadata=metadata)
    full = load_dit(tiny_models["single_file"], torch.float32)
    x, t, context = torch.randn(1, 128, 4, 4, generator=torch.manual_seed(2)), torch.tensor([600.0]), text(5, 3)
    with torch.no_grad():
        expected = full._forward(x, t, context, [5])
    blocks = sum(v.numel() for k, v in source.items() if k.startswith("layers.") and v.ndim == 2)
    for name in ("tagged", "headed"):
        model = load_dit(tmp_path / f"{name}.safetensors", torch.float32)
        weights = [m.weight for n, m in model.named_modules() if n.startswith("layers.") and
                   getattr(m, "weight", None) is not None and m.weight.ndim == 2]
        assert sum(w.numel() * w.element_size() for w in weights) == blocks  # 1 byte each, not 4
        with torch.no_grad():
            ours = model._forward(x, t, context, [5])
        error = ((ours - expected).norm() / expected.norm()).item()
        assert 0 < error < 0.1, name


def test_a_dynamic_model_that_cannot_be_demoted_compiles_nothing_and_says_so(tiny_models, monkeypatch, caplog):
    """A MODEL under dynamic VRAM whose loader left no way to load it again (``cached_patcher_init``): its blocks'
    weights are streamed, so no block is compiled, and the log says why instead of "compiling"."""
    from comfyui_ernie_image.nodes.accel.patching import apply_compile
    from helpers.accel import sample, tiny_patcher
    from helpers.newer_core import DynamicStandIn

    patcher = tiny_patcher(tiny_models["snapshot"])
    monkeypatch.setattr(patcher, "__class__", DynamicStandIn)
    with caplog.at_level(logging.INFO):
        sample(apply_compile(patcher, "default"), steps=1, cfg=1.0)
    assert "ERNIE-Image: compiled 0 of 10 DiT blocks: ComfyUI's dynamic VRAM streams this MODEL's weights" in \
        caplog.text


def test_a_pack_that_swaps_the_dits_forwards_is_refused_in_words(tiny_models):
    """raylight's sequence parallelism replaces the native ERNIE model's ``_forward`` and attention forwards
    (src/raylight/distributed_modules/usp.py @03e199f4); on the pack's DiT that fails deep inside or samples
    without the text mask. Stand-in: the same replacement, made as raylight makes it (``types.MethodType``)."""
    import types

    from comfyui_ernie_image.nodes.errors import ErnieImageError
    from helpers.accel import sample, tiny_patcher

    patcher = tiny_patcher(tiny_models["snapshot"])
    dit = patcher.model.diffusion_model
    dit._forward = types.MethodType(type(dit)._forward, dit)
    with pytest.raises(ErnieImageError, match=r"Another node pack replaced the ERNIE-Image DiT's _forward \(raylight"):
        sample(patcher, steps=1, cfg=1.0)


def test_the_executors_ram_cache_sizes_the_pe_and_the_text_encoder_by_their_weights(comfy_paths, tiny_models):
    """0.3.75's ``--cache-ram`` evicts the outputs with the largest score first, scoring each by ``get_ram_usage()``
    (comfy_execution/caching.py ``RAMPressureCache.poll``); current cores read ``_comfy_cache_tensors()``. The PE
    and the text encoder counted 0 bytes, so the DiT went first."""
    from comfy_execution.caching import CacheKeySetInputSignature, RAMPressureCache

    from comfyui_ernie_image.nodes.pe.comfy_runtime import ComfyRuntime
    from comfyui_ernie_image.nodes.pe.local.enhancer import LocalPromptEnhancer
    from comfyui_ernie_image.nodes.pe.protocol import PromptSpec, SamplingParams
    from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader

    pe = LocalPromptEnhancer.from_path(tiny_models["pe_folder"], runtime=ComfyRuntime())
    with torch.inference_mode():
        pe.enhance([PromptSpec("a cat", 1024, 1024)], SamplingParams(temperature=0.0, max_new_tokens=2))
        (encoder,) = ErnieImageTextEncoderLoader.execute(SNAPSHOT).result
    for output in (pe, encoder):
        expected = sum(t.numel() * t.element_size() for t in output.cache_tensors())
        assert output.get_ram_usage() == expected > 0
        assert sum(t.untyped_storage().nbytes() for t in output._comfy_cache_tensors()) >= expected

    class Order(dict):  # the cache's own dict, recording what the poll evicts, in order
        evicted: list

        def __delitem__(self, key):
            self.evicted.append(key)
            super().__delitem__(key)

    cache = RAMPressureCache(CacheKeySetInputSignature)
    cache.cache, cache.cache.evicted = Order(), []
    for key, outputs in (("image", [[torch.zeros(64, 64, 3)]]), ("pe", [[pe]]), ("text_encoder", [[encoder]])):
        cache.cache[key], cache.used_generation[key], cache.timestamps[key] = (outputs, None), 0, 0.0
    cache.poll(ram_headroom=10 * psutil.virtual_memory().total / 2**30)  # more than this machine has: evict all
    assert set(cache.cache.evicted[:2]) == {"pe", "text_encoder"}, cache.cache.evicted


def test_the_text_encoders_device_input_places_it(comfy_paths):
    from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader

    with torch.inference_mode():
        (encoder,) = ErnieImageTextEncoderLoader.execute(SNAPSHOT, "cpu").result
    assert encoder.patcher.load_device == torch.device("cpu")
    assert ErnieImageTextEncoderLoader.define_schema().inputs[1].optional  # saved workflows without it still load


def test_a_text_encoder_a_card_cannot_hold_runs_on_the_offload_device_and_says_so(comfy_paths, monkeypatch, caplog):
    """Under dynamic VRAM core places text encoders on the GPU whatever the card (model_management.py @02b2b388
    ``text_encoder_device``); the pack's loads whole. Stand-ins for what a CPU cannot show: the ``meta`` device as
    that GPU, and core's total memory of it as a 4 GiB card."""
    import comfy.model_management as mm

    from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader

    monkeypatch.setattr(mm, "text_encoder_device", lambda: torch.device("meta"))
    monkeypatch.setattr(mm, "get_total_memory", lambda dev=None, torch_total_too=False: 4 * 2**30)
    monkeypatch.setattr(mm, "minimum_inference_memory", lambda: 4 * 2**30)  # so that nothing fits on it
    with torch.inference_mode(), caplog.at_level(logging.WARNING):
        (encoder,) = ErnieImageTextEncoderLoader.execute(SNAPSHOT).result
    assert encoder.patcher.load_device == torch.device("cpu")
    assert "ERNIE-Image: the text encoder (0.0 GiB) does not fit on meta" in caplog.text
    assert "it runs on cpu. Its loader's device input picks another device." in caplog.text
