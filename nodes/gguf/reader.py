"""Read a GGUF model file with the ``gguf`` package, as names, types, shapes and where each tensor's bytes lie
(engine: no ComfyUI here; ``gguf`` and torch).

The header is walked with bounds first (``header.py``); then ``gguf.GGUFReader`` parses it. Nothing is read of the
data until the caller has checked the names and shapes (``GGUFTensor.read``). Shapes come back in torch's order:
GGUF keeps ggml's (innermost first), and city96's converter stores tensors whose rows do not fill whole 256-value
blocks flattened to rows of 256, with the true shape in a ``comfy.gguf.orig_shape.<name>`` field (ComfyUI-GGUF's
tools/convert.py); both are read here.

A tensor's bytes are read into memory of their own, not through the reader's memory map: every page of a mapping
that was touched counts in the process's resident memory until the whole mapping is gone, so a file checked and
copied through it was held twice at the load's peak (8 GB card, Q4_K_M: 16.5 GiB of host RAM, 11.0 of it mapped
files; read so, 11.7: bench/RESULTS.md, sessions 18 and 21). Values are checked before anything is kept
(``first_bad_value``): every block's fp16 scales, and every plain tensor, must be finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from ..errors import ErnieImageError
from ..model_files import Header, TensorInfo
from .dequant import BLOCKS, PLAIN, SCALE_OFFSETS, UNSUPPORTED_ADVICE
from .header import HeaderError, walk_header

ORIG_SHAPE = "comfy.gguf.orig_shape."
_NO_PACKAGE = ("Reading GGUF files needs the gguf package, which is not installed in ComfyUI's Python (the pack's "
               "requirements.txt lists it: were they installed into another Python?). Install it there (`pip install "
               "gguf`, or `pip install -r requirements.txt` in the pack's folder), then restart ComfyUI.")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its type's name (``Q4_K``, ``F16``, …), its shape in torch's order, and where its
    bytes lie in the file (checked against the file's size by the header walk)."""

    kind: str
    shape: tuple[int, ...]
    path: Path
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self) -> torch.Tensor:
        """The tensor in memory of its own: a plain tensor as numbers of its shape and type, a quantized one as its
        blocks (uint8, one dimension)."""
        data = torch.empty(self.nbytes, dtype=torch.uint8)
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                read = file.readinto(data.numpy())
        except OSError as error:
            raise _unreadable(self.path, error) from error
        if read != self.nbytes:
            raise _damaged(self.path, f"{self.nbytes} bytes of data at byte {self.offset}, but it ends after {read}")
        if self.kind in PLAIN:
            return data.view(PLAIN[self.kind]).reshape(self.shape)
        return data


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's tensors by name and what it says it is (``general.architecture``; community files of other
    models' converters say ``flux`` or ``wan``, so it decides nothing)."""

    path: Path
    architecture: str | None
    tensors: dict[str, GGUFTensor]

    def header(self) -> Header:
        """Names, shapes and types, for ``structure``'s checks."""
        return {name: TensorInfo(t.shape, t.kind) for name, t in self.tensors.items()}


def _gguf_version() -> str:
    try:
        return metadata.version("gguf")
    except metadata.PackageNotFoundError:  # imported from elsewhere than an installed distribution
        return "of unknown version"


def _damaged(path: Path, why: str) -> ErnieImageError:
    return ErnieImageError(f"Cannot read {path} as a GGUF file: it declares {why}. The file is damaged or not a GGUF "
                           "model file (an interrupted download?): download it again.")


def _unreadable(path: Path, error: OSError) -> ErnieImageError:
    return ErnieImageError(f"Cannot read {path} ({error}). Check the file, or download it again.")


def _string(field) -> str | None:
    if field is None or len(field.types) != 1 or field.types[0].name != "STRING":
        return None
    return bytes(field.parts[field.data[-1]]).decode("utf-8", errors="replace")


def _orig_shape(reader, name: str, count: int, path: Path) -> tuple[int, ...] | None:
    field = reader.get_field(ORIG_SHAPE + name)
    if field is None:
        return None
    if [t.name for t in field.types] != ["ARRAY", "INT32"]:
        raise _damaged(path, f"{ORIG_SHAPE}{name} as {[t.name for t in field.types]}, not an array of int32")
    shape = tuple(int(field.parts[i][0]) for i in field.data)
    if not shape or len(shape) > 8 or min(shape) < 1 or math.prod(shape) != count:
        raise _damaged(path, f"{ORIG_SHAPE}{name} = {list(shape)} for a tensor of {count} values")
    return shape


def read_gguf(path: Path) -> GGUFFile:
    """Every tensor of the GGUF file ``path`` (names as the file has them), or an error naming the file. No data
    is read here, only the header (bounded first)."""
    try:
        import gguf
    except ImportError as error:
        raise ErnieImageError(_NO_PACKAGE) from error
    if not path.is_file():
        raise ErnieImageError(f"Model file not found: {path}. Put it there or pick another file.")
    sizes = {int(kind): size for kind, size in gguf.GGML_QUANT_SIZES.items()}
    try:
        header = walk_header(path, sizes)
    except HeaderError as error:
        raise _damaged(path, str(error)) from None
    except OSError as error:
        raise _unreadable(path, error) from error
    unknown = next((t for t in header.tensors if t.type_id not in sizes), None)
    if unknown is not None:
        raise ErnieImageError(
            f"{path} stores {unknown.name} in type number {unknown.type_id}, which no GGUF type of the installed gguf "
            f"package ({_gguf_version()}) is: the file is damaged, or in a type newer "
            f"than this pack reads. {UNSUPPORTED_ADVICE}")
    try:
        reader = gguf.GGUFReader(path)
    except ValueError as error:
        # An unknown type number first: gguf's own words for it are "5000 is not a valid GGMLQuantizationType".
        raise _damaged(path, f"what gguf {_gguf_version()} cannot read ({error})") from None
    except (KeyError, IndexError, OverflowError, OSError, UnicodeDecodeError) as error:
        raise _damaged(path, f"what gguf cannot read ({type(error).__name__}: {error})") from None
    tensors = {}
    for tensor in reader.tensors:
        count = math.prod(int(d) for d in tensor.shape)
        shape = _orig_shape(reader, tensor.name, count, path) or tuple(int(d) for d in reversed(tensor.shape))
        tensors[tensor.name] = GGUFTensor(tensor.tensor_type.name, shape, path, int(tensor.data_offset),
                                          int(tensor.n_bytes))
    return GGUFFile(path, _string(reader.get_field("general.architecture")), tensors)


def first_bad_value(name: str, kind: str, data: torch.Tensor) -> str | None:
    """Why the numbers of tensor ``name`` of GGUF type ``kind``, read as ``data`` (``GGUFTensor.read``), cannot be
    trusted (a NaN or infinite block scale or value), or None."""
    if kind in BLOCKS:
        blocks = data.reshape(-1, BLOCKS[kind][1])
        for offset in SCALE_OFFSETS[kind]:
            scales = blocks[:, offset:offset + 2].contiguous().view(torch.float16)
            bad = ~torch.isfinite(scales)
            if bad.any():
                block = int(bad.any(dim=1).nonzero()[0])
                return (f"the fp16 block scale at byte {offset} of block {block} of {name} is "
                        f"{float(scales[block, 0])}")
        return None
    if not bool(torch.isfinite(data).all()):
        return f"{name} holds NaN or infinite values"
    return None
