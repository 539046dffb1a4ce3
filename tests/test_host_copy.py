"""A text encoder or PE that ComfyUI unloads between prompts keeps its host copy (``host/host_copy.py``): core's
next load copies from it, and every later unload points the weights at it again instead of copying them back.

Run by a real 0.3.75 core's ``ModelPatcher.load`` and ``detach`` (``WholeModelPatcher``, as the PE and the text
encoder are managed). The GPU's stand-in is the meta device, to which core's moves work and from which nothing can
be copied back: an unload that copied would fail. Core's first unload (a copy from the GPU) is the one step a meta
device cannot give: the test marks it with ``before_unload``, which the patcher calls then (the H200 check runs it).
"""

from __future__ import annotations

import comfy.model_management as mm
import psutil
import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

from comfyui_ernie_image.nodes.dit.gguf import load_gguf_dit
from comfyui_ernie_image.nodes.dit.model import make_model_patcher
from comfyui_ernie_image.nodes.dit.vae import load_vae
from comfyui_ernie_image.nodes.host import gguf_layers, host_copy
from comfyui_ernie_image.nodes.host.gguf_layers import GGUFLinear
from comfyui_ernie_image.nodes.host.patchers import ManagedModule, WholeModelPatcher
from comfyui_ernie_image.nodes.lora.patching import apply_lora
from helpers import lora as lora_helpers
from scripts.gguf_writer import mixed_kind, write_gguf
from scripts.tiny_models import tiny_dit_state

CPU, GPU = torch.device("cpu"), torch.device("meta")


def _patcher() -> tuple[WholeModelPatcher, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    container = ManagedModule(model, CPU)
    return WholeModelPatcher(container, load_device=GPU, offload_device=CPU), container


def _host(module: torch.nn.Module) -> dict[str, tuple[int, torch.Tensor]]:
    return {name: (p.data_ptr(), p.detach().clone()) for name, p in module.named_parameters()}


def test_a_model_unloaded_once_is_loaded_again_from_its_host_copy_and_unloaded_without_a_copy():
    patcher, container = _patcher()
    host_copy.before_unload(container, CPU)  # core's first unload, from the GPU (see the module's docstring)
    kept = {name: p.data_ptr() for name, p in container.named_parameters()}
    patcher.load(GPU, full_load=True)
    assert all(p.device == GPU for p in container.parameters())
    patcher.load(GPU, full_load=True)  # loaded already: nothing kept again
    for _ in range(2):  # each unload and load after the first: the same host tensors, unchanged
        patcher.detach()
        assert all(p.device == CPU for p in container.parameters())
        assert {name: p.data_ptr() for name, p in container.named_parameters()} == kept
        patcher.load(GPU, full_load=True)
    patcher.detach()
    before = _host(container)
    patcher.load(GPU, full_load=True)
    patcher.detach()
    for name, p in container.named_parameters():
        assert torch.equal(p, before[name][1]), name


def test_a_model_never_unloaded_keeps_no_second_copy():
    """A model that stays loaded (resident) holds its weights once: nothing on the host beside the GPU's copy, so
    core's unload must copy them back (from the meta device it cannot: the error shows no host copy was kept)."""
    patcher, container = _patcher()
    patcher.load(GPU, full_load=True)
    with pytest.raises(NotImplementedError, match="meta"):
        patcher.detach()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU (the H200 check runs it)")
def test_on_a_gpu_the_second_load_pins_the_host_copy_and_unloads_copy_nothing_back(monkeypatch):
    """The tests run core in CPU mode (``conftest``), where it pins nothing: its bound is set as a GPU core sets it
    (0.95 of the host RAM in 0.3.75), and core's own ``pin_memory`` registers the copy."""
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", int(0.95 * psutil.virtual_memory().total))
    torch.manual_seed(0)
    container = ManagedModule(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 64)), CPU)
    patcher = WholeModelPatcher(container, load_device=torch.device("cuda"), offload_device=CPU)
    originals = {name: p.detach().clone() for name, p in container.named_parameters()}
    patcher.load(torch.device("cuda"), full_load=True)
    patcher.detach()  # core's first unload: copied back
    patcher.load(torch.device("cuda"), full_load=True)
    patcher.detach()
    kept = {name: p.data_ptr() for name, p in container.named_parameters()}
    assert all(p.is_pinned() for p in container.parameters())
    for _ in range(2):
        patcher.load(torch.device("cuda"), full_load=True)
        assert all(p.is_cuda for p in container.parameters())
        patcher.detach()
        assert {name: p.data_ptr() for name, p in container.named_parameters()} == kept
    for name, p in container.named_parameters():
        assert torch.equal(p, originals[name]), name


def test_a_tensor_subclass_weight_is_kept_by_its_inner_tensors():
    """torchao's quantized weights are tensor subclasses (``TwoTensor``, torch's test wrapper of two tensors, stands
    in for them, as in ``test_quant_lowvram.py``): after an unload the layer's weight is the kept wrapper again, its
    inner tensors the same host memory as before the load."""
    patcher, container = _patcher()
    layer = container.module[0]
    weight = layer.weight.detach()
    layer.weight = torch.nn.Parameter(TwoTensor(weight, weight.clone()), requires_grad=False)
    host_copy.before_unload(container, CPU)  # core's first unload, from the GPU (see the module's docstring)
    inner = (layer.weight.a.data_ptr(), layer.weight.b.data_ptr())
    for _ in range(2):
        patcher.load(GPU, full_load=True)
        assert layer.weight.device == GPU
        patcher.detach()
        assert isinstance(layer.weight, TwoTensor) and layer.weight.device == CPU
        assert (layer.weight.a.data_ptr(), layer.weight.b.data_ptr()) == inner
        assert torch.equal(layer.weight.a, weight)


def test_low_host_ram_keeps_no_copy_fault_injected(monkeypatch):
    """Host RAM this machine cannot run short of (the fault injected: ``spare_host_memory`` answers below what the
    pack leaves to the system): the model keeps no copy, and core's unload copies back as before (from the meta
    device it cannot: the error shows nothing was kept)."""
    monkeypatch.setattr(host_copy, "spare_host_memory", lambda: -1)
    patcher, container = _patcher()
    host_copy.before_unload(container, CPU)
    patcher.load(GPU, full_load=True)
    with pytest.raises(NotImplementedError, match="meta"):
        patcher.detach()


def test_the_host_ram_the_packs_models_hold_counts_each_storage_once_and_the_kept_copies():
    """``held_on_host`` (what the plan may place anew, ``host/plan.host_room``): a tracked model's tensors on the
    host, a storage two of them share once; loaded on the GPU, nothing, or the host copy it keeps where core unloaded
    it once; nothing once it is gone."""
    before = host_copy.held_on_host()
    patcher, container = _patcher()
    model = container.module
    shared = torch.nn.Parameter(model[0].weight.detach().view(-1)[:512].view(8, 64))  # a view of [0]'s storage
    model[2].weight = shared
    weights = sum(t.untyped_storage().nbytes() for t in (model[0].weight, model[0].bias, model[1].weight,
                                                         model[1].bias, model[2].bias))
    host_copy.track(patcher)
    assert host_copy.held_on_host() - before == weights
    patcher.load(GPU, full_load=True)  # resident: nothing left on the host
    assert host_copy.held_on_host() == before
    kept_patcher, kept = _patcher()
    host_copy.track(kept_patcher)
    host_copy.before_unload(kept, CPU)  # core's first unload (see the module's docstring): the next load keeps
    kept_patcher.load(GPU, full_load=True)
    assert all(p.device == GPU for p in kept.parameters())
    assert host_copy.held_on_host() - before == sum(p.untyped_storage().nbytes() for p in _patcher()[1].parameters())
    del patcher, container, model, shared, kept_patcher, kept
    assert host_copy.held_on_host() == before


def test_the_host_ram_counts_the_originals_core_keeps_of_a_loras_weights(tmp_path):
    """Core keeps the original of each weight a LoRA patches on the offload device while the patched one is loaded
    (``ModelPatcher.patch_weight_to_device``'s backup): a GGUF DiT with a LoRA, loaded on the "GPU", still holds the
    patched layers' blocks on the host, which ``held_on_host`` counts; unpatched, they are the layers' own again,
    counted once."""
    before = host_copy.held_on_host()
    plain = make_model_patcher(load_gguf_dit(write_gguf(tmp_path / "dit.gguf", tiny_dit_state(), mixed_kind),
                                             torch.float32))
    patched, report = apply_lora(plain, lora_helpers.lora_file("ai-toolkit", lora_helpers.deltas(
        lora_helpers.LAYERS, 1)), 1.0, "tiny.safetensors")
    assert report.applied == len(lora_helpers.LAYERS), report.text()
    patched.load(GPU, full_load=True)
    assert all(p.device == GPU for p in patched.model.parameters())
    originals = {saved.weight.untyped_storage().data_ptr(): saved.weight.untyped_storage().nbytes()
                 for saved in patched.backup.values()}
    assert len(originals) == len(lora_helpers.LAYERS) and all(
        saved.weight.device == CPU for saved in patched.backup.values())
    assert host_copy.held_on_host() - before == sum(originals.values())
    patched.unpatch_model()  # the originals back in their layers (the others stay on the "GPU")
    assert not patched.backup and host_copy.held_on_host() - before == sum(originals.values())


def test_the_vae_loaded_per_prompt_keeps_its_host_copy_and_core_unloads_it_whole(tiny_models):
    """The pack's VAE is core's ``comfy.sd.VAE``; where the sampler takes its room each prompt, core unloads it
    before sampling and loads it for the decode. After core's first unload it keeps its host copy: every later
    unload copies nothing back (from the meta device nothing could be), and a request for part of its memory frees
    none, so that core unloads it whole (on main core's own patcher copied the weights back each time)."""
    vae = load_vae(tiny_models["vae_file"])
    patcher = vae.patcher
    model = patcher.model
    host_copy.before_unload(model, CPU)  # core's first unload, from the GPU (see the module's docstring)
    kept = {name: p.data_ptr() for name, p in model.named_parameters()}
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    for _ in range(2):
        patcher.load(GPU, full_load=True)
        assert all(p.device == GPU for p in model.parameters())
        assert patcher.partially_unload(CPU, 1) == 0
        patcher.detach()
        assert {name: p.data_ptr() for name, p in model.named_parameters()} == kept
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
    assert host_copy.held_on_host() >= sum(t.nbytes for t in weights.values())


def _gguf_layer() -> tuple[GGUFLinear, torch.Tensor]:
    """A core ``comfy.ops`` linear layer holding Q8_0 blocks, as a GGUF DiT's layers do (their values never read)."""
    layer = GGUFLinear(256, 64)
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (64 * 256 // 32 * 34,), dtype=torch.uint8, generator=generator)
    layer.hold(blocks.clone(), "Q8_0", (64, 256))
    layer.bias = torch.nn.Parameter(torch.zeros(64), requires_grad=False)
    return layer, blocks


def _unloaded_by_copy(layer: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Core's first unload of ``layer``: a copy from the GPU, the step the meta device cannot give (new parameters
    as torch's move from meta makes them)."""
    for name, tensor in tensors.items():
        setattr(layer, name, torch.nn.Parameter(tensor.clone(), requires_grad=False))


def _gguf_dit_layers() -> dict[str, torch.nn.Module]:
    """A GGUF DiT's kinds of layer (``GGUFOperations``): one holding GGUF blocks, a linear layer with a plain weight
    (the file's F16 layers), a norm and the patch embedding's convolution."""
    torch.manual_seed(0)
    plain = gguf_layers.GGUFLinear(32, 16)
    norm = gguf_layers.GGUFOperations.RMSNorm(64, eps=1e-6)
    conv = gguf_layers.GGUFOperations.Conv2d(4, 8, 2, stride=2)
    for layer in (plain, norm, conv):
        for parameter in layer.parameters():
            torch.nn.init.normal_(parameter)
    return dict(gguf=_gguf_layer()[0], plain_linear=plain, norm=norm, conv=conv)


@pytest.mark.parametrize("kind", ["gguf", "plain_linear", "norm", "conv"])
def test_a_gguf_dits_layer_core_loads_again_keeps_its_host_copy_and_unloads_without_a_copy(kind):
    """A layer of a GGUF DiT that core moves to the host and back each prompt (its part of a partial unload before
    the decode on a small card: core unloads the smallest layers first, the norms and plain layers) keeps its host
    copy from its second load on; later unloads point at it (from the meta device nothing could be copied back).
    Before ``KeepsHostCopy`` only the layers holding GGUF blocks did (the norms' and plain layers' 105 MB were
    copied back and forth at the pageable rate each prompt on an 8 GB card with a LoRA, bench/RESULTS.md)."""
    layer = _gguf_dit_layers()[kind]
    tensors = {name: p.detach().clone() for name, p in layer.named_parameters()}
    layer.to(GPU)  # its first load: a layer that stays loaded keeps nothing
    with pytest.raises(NotImplementedError, match="meta"):
        layer.to(CPU)
    _unloaded_by_copy(layer, tensors)
    held = []
    for _ in range(2):
        layer.to(GPU)  # loaded again: its host tensors are kept
        assert all(p.device == GPU for p in layer.parameters())
        layer.to(CPU)  # nothing copied: from the meta device nothing could be
        for name, p in layer.named_parameters():
            assert torch.equal(p, tensors[name]), name
        held.append({name: p.data_ptr() for name, p in layer.named_parameters()})
    assert held[0] == held[1] == {name: host_copy.kept_tensor(layer, name).data_ptr() for name in tensors}
    if kind == "gguf":
        assert layer.gguf_shape == (64, 256)


class _MoveRecorder(torch.nn.Module):
    """A layer whose ``_apply`` records what ``gguf_layers._moves_to`` tells of each move torch asks of it."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, device=device), requires_grad=False)
        self.told = []

    def _apply(self, fn, *args, **kwargs):
        self.told.append(gguf_layers._moves_to(fn, self))
        return super()._apply(fn, *args, **kwargs)


@pytest.mark.parametrize("device", [GPU, pytest.param(torch.device("cuda"), marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a CUDA GPU (the H200 check runs it)"))], ids=["meta", "cuda"])
def test_a_layers_move_is_told_by_where_it_takes_the_layers_tensors(device):
    """``KeepsHostCopy`` acts on a move between the host and the device and on nothing else: a move to the device,
    a move back to the host (told on a real GPU by a probe from the layer's own device, on the meta device by its
    error), and neither a dtype's change there nor a move to where the layer already is."""
    layer = _MoveRecorder(CPU)
    layer.to(CPU)
    layer.to(device)
    layer.to(device)  # already there
    layer.half()
    layer.float()
    if device.type == "meta":
        with pytest.raises(NotImplementedError, match="meta"):
            layer.to(CPU)
    else:
        layer.to(CPU)
        layer.to(CPU, torch.float16)
    told = [None if d is None else d.type for d in layer.told]
    assert told == [None, device.type, None, None, None, "cpu", None][:len(told)]
    assert len(told) == (6 if device.type == "meta" else 7)


def test_a_gguf_layer_keeps_no_copy_when_the_host_ram_is_the_systems_fault_injected(monkeypatch):
    """As for a whole model (``spare_host_memory`` answering below what the pack leaves to the system): the layer's
    unloads copy back as core copies (from the meta device they cannot)."""
    monkeypatch.setattr(host_copy, "spare_host_memory", lambda: -1)
    layer, blocks = _gguf_layer()
    layer.to(GPU)
    _unloaded_by_copy(layer, dict(weight=blocks, bias=torch.zeros(64)))
    layer.to(GPU)
    assert host_copy.kept_tensor(layer, "weight") is None
    with pytest.raises(NotImplementedError, match="meta"):
        layer.to(CPU)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU (the H200 check runs it)")
def test_on_a_gpu_a_gguf_dit_with_a_lora_core_unloads_in_part_reloads_pinned_without_copies_back(tmp_path,
                                                                                                monkeypatch):
    """Core's own ``partially_unload`` and ``partially_load`` (what it does around the VAE's decode on a small card),
    four prompts: the layers it moves hold pinned host tensors (blocks, norms, plain weights) from their second load
    on, a LoRA-patched GGUF layer from its third (core's backup of it holds the blocks it loaded before until then);
    from then on every unload leaves each moved layer on the same host memory (no copy back); the LoRA's factors
    come from pinned copies; the blocks stay the file's."""
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", int(0.95 * psutil.virtual_memory().total))
    cuda = torch.device("cuda")
    model = load_gguf_dit(write_gguf(tmp_path / "dit.gguf", tiny_dit_state(), mixed_kind), torch.float32)
    blocks = {name: layer.weight.detach().clone() for name, layer in model.named_modules()
              if getattr(layer, "gguf_type", None)}
    patcher, report = apply_lora(make_model_patcher(model), lora_helpers.lora_file("ai-toolkit", lora_helpers.deltas(
        lora_helpers.LAYERS, 1)), 1.0, "tiny.safetensors")
    assert report.applied == len(lora_helpers.LAYERS), report.text()
    patcher.load(cuda, full_load=True)
    held = []
    dit = patcher.model.diffusion_model
    for _ in range(4):
        freed = patcher.partially_unload(CPU, patcher.model_size())  # every layer core can move
        assert freed > 0
        layers = {name: layer for name, layer in dit.named_modules() if name in blocks}
        assert all(p.device == CPU for p in dit.parameters())
        held.append({name: p.data_ptr() for name, p in dit.named_parameters()})
        patcher.partially_load(cuda, extra_memory=patcher.model_size())
        assert all(p.is_cuda for p in dit.parameters())
    assert held[2] == held[3]  # every layer: the blocks, and the norms and plain weights beside them
    for name, layer in layers.items():
        kept = host_copy.kept_tensor(layer, "weight")
        assert kept is not None and kept.is_pinned() and torch.equal(kept, blocks[name]), name
    patched_plain = {key.removeprefix("diffusion_model.") for key in patcher.patches
                     if key.removeprefix("diffusion_model.").rpartition(".")[0] not in blocks}
    patcher.partially_unload(CPU, patcher.model_size())
    unpinned = [name for name, p in dit.named_parameters() if not p.is_pinned() and name not in patched_plain]
    assert not unpinned  # a patched plain weight is core's backup: core patches it anew at each load
    patcher.partially_load(cuda, extra_memory=patcher.model_size())
    for name in lora_helpers.LAYERS:
        factors = getattr(layers[name].weight, gguf_layers.FACTORS)
        assert all(t.is_cuda for f in factors for t in f[:2]), name
    patcher.detach()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA GPU (the H200 check runs it)")
def test_on_a_gpu_the_pinned_copy_of_a_lora_factor_counts_in_the_host_ram_held_while_the_factor_lives(monkeypatch):
    """A LoRA factor a GGUF layer loads again each prompt comes from a pinned copy (``pinned_copy``): host RAM beside
    the factor itself, which ``held_on_host`` counts until the factor is gone."""
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", int(0.95 * psutil.virtual_memory().total))
    before = host_copy.held_on_host()
    factor = torch.randn(64, 1024)
    copy = host_copy.pinned_copy(factor)
    assert copy.is_pinned() and copy.data_ptr() != factor.data_ptr() and torch.equal(copy, factor)
    assert host_copy.pinned_copy(factor) is copy  # once per factor
    assert host_copy.held_on_host() - before == copy.untyped_storage().nbytes() >= factor.nbytes
    del factor, copy
    assert host_copy.held_on_host() == before
