"""Does a model file hold the architecture it is loaded as? One check for every loader and every format (engine:
no ComfyUI, no model built, no tensor data read).

A file from a stranger declares its tensors in its header: names, shapes, dtypes (``model_files.read_header``).
Whatever a loader would build from it (how many blocks, how wide) is checked there first, so that a broken or hostile
file is refused in milliseconds with the file and its first bad key named, before any module is built or any
weight read:

- ``count_blocks``: the block indices run from 0 without a gap, stay under a cap, and every block has block 0's
  names and shapes (a loader that took the count from the highest index would otherwise build a billion blocks
  for one stray name);
- ``check_structure``: every tensor the architecture needs is there with its shape (none is left to random
  initialisation), and nothing else is, except the parts a loader names as unused and the keys of a known quantized
  layout beside the weights they belong to.

Values are checked where the few tensors that carry them are read: ``first_non_finite`` here, the quantization
scales against their formats in ``quant_layout``. A new format (GGUF, comfy_quant, …) gives its header as a
``Header`` and reuses all of it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from .cancel import check_cancel
from .errors import ErnieImageError, quoted
from .model_files import Header

Shape = tuple[int, ...]

# The keys of the quantized layouts ComfyUI writes beside a layer's ``weight``: the scaled fp8 files'
# ``scale_weight`` / ``scale_input``, and the comfy_quant layout's ``weight_scale`` / ``input_scale`` (NVFP4 adds a
# global ``weight_scale_2``) with a ``comfy_quant`` description (``quant_layout.py``).
SCALE_SUFFIXES = ("scale_weight", "scale_input", "weight_scale", "input_scale", "weight_scale_2")
QUANTIZED_SUFFIXES = (*SCALE_SUFFIXES, "comfy_quant")


@dataclass(frozen=True)
class Architecture:
    """What a model needs from a file: ``expected`` names every tensor with its shape (a model built on the ``meta``
    device gives them for free). ``name`` and ``advice`` make the messages ("ERNIE-Image DiT", "Download it again");
    ``optional`` tensors may be absent (a tied ``lm_head``); ``ignored`` are whole names or, ending in ".", name
    prefixes of parts the pack does not use (a vision tower); ``quantized`` are the suffixes allowed beside an
    expected ``<layer>.weight``; ``dtypes`` the safetensors dtypes its weights may have (None: any); ``packed``
    the weights a quantized format stores its own way (NVFP4 packs two values a byte): any dtype, the expected rows,
    at most the expected size."""

    name: str
    expected: Mapping[str, Shape]
    advice: str
    optional: frozenset[str] = frozenset()
    ignored: tuple[str, ...] = ()
    quantized: tuple[str, ...] = ()
    dtypes: frozenset[str] | None = field(default=None)
    packed: frozenset[str] = frozenset()


def natural(name: str) -> tuple:
    """Sorts ``layers.2`` before ``layers.10``, so that "the first bad key" is the first a reader would find."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _first(names: Iterable[str]) -> tuple[str, str]:
    """The first name in natural order, and " (and N more)" when there are others."""
    names = sorted(names, key=natural)
    return names[0], f" (and {len(names) - 1} more)" if len(names) > 1 else ""


def _named(prefix: str, i: int, name: str) -> str:
    """A block's key as a message quotes it: ``<prefix><i>.<name>``, the file's part cut short."""
    return quoted(f"{prefix}{i}.{name}")


def is_ignored(name: str, ignored: Iterable[str]) -> bool:
    return any(name == part or (part.endswith(".") and name.startswith(part)) for part in ignored)


def count_blocks(header: Header, prefix: str, most: int, source: str, what: str, advice: str,
                 error: type[ErnieImageError] = ErnieImageError, quantized: tuple[str, ...] = (),
                 packed: frozenset[str] = frozenset()) -> int:
    """How many blocks ``<prefix><i>.…`` the header holds, once they are known to run from 0 without a gap, to be
    at most ``most``, and each to have block 0's names and shapes. ``what`` names the model in messages. Mixed
    precision files quantize some blocks and not others: the ``quantized`` layout's keys are not compared, nor the
    shapes of ``packed`` weights (``check_structure`` checks both)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.(.+)")
    blocks: dict[int, dict[str, Shape | None]] = {}
    for name, info in header.items():
        check_cancel()
        match = pattern.fullmatch(name)
        if match is None or name.rpartition(".")[2] in quantized:
            continue
        digits = match.group(1)
        # Compared as text first: a hostile index of thousands of digits is past int()'s limit, and past the cap.
        if len(digits) > len(str(most)) or int(digits) >= most:
            raise error(f"{source} declares block {digits[:20]} ({quoted(name)}): a {what} has at most {most} blocks, "
                        f"so the file is damaged or made to exhaust memory. {advice}")
        blocks.setdefault(int(digits), {})[match.group(2)] = None if name in packed else tuple(info.shape)
    if not blocks:
        return 0
    top = max(blocks)
    gap = next((i for i in range(top + 1) if i not in blocks), None)
    if gap is not None:
        raise error(f"{source} is not a whole {what}: it has no block {gap} ({prefix}{gap}.…) but has blocks up to "
                    f"{top}. {advice}")
    first = blocks[0]
    for i in range(1, top + 1):
        block = blocks[i]
        if block.keys() != first.keys():
            lacking, extra = first.keys() - block.keys(), block.keys() - first.keys()
            if lacking:
                name, more = _first(lacking)
                raise error(f"{source} is not a whole {what}: {_named(prefix, i, name)} is missing{more} (block 0 "
                            f"has it). {advice}")
            name, more = _first(extra)
            raise error(f"{source} holds {_named(prefix, i, name)}{more}, which block 0 does not have: the blocks "
                        f"differ, so it is not a {what}. {advice}")
        wrong = [name for name, shape in block.items() if None not in (shape, first[name]) and shape != first[name]]
        if wrong:
            name, more = _first(wrong)
            raise error(f"{source} does not fit a {what}: {_named(prefix, i, name)} has shape {list(block[name])}, "
                        f"block 0's has {list(first[name])}{more}. {advice}")
    return top + 1


def _fits(info, shape: Shape, packed: bool) -> bool:
    if tuple(info.shape) == tuple(shape):
        return True
    return (packed and len(info.shape) == len(shape) and info.shape[0] == shape[0]
            and info.numel < math.prod(shape))


def check_structure(header: Header, architecture: Architecture, source: str,
                    error: type[ErnieImageError] = ErnieImageError) -> None:
    """An error naming ``source`` and its first bad key unless the header holds exactly what ``architecture``
    needs: nothing missing, every shape as expected, no empty tensor, every dtype allowed, and nothing unexpected
    outside the ignored parts and the quantized layout's keys."""
    arch, expected = architecture, architecture.expected
    used, unexpected = [], []
    for name in header:
        check_cancel()
        if is_ignored(name, arch.ignored):
            continue
        layer, _, suffix = name.rpartition(".")
        if name in expected:
            used.append(name)
        elif not (suffix in arch.quantized and f"{layer}.weight" in expected):
            unexpected.append(name)
    missing = [name for name in expected if name not in header and name not in arch.optional]
    if missing:
        name, more = _first(missing)
        raise error(f"{source} is not a whole {arch.name}: {quoted(name)} is missing{more}. {arch.advice}")
    wrong = [name for name in used if not _fits(header[name], expected[name], name in arch.packed)]
    if wrong:
        name, more = _first(wrong)
        raise error(f"{source} does not fit the {arch.name}: {quoted(name)} has shape {list(header[name].shape)}, the "
                    f"{arch.name} needs {list(expected[name])}{more}. {arch.advice}")
    empty = [name for name in used if header[name].numel == 0]
    if empty:
        name, more = _first(empty)
        raise error(f"{source} holds an empty tensor {quoted(name)} (shape {list(header[name].shape)}){more}: it is no "
                    f"{arch.name}. {arch.advice}")
    if arch.dtypes is not None:
        odd = [name for name in used if header[name].dtype not in arch.dtypes and name not in arch.packed]
        if odd:
            name, more = _first(odd)
            raise error(f"{source} stores {quoted(name)} as {header[name].dtype}{more}; the {arch.name}'s weights are "
                        f"{', '.join(sorted(arch.dtypes))}. {arch.advice}")
    if unexpected:
        name, more = _first(unexpected)
        raise error(f"{source} holds {quoted(name)}{more}, which the {arch.name} does not have: the file is from "
                    f"another model or damaged. {arch.advice}")


def _as_float(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64) else tensor.float()


def first_non_finite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The first (natural order) floating-point tensor holding a NaN or an infinity, or None."""
    for name in sorted(tensors, key=natural):
        check_cancel()
        tensor = tensors[name]
        if tensor.is_floating_point() and not bool(torch.isfinite(_as_float(tensor)).all()):
            return name
    return None
