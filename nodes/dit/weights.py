"""Find and read ERNIE-Image DiT weights in the layouts users download (engine: no ComfyUI here).

- a Hugging Face snapshot (``baidu/ERNIE-Image``, ``-Turbo``): ``<snapshot>/transformer/`` with a config
  and (sharded) safetensors;
- one ``.safetensors`` file with the released keys, bare (the ComfyUI repack ``ernie-image-turbo.safetensors``) or
  under ``model.diffusion_model.`` (checkpoint-style community files); it has no config, so the architecture is
  read off the tensor shapes.

What is read is the state dict and the architecture; ``build.py`` builds the DiT from them.

Only safetensors are read here (GGUF files: ``gguf.py``): no pickles, no remote code.
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import torch

from ..errors import ErnieImageError, quoted
from ..model_files import (
    Header,
    dit_folder,
    read_folder_headers,
    read_header,
    read_json,
    read_safetensors,
    read_tensors,
)
from ..quant_layout import (
    FP8_FORMATS,
    SCALED_MARKER,
    check_layout,
    check_scale_values,
    header_metadata,
    layer_formats,
)
from ..structure import QUANTIZED_SUFFIXES, SCALE_SUFFIXES, Architecture, check_structure, count_blocks
from .dit import ErnieImageDiT

# A key every ERNIE-Image DiT has and no other model in ComfyUI's folders does, and the others its shape is read off.
MARKER_KEY = "layers.0.adaLN_sa_ln.weight"
REQUIRED_KEYS = (MARKER_KEY, "x_embedder.proj.weight", "layers.0.self_attention.norm_q.weight",
                 "layers.0.mlp.gate_proj.weight", "final_linear.weight")
_BLOCK_KEY = re.compile(r"layers\.\d+\.adaLN_sa_ln\.")  # in every shard of a sharded ERNIE-Image DiT
# The released DiT has 36 blocks. 256 leaves room for larger variants, yet 256 blocks at the released width would
# be 57B parameters, more than any card holds: a count past it is a damaged or hostile file (one stray name
# "layers.1000000000.…" made the loader build a billion blocks), refused before a module is built.
MAX_BLOCKS = 256
WHAT = "ERNIE-Image DiT"
ADVICE = ("Download it again, or pick ernie-image.safetensors or ernie-image-turbo.safetensors (or a snapshot "
          "folder).")
SCALE_ADVICE = "The file is damaged: download it again, or use the bf16 file (ernie-image-turbo.safetensors)."
DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})  # what build.py holds or casts from
# Rank of each tensor the architecture is read off, in the words of the error when a file's differs.
_READ_OFF = {"x_embedder.proj.weight": "[hidden, in_channels, patch, patch]",
             "layers.0.self_attention.norm_q.weight": "[head_dim]",
             "layers.0.mlp.gate_proj.weight": "[ffn_hidden, hidden]", "final_linear.weight": "[out, hidden]",
             "text_proj.weight": "[hidden, text_in_dim]"}
# The architecture's fields and their defaults (diffusers' config names); config.json's other fields say nothing
# about the weights.
_DEFAULTS = {name: parameter.default for name, parameter in inspect.signature(ErnieImageDiT).parameters.items()
             if parameter.kind is parameter.POSITIONAL_OR_KEYWORD and name not in ("dtype", "device", "operations")}
_INFERRED = ("hidden_size", "num_attention_heads", "num_layers", "ffn_hidden_size", "in_channels", "out_channels",
             "patch_size", "text_in_dim")  # what the shapes say (the rope split and the rest only a config does)


def _describe_foreign(keys: list[str]) -> str:
    """A guess at what a wrong file holds, to make the error useful."""
    if any(k.startswith(("double_blocks.", "model.diffusion_model.double_blocks.")) for k in keys):
        return "it looks like a Flux model"
    if any(k.startswith(("model.diffusion_model.", "input_blocks.")) for k in keys):
        return "it looks like a Stable Diffusion checkpoint"  # before the text encoder: it holds one too
    if any(k.startswith(("encoder.", "decoder.")) for k in keys):
        return "it looks like a VAE"
    if any(k.startswith("blocks.") and ".cross_attn." in k for k in keys):
        return "it looks like a Wan video model"  # community GGUFs of Wan have these names
    if any(".self_attn." in k for k in keys):
        return "it looks like a text encoder or language model"
    return f"its first keys are {[quoted(k) for k in keys[:3]]}"


def check_dit_keys(keys: list[str], source: str) -> None:
    """A clear error unless ``keys`` are those of a whole ERNIE-Image DiT."""
    present = set(keys)
    missing = [k for k in REQUIRED_KEYS if k not in present]
    if not missing:
        return
    if any(_BLOCK_KEY.match(k) for k in keys):
        raise ErnieImageError(
            f"{source} holds only part of an ERNIE-Image DiT (no {missing[0]}): it looks like one shard of a "
            "snapshot's transformer/ folder. Put the whole snapshot folder under models/diffusers/ and pick it, "
            "or use the single file ernie-image-turbo.safetensors."
        )
    raise ErnieImageError(
        f"{source} is not an ERNIE-Image diffusion model ({_describe_foreign(keys)}). "
        "Pick ernie-image.safetensors or ernie-image-turbo.safetensors (or a snapshot folder)."
    )


def _check_read_off_shapes(state_dict, source: str) -> None:
    """The tensors the architecture is read off have their ranks and no empty side, so reading it cannot fail."""
    for key, layout in _READ_OFF.items():
        shape = tuple(state_dict[key].shape) if key in state_dict else None
        if shape is not None and (len(shape) != layout.count(",") + 1 or 0 in shape):
            raise ErnieImageError(f"{source}: {key} has shape {list(shape)}; an ERNIE-Image DiT's is {layout}. "
                                  f"{ADVICE}")


def config_from_state_dict(state_dict, source: str) -> dict:
    """The ``ErnieImageTransformer2DModel`` config that matches these weights (tensors, or a header's
    ``TensorInfo``: anything with a ``shape``), read off their shapes."""
    keys = list(state_dict)
    check_dit_keys(keys, source)
    _check_read_off_shapes(state_dict, source)
    proj = state_dict["x_embedder.proj.weight"]  # [hidden, in_channels, p, p]
    hidden, in_channels, patch = proj.shape[0], proj.shape[1], proj.shape[2]
    head_dim = state_dict["layers.0.self_attention.norm_q.weight"].shape[0]
    num_layers = 1 + max(int(m.group(1)) for k in keys if (m := re.match(r"layers\.(\d+)\.", k)))
    text_proj = state_dict.get("text_proj.weight")
    return {
        "hidden_size": hidden,
        "num_attention_heads": hidden // head_dim,
        "num_layers": num_layers,
        "ffn_hidden_size": state_dict["layers.0.mlp.gate_proj.weight"].shape[0],
        "in_channels": in_channels,
        "out_channels": state_dict["final_linear.weight"].shape[0] // (patch * patch),
        "patch_size": patch,
        "text_in_dim": text_proj.shape[1] if text_proj is not None else hidden,
        # The released model splits its 128-wide heads as (32, 48, 48); other head sizes keep those proportions.
        "rope_axes_dim": (head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8),
    }


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_config(config: dict, source: str) -> dict:
    """The DiT's architecture fields of ``config`` (defaults for those it lacks, the rest dropped), once each is
    of a type and in a range the DiT can be built from; ``source`` names where they come from in the error."""
    full = {**_DEFAULTS, **{k: v for k, v in config.items() if k in _DEFAULTS}}

    def refuse(field: str, needs: str):
        raise ErnieImageError(f"{source}: {field} is {full[field]!r}; an ERNIE-Image DiT needs {needs}. {ADVICE}")

    for field in _INFERRED:
        if type(full[field]) is not int or full[field] < 1:
            refuse(field, "a positive whole number")
    if full["num_layers"] > MAX_BLOCKS:
        refuse("num_layers", f"at most {MAX_BLOCKS} (the released model has 36)")
    if full["hidden_size"] % full["num_attention_heads"]:
        refuse("num_attention_heads", f"a divisor of hidden_size {full['hidden_size']}")
    head_dim = full["hidden_size"] // full["num_attention_heads"]
    axes = full["rope_axes_dim"]
    if (not isinstance(axes, list | tuple) or len(axes) != 3 or any(type(a) is not int or a < 2 or a % 2 for a in axes)
            or sum(axes) != head_dim):
        refuse("rope_axes_dim", f"three positive even numbers that add up to the head width {head_dim}")
    if not _is_number(full["rope_theta"]) or full["rope_theta"] <= 0:
        refuse("rope_theta", "a finite positive number")
    if not _is_number(full["eps"]) or not 0 < full["eps"] < 1:
        refuse("eps", "a finite number between 0 and 1")
    if type(full["qk_layernorm"]) is not bool:
        refuse("qk_layernorm", "true or false")
    return full


class _TorchLayers:
    """torch's own layers with comfy.ops' names and the same state-dict keys: the DiT built from them on the meta
    device lists the names and shapes its weights must have, without ComfyUI and without allocating."""

    Linear, Conv2d, RMSNorm = torch.nn.Linear, torch.nn.Conv2d, torch.nn.RMSNorm


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the DiT with ``config`` (checked by ``check_config``) has, by name, with its shape."""
    model = ErnieImageDiT(**config, device="meta", operations=_TorchLayers)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def check_dit_header(header: Header, source: str, declared: dict | None = None, config_source: str | None = None,
                     formats: dict[str, str] | None = None) -> dict:
    """The DiT's architecture once the header is known to hold exactly it: its blocks counted (and capped) first,
    then every name and shape against the DiT built on the meta device; ``declared`` is a snapshot's config
    (``config_source`` names it), which must agree with what the shards hold; ``formats``: the quantized layers'
    formats (``layer_formats``), whose weights and scales must have the shapes and dtypes their formats give them
    (build.py's layers multiply one scale into each weight: a scale per row or per block would raise deep inside
    torch there, or be folded into the wrong axis). No tensor read, no module built before the count is known."""
    check_dit_keys(list(header), source)
    formats = formats or {}
    # A weight in a format other than fp8 is stored its own way (NVFP4 packs two values a byte; quant_layout.py).
    packed = frozenset(f"{layer}.weight" for layer, fmt in formats.items() if fmt not in FP8_FORMATS)
    check_layout(header, formats, source, "Use the bf16 file (ernie-image-turbo.safetensors) or a file with one "
                 "scale per weight.")
    count_blocks(header, "layers.", MAX_BLOCKS, source, WHAT, ADVICE, quantized=QUANTIZED_SUFFIXES, packed=packed)
    inferred = config_from_state_dict(header, source)
    if declared is None:
        config = check_config(inferred, source)
    else:
        for field in _INFERRED:
            if field in declared and declared[field] != inferred[field]:
                raise ErnieImageError(
                    f"{config_source} says {field} {declared[field]!r}, but the weights in {source} hold "
                    f"{inferred[field]}: the config and the weights are not of one model, or one is damaged. "
                    "Download the snapshot again.")
        config = check_config(declared, config_source or source)
    check_structure(header, Architecture(WHAT, expected_shapes(config), ADVICE, ignored=(SCALED_MARKER,),
                                         quantized=QUANTIZED_SUFFIXES, dtypes=DTYPES, packed=packed), source)
    return config


def _scale_keys(keys) -> list[str]:
    return [k for k in keys if k.endswith(tuple("." + suffix for suffix in SCALE_SUFFIXES))]


def _check_scale_values(scales: dict[str, torch.Tensor], formats: dict[str, str], compute: torch.dtype,
                        source: str) -> None:
    """The scales' values, read alone (a few numbers) before the weights, for the DiT computing in ``compute``."""
    check_scale_values(scales, formats, compute, source, SCALE_ADVICE)


# Where the community's single files put the released keys (ComfyUI's checkpoint layout); bare keys are the repack's.
PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def _prefix(keys) -> str:
    """The ComfyUI prefix in front of the DiT's keys in a single file ("" for bare keys)."""
    return next((prefix for prefix in PREFIXES if prefix + MARKER_KEY in keys), "")


def _single_file_header(path: Path) -> tuple[Header, str, dict, dict[str, str]]:
    """One safetensors file's DiT tensors (released keys), its prefix, the architecture and the quantized layers'
    formats, checked from the header (and the layers' few bytes of configuration) alone."""
    header = read_header(path)
    prefix = _prefix(header)
    # Under a prefix, the file's other keys are the other models of a checkpoint (its VAE, text encoder): not read.
    dit = {k[len(prefix):]: v for k, v in header.items() if k.startswith(prefix)}

    def read(keys):
        return {k[len(prefix):]: v for k, v in read_safetensors(path, [prefix + k for k in keys]).items()}

    formats = layer_formats(dit, read, header_metadata(path), str(path), ADVICE, prefix=prefix)
    return dit, prefix, check_dit_header(dit, str(path), formats=formats), formats


def read_single_file(path: Path, compute: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """The DiT's tensors (released keys; the file's other keys dropped) and architecture from one safetensors
    file, for a DiT computing in ``compute``."""
    dit, prefix, config, formats = _single_file_header(path)  # before reading or building anything
    scales = read_safetensors(path, [prefix + k for k in _scale_keys(dit)])
    _check_scale_values({k[len(prefix):]: v for k, v in scales.items()}, formats, compute, str(path))
    state_dict = {k[len(prefix):]: v for k, v in read_safetensors(path, [prefix + k for k in dit]).items()}
    return state_dict, config


def _folder_header(folder: Path) -> tuple[Header, dict[str, Path], dict, dict[str, str]]:
    """A diffusers ``transformer/`` folder's tensors, the shard of each, the architecture and the quantized layers'
    formats, checked from its config and the shards' headers (and the layers' few bytes of configuration) alone."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ErnieImageError(f"{folder} has no config.json: it is not a diffusers model folder. Download it again.")
    config = read_json(config_path)
    class_name = config.get("_class_name")
    if class_name != "ErnieImageTransformer2DModel":
        raise ErnieImageError(
            f"{folder} holds a {class_name}, not an ERNIE-Image transformer. Pick an ERNIE-Image snapshot folder."
        )
    header, where = read_folder_headers(folder)  # a truncated shard is named here
    formats = layer_formats(header, lambda keys: read_tensors(where, keys), header_metadata(folder), str(folder),
                            ADVICE)
    return header, where, check_dit_header(header, str(folder), config, str(config_path), formats), formats


def read_transformer_folder(folder: Path, compute: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """The DiT's tensors and architecture from a diffusers ``transformer/`` folder (config + safetensors shards), for
    a DiT computing in ``compute``."""
    header, where, config, formats = _folder_header(folder)
    _check_scale_values(read_tensors(where, _scale_keys(header)), formats, compute, str(folder))
    return read_tensors(where, header), config


def tensor_locations(path: Path) -> tuple[dict[str, tuple[Path, str]], dict]:
    """Where each released key of the DiT that ``read_dit`` read from ``path`` lies (its file, its name there), and
    the header metadata (an fp8 file's quantization layout may be there): from the headers alone. For code that
    reads a few of its tensors again (LoRAs on a quantized DiT: ``quant/requantize.py``)."""
    if path.is_dir():
        folder = dit_folder(path)
        header, files = read_folder_headers(folder)
        return {name: (files[name], name) for name in header}, header_metadata(folder)
    header = read_header(path)
    prefix = _prefix(header)
    return {k[len(prefix):]: (path, k) for k in header if k.startswith(prefix)}, header_metadata(path)


def _dit_source(path: Path) -> Path:
    """The folder (``transformer/``) or the safetensors file the DiT at ``path`` is read from."""
    if path.is_dir():
        folder = dit_folder(path)  # the one rule, as the plan and the saved quantized DiTs read the folder
        if not folder.is_dir():
            raise ErnieImageError(
                f"The snapshot {path} has no transformer/ folder. The download is incomplete: "
                "download the whole snapshot (baidu/ERNIE-Image or baidu/ERNIE-Image-Turbo)."
            )
        return folder
    if path.suffix != ".safetensors":
        raise ErnieImageError(f"{path} is not a .safetensors file; the DiT loads from safetensors and GGUF files only.")
    return path


def read_dit(path: Path, compute: torch.dtype) -> tuple[dict[str, torch.Tensor], dict]:
    """The DiT's tensors (released keys) and architecture from a snapshot folder, its ``transformer/`` folder, or a
    single safetensors file, for a DiT computing in ``compute`` (its scales are checked against that dtype's
    range)."""
    source = _dit_source(path)
    return read_transformer_folder(source, compute) if source.is_dir() else read_single_file(source, compute)


def dit_config(path: Path) -> dict:
    """The architecture of the DiT at ``path`` (as ``read_dit`` takes it), checked from the headers alone: no
    tensor read."""
    source = _dit_source(path)
    return _folder_header(source)[2] if source.is_dir() else _single_file_header(source)[2]
