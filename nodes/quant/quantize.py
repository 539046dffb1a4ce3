"""Quantize the ERNIE-Image DiT at load time with cache-dit (engine: no ComfyUI here).

- ``fp8_per_row``, ``fp8_weight_only``, ``int8_weight_only``: cache-dit's torchao path: seconds on the GPU, the
  whole bf16 DiT at once where it fits there, else one block at a time; on the CPU only where not even a block fits
  (minutes). The FP8 results are saved (``torchao_file``) and read back at the next load, without the bf16 DiT;
  INT8 quantizes at every load.
- ``svdq_*_dq``: cache-dit's dynamic SVDQuant W4A4 (no calibration data); minutes, so the result is saved
  (``saved``) and reloaded with ``cache_dit.load`` next time.

Only the linear layers of the 36 transformer blocks are quantized: the embeddings, the shared modulation and the
final layers keep the weights' dtype, as cache-dit's regional quantization does by default.

A torchao DiT takes LoRAs: each patched layer is quantized again from the file's weights with the LoRA merged
(``requantize``); an SVDQuant DiT does not (its layers are a low-rank branch beside 4-bit weights, made in minutes).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..cancel import check_cancel
from ..errors import ErnieImageError
from ..model_files import builds_weights
from . import torchao_file
from .capability import METHODS, probe, require
from .requantize import Locations, Requantizer, unbind_reprs
from .saved import QUANT_CONFIG, SavedDiTs, non_finite

_HEADROOM = 2 * 2**30  # GPU memory left for quantizing one layer beside the whole bf16 DiT
# What cache-dit's quantize records on the module it quantized (its own checks read ``_is_quantized``).
_QUANTIZED_MARKS = ("_is_quantized", "_quantize_config", "_quantize_type", "_exclude_layers")
# What cache_dit.load raises on a saved file that does not fit (damaged past its header, another layout).
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, TypeError, KeyError, SafetensorError)


@builds_weights  # torchao's and SVDQuant's layers too
def load_quantized_dit(
    load: Callable[[], torch.nn.Module],
    method: str,
    *,
    source: Path,
    locate: Callable[[Path], Locations],
    skeleton: Callable[[], torch.nn.Module],
    dtype: torch.dtype,
    device: torch.device,
    free_memory: Callable[[torch.device], int],
    cache_root: Path,
) -> torch.nn.Module:
    """The DiT that ``load()`` reads from ``source`` (in ``dtype``), quantized with ``method`` on ``device``.

    The capability check runs first: a method that cannot run here fails before any weights are read.
    ``free_memory(device)`` is the memory the host lets a model use there now; quantized DiTs are saved under
    ``cache_root`` and read back into ``skeleton()`` (the DiT with its weights on the meta device).
    ``locate(source)`` says where the DiT's tensors lie there, for LoRAs on a torchao DiT.
    """
    spec = METHODS[method]
    if not spec.quantizes:
        return load()
    require(method, probe(device), dtype)
    if spec.backend == "svdquant":
        return load_or_build_svdq(load, spec.quant_type, source=source, device=device,
                                  cache=SavedDiTs(cache_root, beside=(QUANT_CONFIG,)))
    saved, versions = SavedDiTs(cache_root), _torchao_versions(dtype)
    transformer = _read_saved_torchao(saved, source, spec.quant_type, versions, skeleton)
    if transformer is None:
        transformer = load()
        on, per_block = (quantization_device(transformer, device, free_memory) if spec.whole_on_gpu_if_it_fits
                         else (device, False))
        quantize_torchao(transformer, spec.quant_type, on, per_block)
        _save_torchao(transformer, saved, source, spec.quant_type, versions)
    # How a LoRA's patched layers are made again (host/patchers.py): from the file, as these were.
    transformer.requantizer = Requantizer(source, spec.quant_type, dtype, locate)
    return transformer


def _torchao_versions(dtype: torch.dtype) -> dict[str, str]:
    """What a saved torchao DiT must have been made with to be read back: the libraries that quantized and rebuild
    it, and the compute dtype its other weights are held in."""
    import torchao
    from cache_dit import __version__ as cache_dit_version

    return {"cache_dit": cache_dit_version, "torchao": torchao.__version__, "dtype": str(dtype).removeprefix("torch.")}


def _read_saved_torchao(saved: SavedDiTs, source: Path, quant_type: str, versions: dict[str, str],
                        skeleton: Callable[[], torch.nn.Module]) -> torch.nn.Module | None:
    """The DiT saved at an earlier load, or None where there is none usable (a damaged one is removed)."""
    entry = saved.lookup(source, quant_type, versions)
    if entry is None:
        return None
    start = time.perf_counter()
    try:
        transformer = torchao_file.read_into(skeleton(), entry / f"{quant_type}.safetensors")
    except (ErnieImageError, *_LOAD_ERRORS) as e:
        logging.warning("ERNIE-Image: cannot read the saved quantized DiT %s (%s); quantizing again", entry, e)
        saved.discard(source, quant_type)
        return None
    transformer._is_quantized, transformer._quantize_type = True, quant_type  # as cache-dit marks what it quantized
    transformer.source = str(entry / f"{quant_type}.safetensors")  # named should its weights make a NaN image
    logging.info("ERNIE-Image: read the DiT quantized to %s at an earlier load from %s in %.1f s", quant_type, entry,
                 time.perf_counter() - start)
    return transformer


def _save_torchao(transformer: torch.nn.Module, saved: SavedDiTs, source: Path, quant_type: str,
                  versions: dict[str, str]) -> None:
    """Keep the quantized DiT for the next load, where torchao can rebuild it; a folder that cannot be written
    costs only that (the next load quantizes again)."""
    if not torchao_file.savable(transformer):
        return
    start = time.perf_counter()
    try:
        with saved.build(source, quant_type, versions) as folder:
            torchao_file.write(transformer, folder / f"{quant_type}.safetensors")
    except (ErnieImageError, OSError, SafetensorError) as e:
        logging.warning("ERNIE-Image: the quantized DiT is not saved (%s); the next load quantizes it again", e)
        return
    entry = saved.entry(source, quant_type)
    logging.info("ERNIE-Image: saved the quantized DiT as %s (%.1f GB, %.1f s); the next load reads it instead of "
                 "quantizing (delete the folder to free the space)", entry,
                 (entry / f"{quant_type}.safetensors").stat().st_size / 1e9, time.perf_counter() - start)


def quantization_device(
    transformer: torch.nn.Module, device: torch.device, free_memory: Callable[[torch.device], int]
) -> tuple[torch.device, bool]:
    """Where to quantize, and whether one block at a time: the whole DiT on ``device`` when it fits in
    ``free_memory(device)``; else each block on ``device`` in turn (its bf16 weights and their quantized copy, about
    0.5 GB for the true-size DiT, then back where the DiT is held), where one block fits; else the whole DiT on the
    CPU (minutes, and a second copy of the blocks in host memory while it runs).

    The free memory is what the host's memory management offers, not the driver's: ComfyUI keeps a reserve
    (``--reserve-vram``) that a smaller card would not have at all."""
    if device.type != "cuda":
        return device, False
    free = free_memory(device)
    if free >= sum(p.nbytes for p in transformer.parameters()) + _HEADROOM:
        return device, False
    largest = max(sum(p.nbytes for p in block.parameters()) for block in transformer.layers)
    return (device, True) if free >= 2 * largest + _HEADROOM else (torch.device("cpu"), False)


def quantize_torchao(transformer: torch.nn.Module, quant_type: str, on: torch.device,
                     per_block: bool = False) -> torch.nn.Module:
    """Quantize the transformer blocks' linear layers in place with cache-dit's torchao path, computing on ``on``
    (the whole DiT at once, or ``per_block``: each block moved there, quantized, and moved back, so the GPU never
    holds more than one block's bf16 weights); the weights then go back where they were."""
    from cache_dit import QuantizeConfig, quantize

    home = next(transformer.parameters()).device
    start = time.perf_counter()
    config = QuantizeConfig(quant_type=quant_type)
    # Outside the inference mode ComfyUI runs nodes in: torchao's weights cannot change device inside it
    # (``host/patchers.py`` says why).
    with torch.inference_mode(False):
        if per_block:
            # cache-dit quantizes the DiT's blocks (``_repeated_blocks``) one by one with the same configuration and
            # filter; a block given alone is quantized whole by that filter (tests/test_quant_lowvram.py compares).
            with _one_pause_per_model():
                for block in transformer.layers:
                    check_cancel()
                    quantize(block.to(on), config)
                    block.to(home)
            for mark in _QUANTIZED_MARKS:  # as cache-dit marks a DiT it quantized whole
                setattr(transformer, mark, getattr(transformer.layers[0], mark))
        else:
            check_cancel()  # one call of cache-dit's: seconds on the GPU
            quantize(transformer.to(on), config)
            transformer.to(home)
        unbind_reprs(transformer)
    logging.info("ERNIE-Image: quantized the DiT to %s on %s%s in %.1f s", quant_type, on,
                 " one block at a time" if per_block else "", time.perf_counter() - start)
    return transformer


@contextlib.contextmanager
def _one_pause_per_model() -> Iterator[None]:
    """cache-dit's quantize ends each call with ``maybe_empty_cache``: two 1 s sleeps and two garbage collections,
    meant once per model. Called per block, that took 104 s of a 16 GB card's first run on the H200 (36 blocks;
    the whole DiT: 12 s). Here it runs once, after the last block; where cache-dit has no such function, as is."""
    module = importlib.import_module("cache_dit.quantization.torchao.quantize_ao")
    pause = getattr(module, "maybe_empty_cache", None)
    if pause is None:
        yield
        return
    module.maybe_empty_cache = lambda: None
    try:
        yield
    finally:
        module.maybe_empty_cache = pause
    pause()


@contextlib.contextmanager
def _cancel_per_layer() -> Iterator[None]:
    """cache-dit's SVDQuant quantizes every layer in one call (minutes): its loop looks each layer up with
    ``_get_named_submodule``, which here asks for Cancel first, so that Cancel stops it within one layer (and the
    half-made entry goes with its ``.partial`` folder). Where cache-dit has no such function, as is."""
    module = importlib.import_module("cache_dit.quantization.svdquant.ptq")
    lookup = getattr(module, "_get_named_submodule", None)
    if lookup is None:
        yield
        return

    def checked(*args, **kwargs):
        check_cancel()
        return lookup(*args, **kwargs)

    module._get_named_submodule = checked
    try:
        yield
    finally:
        module._get_named_submodule = lookup


def load_or_build_svdq(
    load: Callable[[], torch.nn.Module],
    quant_type: str,
    *,
    source: Path,
    device: torch.device,
    cache: SavedDiTs,
) -> torch.nn.Module:
    """The DiT quantized with SVDQuant ``quant_type``: reloaded from ``cache`` when a usable copy is saved there,
    else quantized (each layer's decomposition on ``device``, the result kept on the CPU) and saved."""
    import cache_dit

    versions = {"cache_dit": cache_dit.__version__}
    saved = cache.lookup(source, quant_type, versions)
    if saved is not None:
        try:
            bad = non_finite(saved / f"{quant_type}.safetensors")
            if bad is not None:
                raise ErnieImageError(f"{bad} holds values that are not finite")
            return cache_dit.load(load(), str(saved))
        except _LOAD_ERRORS as e:
            logging.warning("ERNIE-Image: cannot load the saved SVDQuant DiT %s (%s); quantizing again", saved, e)
            cache.discard(source, quant_type)
    svdq_kwargs = {"quantize_device": device.type, "offload_quantized_layers_to_cpu": True}
    start = time.perf_counter()
    with cache.build(source, quant_type, versions) as folder, _cancel_per_layer():
        config = cache_dit.QuantizeConfig(quant_type=quant_type, serialize_to=str(folder), svdq_kwargs=svdq_kwargs)
        transformer = cache_dit.quantize(load(), config)
    logging.info("ERNIE-Image: quantized the DiT to %s in %.0f s, saved as %s", quant_type,
                 time.perf_counter() - start, cache.entry(source, quant_type))
    return transformer
