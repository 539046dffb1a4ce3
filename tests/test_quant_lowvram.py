"""The load rule of the pack's models under ComfyUI's model management: whole or not at all.

Core's partial ("lowvram") loading moves only some plain torch layers to the GPU and casts none of them, which would
run the DiT or the text encoder across two devices. The ``meta`` device stands in for the GPU here: where a weight
ends up is visible without one.
"""

from __future__ import annotations

import copy
import importlib

import comfy.model_patcher
import pytest
import torch
from diffusers import ErnieImageTransformer2DModel
from torch.overrides import TorchFunctionMode
from torch.testing._internal.two_tensor import TwoTensor

from comfyui_ernie_image.nodes.dit.build import build_diffusion_model
from comfyui_ernie_image.nodes.dit.model import make_model_patcher
from comfyui_ernie_image.nodes.host.memory import usable_memory
from comfyui_ernie_image.nodes.host.patchers import WholeModelPatcher, place
from comfyui_ernie_image.nodes.quant.quantize import quantization_device, quantize_torchao
from comfyui_ernie_image.nodes.text.managed import ManagedTextEncoder
from helpers.faults import OutOfMemoryInAttention, OutOfMemoryOnMoves
from scripts.tiny_models import TINY_DIT

GPU = torch.device("meta")


def tiny_dit():
    """The pack's tiny DiT with diffusers' initial weights."""
    return build_diffusion_model(ErnieImageTransformer2DModel(**TINY_DIT).state_dict(), TINY_DIT, torch.float32)


@pytest.fixture(params=["DiT", "text encoder"])
def patcher(request, tiny_models) -> WholeModelPatcher:
    if request.param == "DiT":
        return make_model_patcher(tiny_dit(), whole=True)  # as quantized DiTs are
    return ManagedTextEncoder.from_snapshot(tiny_models["snapshot"]).patcher


def devices(patcher) -> set[str]:
    return {t.device.type for t in patcher.model.state_dict().values()}


def test_core_partial_loading_would_split_the_model_across_devices(patcher):
    core = comfy.model_patcher.ModelPatcher(patcher.model, patcher.load_device, patcher.offload_device)
    core.load(GPU, lowvram_model_memory=core.model_size() // 2)
    assert devices(core) == {"cpu", "meta"}  # what the rule below prevents


def test_the_model_loads_whole_when_comfyui_offers_part_of_the_memory(patcher):
    assert isinstance(patcher, WholeModelPatcher) and isinstance(patcher.clone(), WholeModelPatcher)
    patcher.load(GPU, lowvram_model_memory=patcher.model_size() // 2)
    assert devices(patcher) == {"meta"}
    assert not patcher.model.model_lowvram and patcher.loaded_size() == patcher.model_size()


def test_the_model_is_never_unloaded_in_part(patcher):
    patcher.load(GPU, lowvram_model_memory=0, full_load=True)
    assert patcher.partially_unload(patcher.offload_device, memory_to_free=patcher.model_size() // 2) == 0
    assert devices(patcher) == {"meta"}  # ComfyUI then unloads the whole model (LoadedModel.model_unload)


def test_fault_injected_out_of_memory_says_what_the_whole_model_needs(patcher):
    """Still an out-of-memory error, so that ComfyUI frees its models as for any other, with what to do (the
    advice for each state: test_oom_advice.py)."""
    with OutOfMemoryOnMoves(), pytest.raises(torch.OutOfMemoryError) as raised:
        patcher.load(GPU, lowvram_model_memory=patcher.model_size() // 2)
    message = str(raised.value)
    name = type(patcher.model).__name__
    assert name in ("ErnieImageModel", "TextEncoderModule")  # as ComfyUI's log names them
    assert message.startswith("ERNIE-Image: the ")
    assert f"({name}) needs {patcher.model_size() / 2**20:.1f} MiB on meta as a whole (it cannot be loaded in part)" \
        in message.splitlines()[0]
    assert "\nNext step" in message
    assert message.endswith("\nCUDA out of memory. Tried to allocate 64.00 MiB")


def test_quantized_weights_count_by_what_they_hold():
    """torchao's quantized weights are wrapper tensors that report the original dtype: ComfyUI's own size estimate
    would count an FP8 DiT as 16 GB. TwoTensor (torch's test wrapper, two tensors inside) stands in for them, and
    it fails as they do (both alias through ``return_and_correct_aliasing``): made outside inference mode, it
    refuses ``detach`` inside it ("Cannot set version_counter for inference tensor", seen with torchao 0.17 on the
    H200), so the size must not come from ``state_dict()``. It is asked under inference mode, as ComfyUI's executor
    runs every node."""
    transformer = tiny_dit()
    plain = make_model_patcher(transformer, whole=True).model_size()
    layer = transformer.layers[0].mlp.gate_proj
    weight = layer.weight.detach()
    layer.weight = torch.nn.Parameter(TwoTensor(weight, weight.clone()), requires_grad=False)
    patcher = make_model_patcher(transformer, whole=True)
    with torch.inference_mode():
        assert patcher.model_size() == plain + weight.nbytes
    assert patcher.clone().model_size() == patcher.model_size()
    assert patcher.model.diffusion_model.dtype == torch.float32
    with torch.inference_mode(), pytest.raises(RuntimeError, match="version_counter"):
        transformer.state_dict()  # what a size from the state dict would meet


class DeviceMoves(TorchFunctionMode):
    """Records, for each ``Tensor.to`` call, whether inference mode was on."""

    def __init__(self):
        super().__init__()
        self.inference_mode: set[bool] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            self.inference_mode.add(torch.is_inference_mode_enabled())
        return func(*args, **(kwargs or {}))


def test_the_dit_moves_outside_inference_mode():
    """ComfyUI loads and unloads models inside inference mode, where torchao's quantized weights cannot change device
    (``nodes/host/patchers.py``): the DiT's moves run outside it."""
    patcher = make_model_patcher(tiny_dit(), whole=True)
    moves = DeviceMoves()
    with torch.inference_mode(), moves:
        patcher.load(GPU)
        assert devices(patcher) == {"meta"} and moves.inference_mode == {False}
        moves.inference_mode.clear()
        patcher.unpatch_model(GPU)  # the unload's move (back to "meta": nothing comes back from it)
    assert moves.inference_mode == {False}


def test_quantization_runs_on_the_gpu_whole_or_one_block_at_a_time_by_comfyuis_free_memory():
    transformer = tiny_dit()
    needed = sum(p.nbytes for p in transformer.parameters()) + 2 * 2**30
    block = max(sum(p.nbytes for p in b.parameters()) for b in transformer.layers)
    gpu = torch.device("cuda", 0)
    assert quantization_device(transformer, gpu, lambda device: needed) == (gpu, False)
    assert quantization_device(transformer, gpu, lambda device: needed - 1) == (gpu, True)
    assert quantization_device(transformer, gpu, lambda device: 2 * block + 2 * 2**30) == (gpu, True)
    assert quantization_device(transformer, gpu, lambda device: 2 * block + 2 * 2**30 - 1) == (torch.device("cpu"),
                                                                                              False)
    assert quantization_device(transformer, torch.device("cpu"), lambda device: 0) == (torch.device("cpu"), False)


def test_one_block_at_a_time_quantizes_as_the_whole_dit_cuda_platform_stood_in(monkeypatch):
    """cache-dit quantizes the DiT's blocks with one configuration and filter; given one block, the same layers and
    values come out. On the CPU (torchao quantizes CPU tensors as it does on the GPU), with cache-dit's check that a
    CUDA platform exists stood in for: it asserts one before quantizing on any device. int8_weight_only: torchao's
    FP8 asserts an sm89+ GPU itself; the block-by-block path is the same for every method (the GPU check runs FP8
    through it on an emulated 16 GB card)."""
    quant_type = "int8_weight_only"
    quantize_ao = importlib.import_module("cache_dit.quantization.torchao.quantize_ao")  # the package re-exports a
    # function by the module's name

    monkeypatch.setattr(quantize_ao.current_platform, "is_accelerator_available", lambda: True)
    monkeypatch.setattr(quantize_ao.current_platform, "device_type", "cuda")
    pauses = []  # cache-dit's 2 s pause after each quantize call (utils.maybe_empty_cache), counted instead
    monkeypatch.setattr(quantize_ao, "maybe_empty_cache", lambda: pauses.append(1))
    whole = tiny_dit().to(torch.bfloat16)
    blocks = copy.deepcopy(whole)
    quantize_torchao(whole, quant_type, torch.device("cpu"))
    quantize_torchao(blocks, quant_type, torch.device("cpu"), per_block=True)
    assert len(pauses) == 2  # one per model, not one per block (the 16 GB card's first run lost 104 s to them)
    quantized = {name: type(p) for name, p in whole.named_parameters() if type(p) is not torch.nn.Parameter}
    assert quantized and all(name.startswith("layers.") for name in quantized)
    assert {name: type(p) for name, p in blocks.named_parameters() if type(p) is not torch.nn.Parameter} == quantized
    for (name, a), b in zip(whole.state_dict().items(), blocks.state_dict().values(), strict=True):
        assert torch.equal(a.dequantize() if name in quantized else a, b.dequantize() if name in quantized else b)
    assert blocks._quantize_type == whole._quantize_type == quant_type  # cache-dit's marks on the whole DiT


def test_usable_memory_is_comfyuis_free_memory_less_its_reserve(monkeypatch):
    """What an emulated or real smaller card shows through ComfyUI (``--reserve-vram``), which the driver's free
    memory does not."""
    import comfy.model_management as mm

    monkeypatch.setattr(mm, "EXTRA_RESERVED_VRAM", 3 * 2**30)
    cpu = torch.device("cpu")
    assert abs(usable_memory(cpu) - (mm.get_free_memory(cpu) - 3 * 2**30)) < 2**26  # the free memory moves a little



def test_models_are_placed_outside_inference_mode_and_only_when_elsewhere():
    """Making the MODEL moved an FP8 DiT inside inference mode to where it already was, which failed on the H200
    ("Couldn't swap Linear.weight": the move detaches each torchao weight, refused there); the CPU cannot run
    torchao's path, so the moves themselves are watched."""
    transformer = tiny_dit()
    moves = DeviceMoves()
    with torch.inference_mode(), moves:
        make_model_patcher(transformer)  # the weights are on the offload device (the CPU) already
        assert moves.inference_mode == set()
        place(transformer, GPU)
    assert moves.inference_mode == {False} and {p.device.type for p in transformer.parameters()} == {"meta"}


def test_fault_injected_out_of_memory_while_sampling_says_how_to_make_room(tiny_models):
    """As the Cache-DiT workflow on an emulated 16 GB card did on the H200 (the bf16 DiT fits, its caches not): an
    out-of-memory error still, the advice first (each state's: test_oom_advice.py)."""
    from helpers.accel import sample, tiny_patcher

    with OutOfMemoryInAttention(), pytest.raises(torch.OutOfMemoryError) as raised:
        sample(tiny_patcher(tiny_models["snapshot"]), steps=1)
    message = str(raised.value)
    assert message.startswith("ERNIE-Image: sampling a 128×128 image ran out of memory on cpu: the step needs about ")
    assert "Chosen: DiT quantization none, weight_dtype fp32" in message
    assert message.endswith("\nCUDA out of memory. Tried to allocate 198.00 MiB")
