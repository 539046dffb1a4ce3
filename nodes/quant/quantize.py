"""Quantize the ERNIE-Image DiT at load time with cache-dit (engine: no ComfyUI here).

- ``fp8_per_row``, ``fp8_weight_only``, ``int8_weight_only``: cache-dit's torchao path, at every load: seconds on
  the GPU when the whole bf16 DiT fits there, else on the CPU (slower, no GPU memory).
- ``svdq_*_dq``: cache-dit's dynamic SVDQuant W4A4 (no calibration data); minutes, so the result is saved
  (``svdq_cache``) and reloaded with ``cache_dit.load`` next time.

Only the linear layers of the 36 transformer blocks are quantized: the embeddings, the shared modulation and the
final layers keep the weights' dtype, as cache-dit's regional quantization does by default.

A torchao DiT takes LoRAs: each patched layer is quantized again from the file's weights with the LoRA merged
(``requantize``); an SVDQuant DiT does not (its layers are a low-rank branch beside 4-bit weights, made in minutes).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..model_files import builds_weights
from .capability import METHODS, probe, require
from .requantize import Locations, Requantizer
from .svdq_cache import SVDQCache

_HEADROOM = 2 * 2**30  # GPU memory left for quantizing one layer beside the whole bf16 DiT
# What cache_dit.load raises on a saved file that does not fit (damaged past its header, another layout).
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, TypeError, KeyError, SafetensorError)


@builds_weights  # torchao's and SVDQuant's layers too
def load_quantized_dit(
    load: Callable[[], torch.nn.Module],
    method: str,
    *,
    source: Path,
    locate: Callable[[Path], Locations],
    dtype: torch.dtype,
    device: torch.device,
    free_memory: Callable[[torch.device], int],
    cache_root: Path,
) -> torch.nn.Module:
    """The DiT that ``load()`` reads from ``source`` (in ``dtype``), quantized with ``method`` on ``device``.

    The capability check runs first: a method that cannot run here fails before any weights are read.
    ``free_memory(device)`` is the memory the host lets a model use there now; SVDQuant results are kept under
    ``cache_root``. ``locate(source)`` says where the DiT's tensors lie there, for LoRAs on a torchao DiT.
    """
    spec = METHODS[method]
    if not spec.quantizes:
        return load()
    require(method, probe(device), dtype)
    if spec.backend == "torchao":
        transformer = load()
        on = quantization_device(transformer, device, free_memory) if spec.whole_on_gpu_if_it_fits else device
        quantize_torchao(transformer, spec.quant_type, on)
        # How a LoRA's patched layers are made again (host/patchers.py): from the file, as these were.
        transformer.requantizer = Requantizer(source, spec.quant_type, dtype, locate)
        return transformer
    return load_or_build_svdq(load, spec.quant_type, source=source, device=device, cache=SVDQCache(cache_root))


def quantization_device(
    transformer: torch.nn.Module, device: torch.device, free_memory: Callable[[torch.device], int]
) -> torch.device:
    """``device`` when the whole DiT fits in ``free_memory(device)`` (seconds), else the CPU (slower, no GPU memory).

    The free memory is what the host's memory management offers, not the driver's: ComfyUI keeps a reserve
    (``--reserve-vram``) that a smaller card would not have at all."""
    if device.type != "cuda":
        return device
    needed = sum(p.nbytes for p in transformer.parameters()) + _HEADROOM
    return device if free_memory(device) >= needed else torch.device("cpu")


def quantize_torchao(transformer: torch.nn.Module, quant_type: str, on: torch.device) -> torch.nn.Module:
    """Quantize the transformer blocks' linear layers in place with cache-dit's torchao path, computing on ``on``;
    the weights then go back where they were."""
    from cache_dit import QuantizeConfig, quantize

    home = next(transformer.parameters()).device
    start = time.perf_counter()
    # Outside the inference mode ComfyUI runs nodes in: torchao's weights cannot change device inside it
    # (``host/patchers.py`` says why).
    with torch.inference_mode(False):
        quantize(transformer.to(on), QuantizeConfig(quant_type=quant_type))
        transformer.to(home)
    logging.info("ERNIE-Image: quantized the DiT to %s on %s in %.1f s", quant_type, on, time.perf_counter() - start)
    return transformer


def load_or_build_svdq(
    load: Callable[[], torch.nn.Module],
    quant_type: str,
    *,
    source: Path,
    device: torch.device,
    cache: SVDQCache,
) -> torch.nn.Module:
    """The DiT quantized with SVDQuant ``quant_type``: reloaded from ``cache`` when a usable copy is saved there,
    else quantized (each layer's decomposition on ``device``, the result kept on the CPU) and saved."""
    import cache_dit

    versions = {"cache_dit": cache_dit.__version__}
    saved = cache.lookup(source, quant_type, versions)
    if saved is not None:
        try:
            return cache_dit.load(load(), str(saved))
        except _LOAD_ERRORS as e:
            logging.warning("ERNIE-Image: cannot load the saved SVDQuant DiT %s (%s); quantizing again", saved, e)
            cache.discard(source, quant_type)
    svdq_kwargs = {"quantize_device": device.type, "offload_quantized_layers_to_cpu": True}
    start = time.perf_counter()
    with cache.build(source, quant_type, versions) as folder:
        config = cache_dit.QuantizeConfig(quant_type=quant_type, serialize_to=str(folder), svdq_kwargs=svdq_kwargs)
        transformer = cache_dit.quantize(load(), config)
    logging.info("ERNIE-Image: quantized the DiT to %s in %.0f s, saved as %s", quant_type,
                 time.perf_counter() - start, cache.entry(source, quant_type))
    return transformer
