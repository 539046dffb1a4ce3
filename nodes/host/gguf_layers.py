"""Core's layers holding GGUF weights in their blocks, and the patcher that keeps LoRAs off those blocks.

The model of this is ComfyUI-GGUF (city96): a linear layer keeps its weight as the file's blocks and decodes it on
the device where it runs, at every call (``gguf/dequant.py``); LoRA patches are applied to that decoded weight, never
merged into the 4-bit blocks. What differs: the blocks are a plain uint8 tensor (the layer keeps the type and the
true shape), so that core's model management moves, pins, sizes and streams them as any weight:

- **Partial loading**: the layers are ``comfy.ops`` layers, so where the card is too small, core leaves some of them
  on the offload device (``ModelPatcher.load(lowvram_model_memory=…)``); their blocks travel to the GPU at each call
  and are decoded there: 4.5 bits a weight cross the bus instead of 16.
- **LoRA**: core's patches reach a decoded weight two ways. A layer core loaded whole gets its patches through
  ``patch_weight_to_device``, which ``GGUFModelPatcher`` turns into a new parameter over the same blocks carrying
  the patches, the original kept as core's backup: every way core restores a weight (unpatching, partial unloading)
  takes the patches off with it. A streamed layer gets core's own ``LowVramPatch`` in its ``weight_function``, which
  the layer applies to the decoded weight, as core's cast path does.

Weights read from the file as plain numbers (norms, biases, an F16 layer) are held as computed, in core's layers
as usual. The patcher is core's classic one, also where the core has dynamic VRAM (not tried with GGUF).
"""

from __future__ import annotations

import collections

import comfy.lora
import comfy.model_management as mm
import comfy.model_patcher
import comfy.ops
import comfy.utils
import torch
import torch.nn.functional as F

from ..gguf.dequant import dequantize

_Backup = collections.namedtuple("Dimension", ["weight", "inplace_update"])  # core's backup record, as it makes them
PATCHES = "gguf_patches"  # the attribute of a patched weight parameter: (core's patch list, its key)


def _every_op() -> None:
    """Core's per-layer hook (the interrupt check), where the core has it."""
    hook = getattr(comfy.ops, "run_every_op", None)
    if hook is not None:
        hook()


class GGUFLinear(comfy.ops.disable_weight_init.Linear):
    """A linear layer of core's whose weight may be GGUF blocks (``hold``); with a plain weight it is core's."""

    gguf_type: str | None = None  # the weight's GGUF type ("Q4_K"); None: a plain weight
    gguf_shape: tuple[int, ...] = ()

    def hold(self, blocks: torch.Tensor, kind: str, shape: tuple[int, ...]) -> None:
        """Keep ``blocks`` (uint8) of GGUF type ``kind`` as this layer's weight of ``shape``."""
        self.weight = torch.nn.Parameter(blocks, requires_grad=False)
        self.gguf_type, self.gguf_shape = kind, tuple(shape)

    @property
    def patches_per_call(self) -> bool:
        """Whether a LoRA is applied to the decoded weight at each call: the pack's compile leaves such a block
        eager, as core's streamed layers (a patch's strength is a constant to dynamo: each one would recompile)."""
        return getattr(self.weight, PATCHES, None) is not None

    def decoded_weight(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The weight on ``device`` in ``dtype``, with the LoRA patches core gave it."""
        blocks = self.weight.to(device, non_blocking=mm.device_supports_non_blocking(device))
        weight = dequantize(blocks, self.gguf_type, self.gguf_shape, dtype)
        patches = getattr(self.weight, PATCHES, None)
        if patches is not None:
            weight = comfy.lora.calculate_weight(patches[0], weight, patches[1])
        for function in self.weight_function:  # core's LowVramPatch on a streamed layer
            weight = function(weight)
        return weight

    def forward(self, input: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if self.gguf_type is None:
            return super().forward(input, *args, **kwargs)
        _every_op()
        bias = None
        if self.bias is not None:
            bias = self.bias.to(input.device, input.dtype)
            for function in self.bias_function:
                bias = function(bias)
        return F.linear(input, self.decoded_weight(input.dtype, input.device), bias)


class GGUFOperations(comfy.ops.disable_weight_init):
    """Core's layers as for weights held as computed, with linear layers that may hold GGUF blocks."""

    Linear = GGUFLinear


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


class GGUFModelPatcher(comfy.model_patcher.ModelPatcher):
    """Core's patcher, but a LoRA patch on a GGUF weight is kept beside its blocks and applied to the decoded weight
    at each call, not merged into the blocks (core's merge would add the LoRA to the bytes)."""

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False, **kwargs):
        layer_name, _, name = key.rpartition(".")
        layer = comfy.utils.get_attr(self.model, layer_name) if key in self.patches else None
        if name != "weight" or getattr(layer, "gguf_type", None) is None:
            return super().patch_weight_to_device(key, device_to, inplace_update, **kwargs)
        # Outside inference mode: a parameter made inside it could not be moved to another device later.
        with torch.inference_mode(False):
            if key not in self.backup:
                self.backup[key] = _Backup(layer.weight, False)
            patched = torch.nn.Parameter(self.backup[key].weight.data, requires_grad=False)  # the same blocks
            setattr(patched, PATCHES, (self.patches[key], key))
            layer.weight = patched
