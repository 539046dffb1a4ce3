"""Core's layers holding GGUF weights in their blocks, and the patcher that keeps LoRAs off those blocks.

The model of this is ComfyUI-GGUF (city96): a linear layer keeps its weight as the file's blocks and decodes it on
the device where it runs, at every call (``gguf/dequant.py``); LoRA patches are applied to that decoded weight, never
merged into the 4-bit blocks. What differs: the blocks are a plain uint8 tensor (the layer keeps the type and the
true shape), so that core's model management moves, pins, sizes and streams them as any weight:

- **Partial loading**: the layers are ``comfy.ops`` layers, so where the card is too small, core leaves some of them
  on the offload device (``ModelPatcher.load(lowvram_model_memory=…)``); their blocks travel to the GPU at each call
  and are decoded there: 4.5 bits a weight cross the bus instead of 16. A layer core unloads for another model's
  room and loads again each prompt keeps its host copy, pinned (``KeepsHostCopy``): its blocks, and the norms and
  plain weights of the layers beside them.
- **LoRA**: core's patches reach a decoded weight two ways. A layer core loaded whole gets its patches through
  ``patch_weight_to_device``, which ``GGUFModelPatcher`` turns into a new parameter over the same blocks carrying
  the patches, the original kept as core's backup: every way core restores a weight (unpatching, partial unloading)
  takes the patches off with it. A streamed layer gets core's own ``LowVramPatch`` in its ``weight_function``, which
  the layer applies to the decoded weight, as core's cast path does.
- **LoRA factors on the device**: where a loaded layer's patches are all core's plain LoRA (``host.lora``'s
  ``plain_lora_factors``), the new parameter carries their factors copied to the device the layer loads to, and the
  scale ``strength · alpha / rank`` as a float32 tensor there (``LoraFactors``); the layer adds ``scale · (x @
  down.T) @ up.T`` to its output, as PEFT's unmerged LoRA layer does in diffusers (``lora_output``), not the change
  to its weight: a weight decoded at every call would take an [out, in] product written and read per call. So
  the pack's compile traces the block with the LoRA, the strength an input rather than a constant (a new strength
  compiles nothing), and no patch crosses the bus per prompt (ComfyUI-GGUF's ``patch_on_device`` keeps them there
  too). Unlike there, the patcher counts them in the layer's and the model's size (``lora_patch_bytes``), so core
  plans its loads with room for them. Other adapters (LoHa, LoKr, DoRA, diffs) stay on the CPU and go through core's
  ``calculate_weight`` at each call, eager.

Weights read from the file as plain numbers (norms, biases, an F16 layer) are held as computed, in core's layers
as usual. The patcher is core's classic one, also where the core has dynamic VRAM (not tried with GGUF).
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import comfy.lora
import comfy.model_management as mm
import comfy.model_patcher
import comfy.ops
import comfy.utils
import torch
import torch.nn.functional as F

from ..gguf.dequant import dequantize
from . import host_copy
from .lora import plain_lora_factors
from .patchers import CoreBackup

PATCHES = "gguf_patches"  # the attribute of a patched weight parameter: (core's patch list, its key)
FACTORS = "gguf_lora_factors"  # the attribute of a patched weight parameter: its LoraFactors, on the device


class LoraFactors(NamedTuple):
    """One plain LoRA on a GGUF weight, as the layer adds it: ``scale · (up @ down)``; ``scale`` is a 0-d float32
    tensor, so that dynamo takes the strength as an input."""

    up: torch.Tensor  # [out, rank], as the file stores it
    down: torch.Tensor  # [rank, in]
    scale: torch.Tensor


def lora_output(input: torch.Tensor, factors: tuple[LoraFactors, ...]) -> torch.Tensor:
    """What the LoRAs add to the layer's output for ``input``: the sum of ``scale · (input @ down.T) @ up.T``, the
    scale folded into ``up`` in float32. Core merges ``scale · (up @ down)`` into the weight instead; the two differ
    by the rounding of the merged weight (``test_lora_gguf_compiled`` holds this within core's own distance from the
    exact result). With a GGUF weight decoded at each call, merging would write and read an [out, in] product per
    call (bench/RESULTS.md, 2026-12-05: 0.21 s of a 1.24 s prompt at true size); this adds two products of ``rank``
    columns. Half precision computes it in float32: a ``down`` of tiny numbers underflows there and a scaled ``up``
    can pass 65504."""
    dtype = torch.float32 if input.dtype == torch.float16 else input.dtype
    x = input.to(dtype)
    added = None
    for up, down, scale in factors:
        scaled_up = (scale.to(input.device) * up.to(input.device, torch.float32)).to(dtype)
        term = F.linear(F.linear(x, down.to(input.device, dtype)), scaled_up)
        added = term if added is None else added + term
    return added


def _every_op() -> None:
    """Core's per-layer hook (the interrupt check), where the core has it."""
    hook = getattr(comfy.ops, "run_every_op", None)
    if hook is not None:
        hook()


def _moves_to(fn, layer: torch.nn.Module) -> torch.device | None:
    """The device ``Module._apply``'s ``fn`` moves ``layer``'s own tensors to (``.to(device)``), or None where it
    moves none (a dtype's change, or a move to where the layer's tensors all are), told by empty tensors: one on the
    host, which any move takes to its device; where that stays on the host, one on the device of a parameter
    elsewhere, which only a move to the host brings back. Not a probe on the meta device for every layer: a move to
    the host tells itself there by raising, 25 µs a layer against 4.2 on the H100 machine's CPU (bench/RESULTS.md,
    2026-12-06), on a GGUF DiT's 600 layers at each unload."""
    device = fn(torch.empty(0, dtype=torch.uint8)).device
    if device.type != "cpu":
        return device if any(p.device != device for p in layer.parameters(recurse=False)) else None
    away = next((p.device for p in layer.parameters(recurse=False) if p.device.type != "cpu"), None)
    if away is None:
        return None
    try:
        return device if fn(torch.empty(0, dtype=torch.uint8, device=away)).device.type == "cpu" else None
    except NotImplementedError:  # "Cannot copy out of meta tensor": a move to the host (the CPU tests' GPU)
        return device


class KeepsHostCopy:
    """A layer of a GGUF DiT whose host tensors never change (blocks, norms, plain weights read from the file: a LoRA is
    added beside the blocks, and core patches a plain weight into a new tensor on the device, its original in core's
    backup, as the pack's patcher never patches in place: ``weight_inplace_update`` stays False). A move between the
    host and the GPU keeps the layer's host copy once core has moved it back and forth
    (``host_copy.before_layer_move``): core unloads the smallest layers first, so the norms and plain layers are most of
    what a partial unload before the decode copies at the pageable rate."""

    def _apply(self, fn, *args, **kwargs):
        device = _moves_to(fn, self)
        if device is not None:
            host_copy.before_layer_move(self, device)
        return super()._apply(fn, *args, **kwargs)


class GGUFLinear(KeepsHostCopy, comfy.ops.disable_weight_init.Linear):
    """A linear layer of core's whose weight may be GGUF blocks (``hold``); with a plain weight it is core's."""

    gguf_type: str | None = None  # the weight's GGUF type ("Q4_K"); None: a plain weight
    gguf_shape: tuple[int, ...] = ()

    def hold(self, blocks: torch.Tensor, kind: str, shape: tuple[int, ...]) -> None:
        """Keep ``blocks`` (uint8) of GGUF type ``kind`` as this layer's weight of ``shape``."""
        self.weight = torch.nn.Parameter(blocks, requires_grad=False)
        self.gguf_type, self.gguf_shape = kind, tuple(shape)

    @property
    def patches_per_call(self) -> bool:
        """Whether a LoRA reaches the decoded weight through core's ``calculate_weight`` at each call (adapters
        other than plain LoRA), or from another device than the blocks': the pack's compile leaves such a block
        eager, as core's streamed layers (a patch's strength is a constant to dynamo: each one would recompile)."""
        factors = getattr(self.weight, FACTORS, ())
        return (getattr(self.weight, PATCHES, None) is not None
                or any(t.device != self.weight.device for f in factors for t in f))

    def decoded_weight(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The weight on ``device`` in ``dtype``, with the patches core gave it per call (``patches_per_call``); a
        plain LoRA's factors are not in it: ``forward`` adds them to the output."""
        blocks = self.weight.to(device, non_blocking=mm.device_supports_non_blocking(device))
        weight = dequantize(blocks, self.gguf_type, self.gguf_shape, dtype)
        patches = getattr(self.weight, PATCHES, None)
        if patches is not None:
            weight = comfy.lora.calculate_weight(patches[0], weight, patches[1])
        for function in self.weight_function:  # core's LowVramPatch on a streamed layer
            weight = function(weight)
        return weight

    def _apply(self, fn, *args, **kwargs):
        """``Module._apply`` (``.to()``, as core moves a layer), keeping the patches on the weight: torch keeps the
        parameter object only where the devices' tensors are alike (CPU and CUDA, not ``meta``; and not with
        ``torch.__future__``'s overwrite of parameters on conversion)."""
        carried = {name: getattr(self.weight, name) for name in (PATCHES, FACTORS) if hasattr(self.weight, name)}
        module = super()._apply(fn, *args, **kwargs)
        for name, value in carried.items():
            setattr(self.weight, name, value)
        return module

    def forward(self, input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.gguf_type is None:
            return super().forward(input, *args, **kwargs)
        _every_op()
        bias = None
        if self.bias is not None:
            bias = self.bias.to(input.device, input.dtype)
            for function in self.bias_function:
                bias = function(bias)
        output = F.linear(input, self.decoded_weight(input.dtype, input.device), bias)
        factors = getattr(self.weight, FACTORS, None)
        if factors:
            output = output + lora_output(input, factors).to(output.dtype)
        return output


class GGUFOperations(comfy.ops.disable_weight_init):
    """Core's layers as for weights held as computed, with linear layers that may hold GGUF blocks; every layer
    keeps its host copy once core moves it back and forth (``KeepsHostCopy``)."""

    Linear = GGUFLinear

    class Conv2d(KeepsHostCopy, comfy.ops.disable_weight_init.Conv2d):
        pass

    class RMSNorm(KeepsHostCopy, comfy.ops.disable_weight_init.RMSNorm):
        pass


def weight_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape as the model computes with it: a GGUF weight's true shape, not its blocks'."""
    shapes = {name: tuple(p.shape) for name, p in module.named_parameters()}
    for name, layer in module.named_modules():
        if getattr(layer, "gguf_type", None) is not None:
            shapes[f"{name}.weight" if name else "weight"] = layer.gguf_shape
    return shapes


def held_types(module: torch.nn.Module) -> collections.Counter:
    """How many layers hold their weight in each GGUF type."""
    return collections.Counter(layer.gguf_type for layer in module.modules() if getattr(layer, "gguf_type", None))


def _gguf_layer(model: torch.nn.Module, key: str) -> GGUFLinear | None:
    """The GGUF layer whose weight ``key`` names, or None."""
    layer_name, _, name = key.rpartition(".")
    layer = comfy.utils.get_attr(model, layer_name) if name == "weight" else None
    return layer if getattr(layer, "gguf_type", None) is not None else None


def _factor_bytes(patcher: comfy.model_patcher.ModelPatcher, key: str) -> int:
    """The bytes of the LoRA factors the weight ``key`` holds on the device once loaded (0: none there)."""
    layer = _gguf_layer(patcher.model, key)
    triples = plain_lora_factors(patcher.patches[key], layer.gguf_shape) if layer is not None else None
    return sum(up.nbytes + down.nbytes for up, down, _ in triples or ())


def lora_patch_bytes(patcher: comfy.model_patcher.ModelPatcher) -> int:
    """The bytes of the LoRA factors a GGUF DiT's patcher loads beside its blocks (the 4-byte scales aside), which
    its ``model_size()`` counts; 0 without a LoRA, or for a patcher of another DiT."""
    if not isinstance(patcher, GGUFModelPatcher):
        return 0
    return sum(_factor_bytes(patcher, key) for key in patcher.patches)


class GGUFModelPatcher(comfy.model_patcher.ModelPatcher):
    """Core's patcher, but a LoRA patch on a GGUF weight is kept beside its blocks and applied to the decoded weight
    at each call, not merged into the blocks (core's merge would add the LoRA to the bytes); a plain LoRA's factors
    load with the layer and count in its size."""

    def model_size(self) -> int:
        return super().model_size() + lora_patch_bytes(self)

    def clone(self, *args, **kwargs):
        clone = super().clone(*args, **kwargs)
        clone.size = super().model_size()  # the weights alone (core hands a clone its size): each adds its own LoRA
        return clone

    def _load_list(self, *args, **kwargs):
        """Core's list of the layers to load, each GGUF layer's size with its LoRA factors: core's budget for a
        partial load, and its count of the memory loaded, hold them. Its items end ``(…, module_mem, name, module,
        params)`` in 0.3.75 and later cores alike."""
        loading = super()._load_list(*args, **kwargs)
        extra = collections.Counter()
        for key in self.patches:
            extra[key.rpartition(".")[0]] += _factor_bytes(self, key)
        for i, item in enumerate(loading):
            if extra.get(item[-3]):
                values = list(item)
                values[-4] += extra[item[-3]]
                loading[i] = item._make(values) if hasattr(item, "_make") else tuple(values)
        return loading

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False, **kwargs):
        layer = _gguf_layer(self.model, key) if key in self.patches else None
        if layer is None:
            return super().patch_weight_to_device(key, device_to, inplace_update, **kwargs)
        # Outside inference mode: a parameter made inside it could not be moved to another device later.
        with torch.inference_mode(False):
            if key not in self.backup:
                self.backup[key] = CoreBackup(layer.weight, False)
            original = self.backup[key].weight
            kept = host_copy.kept_tensor(layer, "weight")  # the same blocks, pinned: the copy core loaded before
            if kept is not None and original.device == kept.device and original.data_ptr() != kept.data_ptr():
                original.data = kept
            blocks = original.data
            patched = torch.nn.Parameter(blocks, requires_grad=False)  # the same blocks
            triples = plain_lora_factors(self.patches[key], layer.gguf_shape)
            if triples is None:
                setattr(patched, PATCHES, (self.patches[key], key))
            else:
                device = blocks.device if device_to is None else device_to
                # A layer core loads again each prompt (it keeps its host copy) loads its factors from pinned copies.
                source = host_copy.pinned_copy if kept is not None else (lambda factor: factor)
                setattr(patched, FACTORS, tuple(
                    LoraFactors(source(up).to(device), source(down).to(device),
                                torch.tensor(scale, dtype=torch.float32, device=device))
                    for up, down, scale in triples))
            layer.weight = patched
