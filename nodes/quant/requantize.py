"""LoRAs on a torchao-quantized DiT: a layer's original weights, read again from the DiT's file, and the same
torchao method applied to the merged weights (engine: no ComfyUI here; ``host/patchers.py`` merges and swaps).

torchao's weights are tensor subclasses that ComfyUI's patching cannot add a LoRA's delta to. The quantized DiT
keeps a ``Requantizer`` (``load_quantized_dit`` sets it): for each layer a LoRA patches, the weights as the loader
had them before quantizing come from the file (memory mapped, one tensor at a time; no plain copy of the DiT is
kept), and the patched result is quantized as the loader quantized the rest.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model_files import read_safetensors
from ..quant_layout import SCALED_MARKER, QuantLayers, fold_quantization, split_quantization

# Each released key of the DiT's file(s) → (the file, the tensor's name there), and the header metadata: what
# ``dit.weights.tensor_locations`` gives for the path the loader read (the loaders pass it in).
Locations = tuple[dict[str, tuple[Path, str]], dict]


def unbind_reprs(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` without the ``extra_repr`` that torchao's ``quantize_`` gives each layer it quantizes: a method
    bound to the layer, kept in the layer's own ``__dict__``, so a reference cycle that keeps the layer and its
    quantized weight alive after their last user until Python's garbage collection. ComfyUI's server collects at
    most every 10 s, after a prompt (main.py ``prompt_worker``, 0.3.75 and upstream @02018c7e), so a DiT quantized
    at load left 7.35 GiB allocated on the GPU into the next graph's first prompt, whose plan saw that much
    less of the card (H100, bench/RESULTS.md session 42). The layer's class prints it instead."""
    for layer in module.modules():
        bound = vars(layer).get("extra_repr")
        if isinstance(bound, types.MethodType) and bound.__self__ is layer:
            del vars(layer)["extra_repr"]
    return module


@dataclass(frozen=True)
class Requantizer:
    """How a torchao-quantized DiT's layers are made again: from ``source`` (the file or folder the loader read),
    in ``dtype`` (what the loader quantized from), with cache-dit's torchao method ``quant_type``; ``locate(source)``
    says where its tensors lie (``dit.weights.tensor_locations``, which knows the DiT's layouts)."""

    source: Path
    quant_type: str
    dtype: torch.dtype
    locate: Callable[[Path], Locations] = field(compare=False, repr=False)

    @staticmethod
    def holds(weight: torch.Tensor) -> bool:
        """Whether ``weight`` is one of torchao's quantized weights (a layer this makes again)."""
        from torchao.utils import TorchAOBaseTensor

        return isinstance(weight, TorchAOBaseTensor)

    @functools.cached_property
    def _index(self) -> Locations:
        """Read from the headers once, at the first patched layer."""
        return self.locate(self.source)

    def original(self, key: str) -> torch.Tensor:
        """The weight ``key`` (a released key: ``layers.0.mlp.gate_proj.weight``) as the loader held it before
        quantizing: read alone from the file, an fp8 file's scale multiplied in as the loader does, in ``dtype``."""
        where, metadata = self._index
        layer = key.rsplit(".", 1)[0]
        # The layer's own tensors (its weight and, in an fp8 file, its scales and configuration), read as the
        # loader reads them, so that its quantization layout is folded by the same code.
        names = [n for n in where if n.startswith(layer + ".") and n.count(".") == key.count(".")]
        names += [SCALED_MARKER] * (SCALED_MARKER in where)
        tensors = {n: read_safetensors(where[n][0], [where[n][1]])[where[n][1]] for n in names}
        weights, quantized = split_quantization(tensors, metadata)
        if layer in quantized.layers:  # a header's layout names every layer of the file: this one alone here
            weights = fold_quantization(weights, QuantLayers({layer: quantized.layers[layer]}), self.dtype)
        return weights[key].to(self.dtype)

    def quantized(self, weight: torch.Tensor) -> torch.nn.Parameter:
        """``weight`` (``[out, in]``) in ``dtype``, quantized with the DiT's method on the device it is on: the
        parameter to put in place of the layer's weight."""
        from cache_dit.quantization.torchao.quantize_ao import _get_torchao_config, _patch_torchao_zero_row_scale
        from torchao.quantization import quantize_

        # cache-dit's own table of torchao configurations and its fix for all-zero rows (their scale would be 0),
        # as its quantize() applies them to the whole DiT: the layer made again is quantized exactly as the others.
        _patch_torchao_zero_row_scale()
        with torch.device("meta"):
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight = torch.nn.Parameter(weight.to(self.dtype), requires_grad=False)
        quantize_(linear, _get_torchao_config(self.quant_type))
        return unbind_reprs(linear).weight  # the layer, not kept, goes at once: not its weight with it later
