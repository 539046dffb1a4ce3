"""The DiT from a GGUF file (the types of ``gguf/dequant.BLOCKS``: the community's 3- to 8-bit files for small cards).

Community ERNIE-Image GGUFs are made with city96's converter from the released safetensors, so their tensor names
are the released keys (bare, or under ComfyUI's ``model.diffusion_model.``). They are recognised by those names,
never by ``general.architecture``: that converter has no ERNIE-Image entry, and the files say ``flux`` or ``wan``.

Every check of the header runs before any weight is read: the names and shapes against the DiT built from the
architecture they imply (blocks counted and capped first, as for safetensors: ``weights.py``, ``structure.py``),
then the types. Each tensor's values are checked as it is read (every block's fp16 scales finite), before the model
is given out. Nothing missing is filled in.

Linear layers keep the file's blocks and decode them as they run (``host/gguf_layers.py``); everything else (norms,
biases, the patch embedding) is decoded once here into the compute dtype, which ``weight_dtype`` picks.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from ..cancel import check_cancel
from ..errors import ErnieImageError
from ..gguf.dequant import BLOCK_TYPE_NAMES, BLOCKS, SUPPORTED, UNSUPPORTED_ADVICE, dequantize
from ..gguf.reader import GGUFTensor, first_bad_value, read_gguf
from ..host import attention
from ..host.gguf_layers import GGUFOperations, held_types, weight_shapes
from ..host.sizes import module_bytes
from ..model_files import builds_weights
from ..structure import Architecture, check_structure, count_blocks, natural
from .attention import AttentionPlan
from .model import ErnieImageDiffusionModel
from .precision import STORAGE_DTYPES, Precision, weight_dtypes
from .weights import (
    MARKER_KEY,
    MAX_BLOCKS,
    PREFIXES,
    WHAT,
    check_config,
    check_dit_keys,
    config_from_state_dict,
    expected_shapes,
)

ADVICE = (f"Download it again, or pick another GGUF of ERNIE-Image (types {BLOCK_TYPE_NAMES}) or "
          "ernie-image-turbo.safetensors.")


def gguf_dtype(weight_dtype: str, quantization: str) -> torch.dtype:
    """The dtype a GGUF DiT computes in for the loader's inputs: a GGUF file is stored quantized already, so a
    quantization method or an fp8 ``weight_dtype`` (two other ways of storing it) is refused in words."""
    if quantization != "none":
        raise ErnieImageError(
            f"quantization {quantization} quantizes bf16 weights at load, but a GGUF file is quantized already (its "
            "layers stay in their GGUF types and are decoded as they run): set quantization to none, or pick the "
            "safetensors file to quantize it at load.")
    dtype, storage = weight_dtypes(weight_dtype)
    if storage in STORAGE_DTYPES and storage != dtype and weight_dtype != "default":
        raise ErnieImageError(
            f"weight_dtype {weight_dtype} stores the weights in fp8, but a GGUF file keeps its own types: set "
            "weight_dtype to default, bf16 or fp32 (the dtype the DiT computes in).")
    return dtype  # under a global fp8 unet flag (weight_dtype default) the file's types stay, computed in ``dtype``


def read_gguf_dit(path: Path) -> tuple[dict[str, GGUFTensor], dict]:
    """The DiT's tensors (released keys) and architecture from the GGUF file ``path``, once its header is known to
    hold exactly an ERNIE-Image DiT in types the pack reads. No data is read here."""
    file = read_gguf(path)
    source = str(path)
    prefix = next((p for p in PREFIXES if p + MARKER_KEY in file.tensors), "")
    # Under a prefix, the file's other tensors are the other models of a checkpoint: not read.
    tensors = {k[len(prefix):]: v for k, v in file.tensors.items() if k.startswith(prefix)}
    header = {k[len(prefix):]: info for k, info in file.header().items() if k.startswith(prefix)}
    check_dit_keys(list(header), source)
    count_blocks(header, "layers.", MAX_BLOCKS, source, WHAT, ADVICE)
    config = check_config(config_from_state_dict(header, source), source)
    check_structure(header, Architecture(WHAT, expected_shapes(config), ADVICE), source)
    odd = sorted((k for k, t in tensors.items() if t.kind not in SUPPORTED), key=natural)
    if odd:
        more = f" (and {len(odd) - 1} more tensors in types it cannot read)" if len(odd) > 1 else ""
        raise ErnieImageError(f"{source} stores {odd[0]} as {tensors[odd[0]].kind}{more}, a GGUF type this pack does "
                              f"not read. {UNSUPPORTED_ADVICE}")
    if file.architecture not in (None, "ernie_image", "ernie-image"):
        logging.info("ERNIE-Image: %s says general.architecture %r; its tensors are ERNIE-Image's, so it loads as "
                     "the ERNIE-Image DiT", path, file.architecture)
    return tensors, config


@builds_weights
def build_gguf_dit(tensors: dict[str, GGUFTensor], config: dict, dtype: torch.dtype) -> ErnieImageDiffusionModel:
    """The DiT with ``config``'s architecture computing in ``dtype``: its linear layers hold the file's blocks, every
    other tensor is decoded into ``dtype``. ``tensors``' header is checked already (``read_gguf_dit``); their values
    are checked here as each is read, and Cancel before each is read."""
    with torch.device("meta"):
        model = ErnieImageDiffusionModel(**config, dtype=dtype, operations=GGUFOperations,
                                         attention=AttentionPlan(*attention.core_attention_choice()))
    linear = {f"{name}.weight": module for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear)}
    plain = {}
    for key in sorted(tensors, key=natural):
        check_cancel()
        tensor = tensors[key]
        data = tensor.read()
        bad = first_bad_value(key, tensor.kind, data)
        if bad is not None:
            raise ErnieImageError(f"{tensor.path}: {bad}; a weight must be made of finite numbers (this one would "
                                  f"make a black or garbage image). The file is damaged. {ADVICE}")
        if tensor.kind in BLOCKS and key in linear:
            linear[key].hold(data, tensor.kind, tensor.shape)
        elif tensor.kind in BLOCKS:
            plain[key] = dequantize(data, tensor.kind, tensor.shape, torch.float32).to(dtype)
        else:
            plain[key] = data.to(dtype)
    missing, unexpected = model.load_state_dict(plain, strict=False, assign=True)
    missing = [k for k in missing if k not in tensors]  # held as blocks
    if missing or unexpected:  # the header checks make this unreachable; said in words should they ever differ
        raise ErnieImageError(f"These weights do not match the ERNIE-Image architecture (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}). {ADVICE}")
    model.precision = Precision(dtype, dtype)  # what is not blocks is held as computed
    model.dtype = dtype  # what ComfyUI reads as the model's weight dtype: inputs come in it
    model.quant_formats = frozenset()  # none of core's quantized layers
    model.gguf_types = frozenset(held_types(model))
    return model.eval()


def load_gguf_dit(path: Path, dtype: torch.dtype) -> ErnieImageDiffusionModel:
    """The DiT of the GGUF file ``path``, computing in ``dtype``."""
    model = build_gguf_dit(*read_gguf_dit(path), dtype)
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(held_types(model).items()))
    bf16 = 2 * sum(math.prod(shape) for shape in weight_shapes(model).values())
    logging.info("ERNIE-Image: %s: linear layers held as GGUF blocks (%s), %.1f MiB in all (%.1f MiB in bf16)", path,
                 counts or "none", module_bytes(model) / 2**20, bf16 / 2**20)
    return model
