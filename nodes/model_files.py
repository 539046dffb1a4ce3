"""Reading model files (safetensors weights, JSON configs) with errors that name the file and say what to do
(engine: no ComfyUI here).

Only safetensors are ever loaded by the pack: no pickles, no remote code.
"""

from __future__ import annotations

import json
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch
from safetensors import SafetensorError, safe_open

from .errors import ErnieImageError

P = ParamSpec("P")
R = TypeVar("R")


def builds_weights(function: Callable[P, R]) -> Callable[P, R]:
    """Decorates a function that makes model weights: they are made as normal tensors even when it is called inside
    ``torch.inference_mode()``, as ComfyUI runs every node. A parameter made in inference mode whose data a device
    move outside it replaces breaks every later forward ("Inference tensors do not track version counter": every GPU
    user's first sampling step, 2026-12-01); ComfyUI moves models both inside and outside inference mode (``/free``
    between prompts). A normal tensor moves either way."""
    return torch.inference_mode(False)(function)


def _unreadable(path: Path, error: Exception) -> ErnieImageError:
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


def _check_header_size(path: Path) -> None:
    try:
        with path.open("rb") as f:
            declared = int.from_bytes(f.read(8), "little")
    except OSError as e:
        raise _unreadable(path, e) from e
    if declared > MAX_HEADER_BYTES:
        raise ErnieImageError(
            f"{path} declares a {declared / 2**20:.0f} MiB list of tensors (model files have well under "
            f"{MAX_HEADER_BYTES // 2**20} MiB): it is not a model file this pack loads. Pick the model's own "
            "safetensors file."
        )


def read_safetensors(path: Path, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file (or only ``keys``), or an error that names the file when it cannot be
    read."""
    _check_exists(path)
    _check_header_size(path)
    try:
        if keys is None:
            keys = safetensors_keys(path)
        # One handle per tensor. safetensors maps the file once per handle, and every page a tensor of that handle
        # touched stays in host RAM until all of its tensors are gone: a DiT read through one handle kept its whole
        # 15 GB file resident while its blocks were quantized and moved away one by one (26.9 GiB host RAM on a
        # 16 GB card's first load). Apart, a tensor's pages go with it. The cost: the header is parsed per tensor
        # (about 0.4 ms each for the DiT's 470 names).
        tensors = {}
        for key in keys:
            with safe_open(str(path), framework="pt") as f:
                tensors[key] = f.get_tensor(key)
        return tensors
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e) from e


def read_header(path: Path) -> Header:
    """Every tensor's name, shape and dtype from the file's header alone: a wrong or hostile file is refused before
    any of its data is read or any model is built. safetensors checks there that the file is as long as its header
    says, so a truncated file fails here, cheaply, with its name."""
    _check_exists(path)
    _check_header_size(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: TensorInfo(tuple(part.get_shape()), part.get_dtype())
                    for name in f.keys() for part in (f.get_slice(name),)}
    except (SafetensorError, OSError) as e:
        raise _unreadable(path, e) from e


def safetensors_keys(path: Path) -> list[str]:
    """The tensor names of one safetensors file, from its header alone: a wrong file is refused before gigabytes
    of it are read."""
    return list(read_header(path))


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
        data = json.loads(text)
    except RecursionError:  # thousands of nested brackets
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
            raise error(f"{index} lists the shard {absent[0]}, which is not in {folder}: the download is incomplete. "
                        "Download the model again.")
    header: Header = {}
    where: dict[str, Path] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in where:
                raise error(f"{name} is in two shards of {folder} ({where[name].name} and {file.name}): the folder "
                            "mixes two downloads. Download the model again into an empty folder.")
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
