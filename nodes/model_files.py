"""Reading model files (safetensors weights, JSON configs) with errors that name the file and say what to do
(engine: no ComfyUI here).

Only safetensors are ever loaded by the pack: no pickles, no remote code.
"""

from __future__ import annotations

import stat
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import BinaryIO, ParamSpec, TypeVar

import torch

from . import bounded_json
from .bounded_json import NestedTooDeeply
from .cancel import check_cancel
from .errors import ErnieImageError, quoted

P = ParamSpec("P")
R = TypeVar("R")


def builds_weights(function: Callable[P, R]) -> Callable[P, R]:
    """Decorates a function that makes model weights: they are made as normal tensors even when it is called inside
    ``torch.inference_mode()``, as ComfyUI runs every node. A parameter made in inference mode whose data a device
    move outside it replaces breaks every later forward ("Inference tensors do not track version counter": every GPU
    user's first sampling step, 2026-12-01); ComfyUI moves models both inside and outside inference mode (``/free``
    between prompts). A normal tensor moves either way."""
    return torch.inference_mode(False)(function)


def _unreadable(path: Path, error: object) -> ErnieImageError:
    return ErnieImageError(
        f"Cannot read {path} ({error}). The file is damaged or incomplete (an interrupted download?): "
        "download it again."
    )


def _check_exists(path: Path) -> None:
    if not path.is_file():
        raise ErnieImageError(f"Model file not found: {path}. Put it there or pick another file.")


# A safetensors header lists every tensor's name, dtype, shape and offsets as JSON. An 8B DiT's is about 100 KB
# (some 400 tensors); 8 MiB holds some 100 000. safetensors itself parses up to 100 MB, about 20 s of CPU for the
# ~1.4 million names that fit there: a file that only wastes time. Refused before it is parsed.
MAX_HEADER_BYTES = 8 * 2**20


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as the file's header declares it (no data read): its shape and safetensors dtype name (``BF16``,
    ``F32``, ``F8_E4M3``, ``U8``, …)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return prod(self.shape)


Header = dict[str, TensorInfo]

# safetensors' dtypes: bits per value, and torch's dtype where torch has one.
_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
         "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "C64": 64, "I64": 64,
         "U64": 64, "F64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
_TORCH_NAMES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
                "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
                "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32",
                "F32": "float32", "C64": "complex64", "I64": "int64", "U64": "uint64", "F64": "float64"}
_TORCH_DTYPES = {name: getattr(torch, attr) for name, attr in _TORCH_NAMES.items() if hasattr(torch, attr)}
MAX_DIMENSIONS = 8  # a model's tensors have at most 5 (a 3-D convolution's weight)
# A tensor this large or larger gets its own map of the file; a smaller one is copied into memory of its own. A map per
# tensor keeps what "one handle per tensor" kept (a tensor's pages go with it) with at most one map per MiB of data.
MAPPED_BYTES = 2**20


@dataclass(frozen=True)
class _Stored:
    """Where one tensor's bytes lie, from the start of the file's data."""

    info: TensorInfo
    begin: int
    end: int


@dataclass(frozen=True)
class _Parsed:
    """A safetensors file's header, parsed and checked once: every tensor's place, and the file's size."""

    tensors: dict[str, _Stored]
    data_start: int
    size: int


def _shape(value: object) -> tuple[int, ...] | None:
    if not isinstance(value, list) or len(value) > MAX_DIMENSIONS:
        return None
    if not all(type(side) is int and side >= 0 for side in value):
        return None
    return tuple(value)


def _stored(name: str, entry: object) -> _Stored | str:
    """One header entry as a ``_Stored``, or why it is not one."""
    if not isinstance(entry, dict):
        return f"the entry of {quoted(name)} is not a JSON object"
    dtype, shape, offsets = entry.get("dtype"), _shape(entry.get("shape")), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _BITS:
        return f"{quoted(name)} has the unknown dtype {quoted(dtype, 40)}"
    if shape is None:
        return f"{quoted(name)} has no shape of at most {MAX_DIMENSIONS} sizes"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        return f"{quoted(name)} has no data offsets [begin, end]"
    info = TensorInfo(shape, dtype)
    if info.numel * _BITS[dtype] != 8 * (offsets[1] - offsets[0]):
        return (f"{quoted(name)}, a {dtype} tensor of shape {list(shape)}, is given "
                f"{offsets[1] - offsets[0]} bytes")
    return _Stored(info, offsets[0], offsets[1])


def _parse(path: Path, size: int) -> _Parsed:
    """The header of the safetensors file at ``path`` (``size`` bytes), checked as safetensors checks it: every
    tensor's bytes fit its dtype and shape, and the tensors fill the data after the header exactly, one after
    another. Any fault is an error naming the file."""
    try:
        with path.open("rb") as f:
            declared = int.from_bytes(f.read(8), "little")
            if declared > MAX_HEADER_BYTES:
                raise ErnieImageError(
                    f"{path} declares a {declared / 2**20:.0f} MiB list of tensors (model files have well under "
                    f"{MAX_HEADER_BYTES // 2**20} MiB): it is not a model file this pack loads. Pick the model's own "
                    "safetensors file.")
            if size < 8 or 8 + declared > size:
                raise _unreadable(path, f"its header of {declared} bytes does not fit in its {size} bytes")
            text = f.read(declared)
    except OSError as e:
        raise _unreadable(path, e) from e
    try:
        header = bounded_json.loads(text)
    except NestedTooDeeply:
        raise _unreadable(path, "its header is nested too deeply") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise _unreadable(path, f"its header is not JSON: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise _unreadable(path, "its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise _unreadable(path, "its __metadata__ is not a JSON object of strings")
    tensors = {}
    for name, entry in header.items():
        stored = _stored(name, entry)
        if isinstance(stored, str):
            raise _unreadable(path, stored)
        tensors[name] = stored
    end = 0
    for name, stored in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if stored.begin != end:
            raise _unreadable(path, f"the bytes of {quoted(name)} start at {stored.begin}, not where the tensor "
                                    f"before ends ({end})")
        end = stored.end
    if 8 + declared + end != size:
        raise _unreadable(path, f"its tensors end at byte {8 + declared + end}, the file at {size}")
    return _Parsed(tensors, 8 + declared, size)


# The last headers parsed, by file (path, device, inode, size, modification time): one load asks for a file's header
# and then for its tensors, perhaps in several reads; each parse of a big header costs its whole length. Bounded by
# the tensors they list (a hostile 8 MiB header lists some 150 000).
_PARSED: OrderedDict[tuple, _Parsed] = OrderedDict()
MAX_CACHED_FILES, MAX_CACHED_TENSORS = 16, 200_000


def _parsed(path: Path) -> _Parsed:
    """The file's parsed header: parsed once per file as long as the file stays the same."""
    _check_exists(path)
    info = path.stat()
    stamp = (str(path), info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    parsed = _PARSED.get(stamp)
    if parsed is None:
        parsed = _PARSED[stamp] = _parse(path, info.st_size)
        while len(_PARSED) > 1 and (len(_PARSED) > MAX_CACHED_FILES
                                    or sum(len(p.tensors) for p in _PARSED.values()) > MAX_CACHED_TENSORS):
            _PARSED.popitem(last=False)
    _PARSED.move_to_end(stamp)
    return parsed


def _read_tensor(path: Path, file: BinaryIO, parsed: _Parsed, name: str) -> torch.Tensor:
    stored = parsed.tensors.get(name)
    if stored is None:
        raise _unreadable(path, f"it holds no tensor {quoted(name)}")
    dtype = _TORCH_DTYPES.get(stored.info.dtype)
    if dtype is None:
        raise ErnieImageError(f"{path} stores {quoted(name)} as {stored.info.dtype}, which torch cannot read. Pick "
                              "a file in another format.")
    begin, end = parsed.data_start + stored.begin, parsed.data_start + stored.end
    if begin == end:
        return torch.empty(stored.info.shape, dtype=dtype)
    if end - begin < MAPPED_BYTES:
        data = bytearray(end - begin)
        file.seek(begin)
        if file.readinto(data) != len(data):
            raise _unreadable(path, "it is shorter than when its header was read")
        raw = torch.frombuffer(data, dtype=torch.uint8)
    else:  # a private map of the file, as safetensors makes: only the pages this tensor touches are read
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=parsed.size)
        raw = torch.empty(0, dtype=torch.uint8).set_(storage[begin:end])
    return raw.view(dtype).reshape(stored.info.shape)


def read_safetensors(path: Path, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file (or only ``keys``), or an error that names the file when it cannot be
    read. The header is parsed once (``_parsed``); Cancel is checked before each tensor."""
    parsed = _parsed(path)
    # Each tensor in memory of its own. safetensors maps a file once per handle, and every page a tensor of that handle
    # touched stays in host RAM until all of its tensors are gone: a DiT read through one handle kept its whole
    # 15 GB file resident while its blocks were quantized and moved away one by one (26.9 GiB host RAM on a 16 GB
    # card's first load). A handle per tensor parsed the header per tensor instead: quadratic in the tensors (a LoRA
    # of 10 000 empty tensors took 92 s).
    tensors = {}
    try:
        with path.open("rb") as file:
            for key in parsed.tensors if keys is None else keys:
                check_cancel()
                tensors[key] = _read_tensor(path, file, parsed, key)
    except (OSError, RuntimeError) as e:  # RuntimeError: torch could not map the file
        raise _unreadable(path, e) from e
    return tensors


def read_header(path: Path) -> Header:
    """Every tensor's name, shape and dtype from the file's header alone: a wrong or hostile file is refused before
    any of its data is read or any model is built. The file must be as long as its header says, so a truncated file
    fails here, cheaply, with its name."""
    return {name: stored.info for name, stored in _parsed(path).tensors.items()}


def safetensors_keys(path: Path) -> list[str]:
    """The tensor names of one safetensors file, from its header alone: a wrong file is refused before gigabytes
    of it are read."""
    return list(_parsed(path).tensors)


CONFIG_LIMIT_BYTES = 1 << 20  # a model's config or index is a few kilobytes; a larger file is not read whole


def json_object(path: Path) -> dict:
    """The JSON object in ``path``, a regular file of at most ``CONFIG_LIMIT_BYTES``; else ``OSError`` or
    ``ValueError`` saying what the file is instead ("a JSON list, not an object"): a FIFO would block the reading, a
    huge file balloon it, deep nesting overflow the parser."""
    info = path.stat()
    if not stat.S_ISREG(info.st_mode):
        raise OSError("not a file")
    if info.st_size > CONFIG_LIMIT_BYTES:
        raise ValueError(f"larger than {CONFIG_LIMIT_BYTES} bytes")
    with open(path, "rb") as f:
        text = f.read(CONFIG_LIMIT_BYTES + 1)
    try:
        data = bounded_json.loads(text)
    except NestedTooDeeply:
        raise ValueError("nested too deeply") from None
    except ValueError as error:  # invalid JSON or UTF-8
        raise ValueError(f"not JSON ({type(error).__name__})") from None
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}, not an object")
    return data


def file_stamps(files: Iterable[Path], name: Callable[[Path], str] = str) -> list[list]:
    """``[name, size, modification time in ns]`` of each of ``files`` that is a file (the others are left out):
    what tells one download or edit of a model's files from another without reading them. ``name`` names a file in
    the list (by default its path)."""
    return [[name(f), info.st_size, info.st_mtime_ns] for f in files if f.is_file() for info in (f.stat(),)]


def is_gguf(path: Path | str) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix, as ComfyUI lists them)."""
    return str(path).lower().endswith(".gguf")


def dit_folder(path: Path) -> Path:
    """Where a DiT folder keeps its weights: a snapshot's (or any folder's) ``transformer/``, else the folder
    itself."""
    return path / "transformer" if (path / "model_index.json").is_file() or (path / "transformer").is_dir() else path


def read_json(path: Path) -> dict:
    """A JSON config file as a dict, or an error that names the file when it is damaged (a truncated download)."""
    try:
        return json_object(path)
    except (OSError, ValueError) as e:
        raise _unreadable(path, e) from e


def read_folder_headers(folder: Path,
                        error: type[ErnieImageError] = ErnieImageError) -> tuple[Header, dict[str, Path]]:
    """The headers of every safetensors shard in ``folder`` as one (a truncated shard is named here), and the
    shard that holds each tensor. A tensor in two shards, or a shard that the folder's index lists but that is not
    there, is an error: either would leave a weight to chance."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise error(f"No .safetensors weights in {folder}. Download the model's weights (only safetensors are loaded).")
    for index in sorted(folder.glob("*.safetensors.index.json")):
        weight_map = read_json(index).get("weight_map")
        listed = set(weight_map.values()) if isinstance(weight_map, dict) else set()
        absent = sorted(str(name) for name in listed if not isinstance(name, str) or not (folder / name).is_file())
        if absent:
            raise error(f"{index} lists the shard {quoted(absent[0])}, which is not in {folder}: the download is "
                        "incomplete. Download the model again.")
    header: Header = {}
    where: dict[str, Path] = {}
    for file in files:
        check_cancel()
        for name, info in read_header(file).items():
            if name in where:
                raise error(f"{quoted(name)} is in two shards of {folder} ({where[name].name} and {file.name}): the "
                            "folder mixes two downloads. Download the model again into an empty folder.")
            header[name], where[name] = info, file
    return header, where


def read_tensors(where: Mapping[str, Path], keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` from the shards that hold them (``where``, from ``read_folder_headers``), nothing else."""
    by_file: dict[Path, list[str]] = {}
    for key in keys:
        by_file.setdefault(where[key], []).append(key)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        tensors.update(read_safetensors(file, names))
    return tensors
