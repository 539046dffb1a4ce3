"""Ministral 3 language models in ComfyUI's single-file layout (engine: no ComfyUI here).

ComfyUI's repacks of ERNIE-Image's text encoder (``ministral-3-3b.safetensors``) and Prompt Enhancer
(``ernie-image-prompt-enhancer.safetensors``) hold the language model's keys plus the Mistral tokenizer as a
``tekken_model`` entry (ComfyUI's own Ministral 3 loader reads it from there). There is no config: the geometry is
read off the weight shapes, the rotary settings are Ministral 3's defaults. Only safetensors are read.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import torch

from .errors import ErnieImageError
from .model_files import builds_weights, read_safetensors, safetensors_keys

HEAD_DIM = 128  # every Ministral 3 model has 128-wide attention heads
_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.", "model.lm_head.": "lm_head."}


@builds_weights
def read_ministral_file(
    path: Path,
    dtype: torch.dtype,
    *,
    what: str,
    instead: str,
    chat_template: str | None = None,
    error: type[ErnieImageError] = ErnieImageError,
):
    """``(Ministral3ForCausalLM, tokenizer)`` from one ComfyUI-style file, on the CPU in eval mode.

    ``what`` names the model in errors ("text encoder", "prompt enhancer"), ``instead`` says what to load when the
    file cannot be used, ``chat_template`` is given to the tokenizer, ``error`` is the exception type raised.
    """
    from transformers import Ministral3ForCausalLM

    keys = safetensors_keys(path)  # a wrong file is refused before it is read
    if not any(k.endswith("embed_tokens.weight") for k in keys):
        raise error(f"{path.name} is not a Ministral 3 {what} (it has no token embeddings): {instead}")
    if "tekken_model" not in keys:
        raise error(f"{path.name} carries no tokenizer (no 'tekken_model' entry, as in ComfyUI's repack): {instead}")
    state = read_safetensors(path)
    tekken = state.pop("tekken_model")
    for old, new in _PREFIXES.items():
        state = {new + k[len(old):] if k.startswith(old) else k: v for k, v in state.items()}
    if any(not v.is_floating_point() or v.element_size() < 2 for v in state.values()):
        raise error(f"{path.name} holds quantized weights; load the bf16/fp16 {what} file instead")
    config = _config_from_state(state, path, what, error)
    model = Ministral3ForCausalLM.from_pretrained(None, config=config, state_dict=state, dtype=dtype)
    return model.eval(), _tekken_tokenizer(tekken, chat_template, instead, error)


def _config_from_state(state: dict[str, torch.Tensor], path: Path, what: str, error: type[ErnieImageError]):
    """The Ministral 3 geometry read off the weight shapes (rope settings: Ministral 3's defaults)."""
    from transformers import Ministral3Config

    try:
        vocab, hidden = state["model.embed_tokens.weight"].shape
        layers = 1 + max(int(m.group(1)) for k in state if (m := re.match(r"model\.layers\.(\d+)\.", k)))
        query = state["model.layers.0.self_attn.q_proj.weight"].shape[0]
        key = state["model.layers.0.self_attn.k_proj.weight"].shape[0]
        intermediate = state["model.layers.0.mlp.gate_proj.weight"].shape[0]
    except (KeyError, ValueError) as e:
        raise error(f"{path.name} is not a Ministral 3 {what} (missing {e})") from e
    tied = "lm_head.weight" not in state or torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    return Ministral3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=query // HEAD_DIM, num_key_value_heads=key // HEAD_DIM, head_dim=HEAD_DIM,
        tie_word_embeddings=tied,
    )


def _tekken_tokenizer(tekken: torch.Tensor, chat_template: str | None, instead: str, error: type[ErnieImageError]):
    """A tokenizer from the ``tekken.json`` bytes stored in the file."""
    try:
        from transformers.integrations.mistral import convert_tekken_tokenizer
    except ImportError as e:
        raise error(
            "reading the tokenizer stored in a ComfyUI single file needs a newer transformers (5.17 and 5.24 are "
            f"tested): update it, or {instead}"
        ) from e

    with tempfile.TemporaryDirectory() as folder:
        tekken_file = Path(folder) / "tekken.json"
        tekken_file.write_bytes(tekken.numpy().tobytes())
        return convert_tekken_tokenizer(str(tekken_file), chat_template)
