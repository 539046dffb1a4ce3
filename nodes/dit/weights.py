"""Find and read ERNIE-Image DiT weights in the layouts users download (engine: no ComfyUI here).

- a Hugging Face snapshot (``baidu/ERNIE-Image``, ``-Turbo``): ``<snapshot>/transformer/`` with a config
  and (sharded) safetensors;
- one ``.safetensors`` file with the released keys, bare (the ComfyUI repack ``ernie-image-turbo.safetensors``) or
  under ``model.diffusion_model.`` (checkpoint-style community files); it has no config, so the architecture is
  read off the tensor shapes.

What is read is the state dict and the architecture; ``build.py`` builds the DiT from them.

Only safetensors are read: no pickles, no remote code.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..errors import ErnieImageError
from ..model_files import check_safetensors_files, read_json, read_safetensors, safetensors_keys

# A key every ERNIE-Image DiT has and no other model in ComfyUI's folders does, and the others its shape is read off.
MARKER_KEY = "layers.0.adaLN_sa_ln.weight"
REQUIRED_KEYS = (MARKER_KEY, "x_embedder.proj.weight", "layers.0.self_attention.norm_q.weight",
                 "layers.0.mlp.gate_proj.weight", "final_linear.weight")
_BLOCK_KEY = re.compile(r"layers\.\d+\.adaLN_sa_ln\.")  # in every shard of a sharded ERNIE-Image DiT


def _describe_foreign(keys: list[str]) -> str:
    """A guess at what a wrong file holds, to make the error useful."""
    if any(k.startswith(("double_blocks.", "model.diffusion_model.double_blocks.")) for k in keys):
        return "it looks like a Flux model"
    if any(k.startswith(("model.diffusion_model.", "input_blocks.")) for k in keys):
        return "it looks like a Stable Diffusion checkpoint"  # before the text encoder: it holds one too
    if any(k.startswith(("encoder.", "decoder.")) for k in keys):
        return "it looks like a VAE"
    if any(".self_attn." in k for k in keys):
        return "it looks like a text encoder or language model"
    return f"its first keys are {keys[:3]}"


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


def config_from_state_dict(state_dict: dict[str, torch.Tensor], source: str) -> dict:
    """The ``ErnieImageTransformer2DModel`` config that matches these weights, read off their shapes."""
    keys = list(state_dict)
    check_dit_keys(keys, source)
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


# Where the community's single files put the released keys (ComfyUI's checkpoint layout); bare keys are the repack's.
PREFIXES = ("model.diffusion_model.", "diffusion_model.")


def _prefix(keys) -> str:
    """The ComfyUI prefix in front of the DiT's keys in a single file ("" for bare keys)."""
    return next((prefix for prefix in PREFIXES if prefix + MARKER_KEY in keys), "")


def read_single_file(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The DiT's tensors (released keys; the file's other keys dropped) and architecture from one safetensors
    file."""
    keys = safetensors_keys(path)
    prefix = _prefix(keys)
    check_dit_keys([k[len(prefix):] for k in keys if k.startswith(prefix)], str(path))  # before reading gigabytes
    state_dict = {k[len(prefix):]: v for k, v in read_safetensors(path).items() if k.startswith(prefix)}
    return state_dict, config_from_state_dict(state_dict, str(path))


def read_transformer_folder(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The DiT's tensors and architecture from a diffusers ``transformer/`` folder (config + safetensors shards)."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ErnieImageError(f"{folder} has no config.json: it is not a diffusers model folder. Download it again.")
    config = read_json(config_path)
    class_name = config.get("_class_name")
    if class_name != "ErnieImageTransformer2DModel":
        raise ErnieImageError(
            f"{folder} holds a {class_name}, not an ERNIE-Image transformer. Pick an ERNIE-Image snapshot folder."
        )
    check_safetensors_files(folder)
    state_dict: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state_dict.update(read_safetensors(shard))
    check_dit_keys(list(state_dict), str(folder))
    return state_dict, {k: v for k, v in config.items() if not k.startswith("_")}


def read_dit(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The DiT's tensors (released keys) and architecture from a snapshot folder, its ``transformer/`` folder, or a
    single safetensors file."""
    if path.is_dir():
        if (path / "model_index.json").is_file():
            transformer_dir = path / "transformer"
            if not transformer_dir.is_dir():
                raise ErnieImageError(
                    f"The snapshot {path} has no transformer/ folder. The download is incomplete: "
                    "download the whole snapshot (baidu/ERNIE-Image or baidu/ERNIE-Image-Turbo)."
                )
            return read_transformer_folder(transformer_dir)
        return read_transformer_folder(path)
    if path.suffix != ".safetensors":
        raise ErnieImageError(f"{path} is not a .safetensors file; only safetensors weights are loaded.")
    return read_single_file(path)
