"""Ministral 3 language models from safetensors, checked before anything is built (engine: no ComfyUI here).

The text encoder and the Prompt Enhancer are both Ministral 3 language models, found in three layouts:

- a Hugging Face folder with ``config.json`` and shards: a snapshot's ``text_encoder/`` (a ``Mistral3Model``, whose
  language model alone is loaded: the vision tower is never used), its ``pe/`` (``Ministral3ForCausalLM``), or a PE
  folder;
- ComfyUI's repacks ``ministral-3-3b.safetensors`` and ``ernie-image-prompt-enhancer.safetensors``: the language
  model's keys plus the Mistral tokenizer as a ``tekken_model`` entry (ComfyUI's own Ministral 3 loader reads it
  from there). There is no config: the geometry is read off the weight shapes, the rotary settings are Ministral 3's
  defaults.

Whatever the layout, the language model's keys are those under what precedes ``embed_tokens.weight``. Before any
weight is read, the header is checked against the model built from the config on the ``meta`` device
(``structure``): layers counted and capped, every tensor there with its shape (a missing one would be left at random
values by transformers, silently), nothing unknown. transformers' own loading report is the second guard.
Only safetensors are read.

``fp8``: the decoder layers' linears are held in fp8 (``fp8_linear``). A file in core's scaled-fp8 or comfy_quant
layout (``quant_layout``) always loads so, its fp8 weights and scales as they are; a bf16/fp32 file asked for fp8 is
quantized one tensor at a time, so no bf16 copy of the linears is ever held beside the fp8 one.
"""

from __future__ import annotations

import copy
import math
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from .errors import ErnieImageError
from .fp8_linear import DECODER_LINEAR, quantize_rows, use_fp8_linears
from .model_files import Header, builds_weights, read_folder_headers, read_header, read_safetensors, read_tensors
from .quant_layout import (
    CONFIG_SUFFIX,
    FP8_FORMATS,
    SCALED_MARKER,
    check_layout,
    check_scale_values,
    header_metadata,
    layer_formats,
    split_quantization,
)
from .structure import Architecture, check_structure, count_blocks, is_ignored

HEAD_DIM = 128  # every Ministral 3 model has 128-wide attention heads
# Ministral 3 3B has 26 layers and the deepest open language models about 126 (Llama 3.1 405B): a count past 512 is
# a damaged or hostile file (one stray 128-byte tensor "model.layers.500.…" made the loader build 501 layers, 498 of
# them random), refused before a layer is built.
MAX_LAYERS = 512
# Parts of the files that the pack does not use, never read: the snapshot text encoder's vision tower and projector,
# and the tokenizer blob of ComfyUI's repacks (read apart, as the tokenizer).
IGNORED = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.",
           "tekken_model")
LM_HEADS = ("lm_head.weight", "model.lm_head.weight", "language_model.lm_head.weight")
LM_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})  # anything else is a quantized file
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
# What core's fp8 layouts add beside a layer's weight (scaled fp8's and comfy_quant's names), and scaled fp8's marker.
QUANT_SUFFIXES = (".scale_weight", ".scale_input", ".weight_scale", ".input_scale", CONFIG_SUFFIX)


class LanguageModelLayout:
    """Where a file keeps its language model: the keys under what precedes ``embed_tokens.weight`` (its
    ``prefix``), and an ``lm_head.weight`` beside them. Maps the file's keys to the names of a ``…ForCausalLM``
    (``model.layers.0.…``, ``lm_head.weight``) and back, so that errors name the file's own keys."""

    def __init__(self, header: Header, source: str, what: str, instead: str, error: type[ErnieImageError]):
        embeddings = [k for k in header if k.endswith("embed_tokens.weight") and not is_ignored(k, IGNORED)]
        if not embeddings:
            raise error(f"{source} is not a Ministral 3 {what} (it has no token embeddings): {instead}")
        if len(embeddings) > 1:
            raise error(f"{source} holds two language models ({embeddings[0]} and {embeddings[1]}): {instead}")
        self.prefix = embeddings[0][: -len("embed_tokens.weight")]
        self.model_names: dict[str, str] = {}  # the file's language-model keys → the model's names
        self.file_names: dict[str, str] = {}  # and back
        for key in header:
            if is_ignored(key, IGNORED):
                continue
            name = "lm_head.weight" if key in LM_HEADS else (
                "model." + key[len(self.prefix):] if key.startswith(self.prefix) else None)
            if name is None:
                continue
            if name in self.file_names:
                raise error(f"{source} holds {self.file_names[name]} and {key}, two copies of the {what}'s {name}: "
                            f"{instead}")
            self.model_names[key], self.file_names[name] = name, key

    def file_name(self, name: str) -> str:
        """The file's key for the model's ``name`` (what it would be called there when it is missing)."""
        if name in self.file_names:
            return self.file_names[name]
        return self.prefix + name[len("model."):] if name.startswith("model.") else name


def _config_from_header(header: Header, layout: LanguageModelLayout, layers: int, source: str, what: str,
                        error: type[ErnieImageError]):
    """The Ministral 3 geometry read off the weight shapes (rope settings: Ministral 3's defaults)."""
    from transformers import Ministral3Config

    read_off = [layout.file_name(name) for name in (
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.mlp.gate_proj.weight")]
    for key in read_off:
        if key not in header:
            raise error(f"{source} is not a Ministral 3 {what} (missing '{key}')")
        if len(header[key].shape) != 2 or 0 in header[key].shape:
            raise error(f"{source} is not a Ministral 3 {what}: {key} has shape {list(header[key].shape)}, not "
                        "[rows, columns]")
    vocab, hidden = header[read_off[0]].shape
    query, key, intermediate = (header[k].shape[0] for k in read_off[1:])
    if query % HEAD_DIM or key % HEAD_DIM:
        raise error(f"{source} is not a Ministral 3 {what}: its attention projections ({query}, {key} rows) are not "
                    f"whole {HEAD_DIM}-wide heads")
    return Ministral3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=query // HEAD_DIM, num_key_value_heads=key // HEAD_DIM, head_dim=HEAD_DIM,
        tie_word_embeddings="lm_head.weight" not in layout.file_names,
    )


def _meta_model(config, source: str, what: str, error: type[ErnieImageError]):
    """The language model of ``config`` on the meta device: its names and shapes, without allocating."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError, RuntimeError) as e:
        raise error(f"{source}: its config describes no Ministral 3 {what} that can be built ({e}). Download it "
                    "again.") from e


def _numbers(value, path: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a config (nested dicts and lists), with where it is."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{path}[{index}]")
    elif isinstance(value, float):
        yield path, value


def read_config(config_class, folder: Path, what: str, error: type[ErnieImageError] = ErnieImageError):
    """``config_class`` from ``folder``'s config.json, once every number in it is finite, its norm epsilon and rope
    theta positive: a NaN or negative epsilon loaded and made NaN outputs, with no error."""
    try:
        config = config_class.from_pretrained(folder)
    # transformers raises OSError, ValueError or TypeError for a config it cannot read, and huggingface_hub's
    # StrictDataclassFieldValidationError (an Exception) for a field of the wrong type.
    except Exception as e:
        raise error(f"{folder / 'config.json'} is not a config of a Ministral 3 {what} ({e}). Download it "
                    "again.") from e
    for part in (config, getattr(config, "text_config", None)):
        if part is None:
            continue
        bad = next(((path, number) for path, number in _numbers(part.to_dict()) if not math.isfinite(number)), None)
        eps = getattr(part, "rms_norm_eps", 1e-5)
        theta = (getattr(part, "rope_parameters", None) or {}).get("rope_theta", 1.0)
        if bad is None and not (isinstance(eps, int | float) and 0 < eps < 1):
            bad = ("rms_norm_eps", eps)
        if bad is None and not (isinstance(theta, int | float) and theta > 0):
            bad = ("rope_parameters.rope_theta", theta)
        if bad is not None:
            raise error(f"{folder / 'config.json'}: {bad[0]} is {bad[1]!r}, which no Ministral 3 {what} runs with (its "
                        "numbers are finite, its rms_norm_eps between 0 and 1, its rope_theta positive). Download it "
                        "again.")
    return config


def _fp8_scales(header: Header, where: Mapping[str, Path], dtype: torch.dtype, source: str, what: str, advice: str,
                error: type[ErnieImageError]) -> tuple[Header, dict[str, torch.Tensor]]:
    """The header without what core's fp8 layouts add, and each fp8 weight's scale (``[]`` or ``[rows, 1]``) by the
    file's key; ``{}`` for a plain file. The scales' shapes and the weights' dtypes are checked against their formats
    from the header, the scales' values (positive, normal, within ``dtype`` times fp8's largest value) as they are
    read; only the small tensors (scales, configurations) are read."""
    extra = [k for k in header if k == SCALED_MARKER or k.endswith(QUANT_SUFFIXES)]
    fp8_weights = {k for k, info in header.items() if info.dtype in FP8_DTYPES and k != SCALED_MARKER}
    if not extra and not fp8_weights:
        return header, {}
    formats = layer_formats(header, lambda keys: read_tensors(where, keys), _metadata(where), source, advice, error)
    check_layout(header, formats, source, advice, error, per_row=True)
    small = read_tensors(where, [k for k in extra if k != SCALED_MARKER])
    check_scale_values({k: v for k, v in small.items() if not k.endswith(CONFIG_SUFFIX)}, formats, dtype, source,
                       advice, error)
    shapes = {k: torch.empty(info.shape, dtype=FP8_DTYPES.get(info.dtype, torch.bfloat16), device="meta")
              for k, info in header.items() if k not in small}
    weights, quantized = split_quantization({**shapes, **small}, _metadata(where))
    scales = {}
    for layer, conf in quantized.layers.items():
        key = f"{layer}.weight"
        if conf["format"] not in FP8_FORMATS or key not in fp8_weights:
            raise error(f"{source}: {layer} is stored as {conf['format']}, which the {what} cannot load (fp8 weights "
                        f"with a scale can be). {advice}")
        scale = weights.get(f"{layer}.weight_scale")
        if scale is None:
            raise error(f"{source}: {key} has no scale: the file is damaged. {advice}")
        scales[key] = scale.float().reshape(() if scale.numel() == 1 else (-1, 1))
    unscaled = sorted(fp8_weights - set(scales))
    if unscaled:
        raise error(f"{source} holds quantized weights; load the bf16/fp16 {what} file instead ({unscaled[0]} is "
                    "fp8 without the scale or quantization configuration core's fp8 layouts give every fp8 weight)")
    return {k: info for k, info in header.items() if k not in extra}, scales


def _metadata(where: Mapping[str, Path]) -> dict[str, str]:
    metadata: dict[str, str] = {}
    for file in sorted(set(where.values())):
        metadata.update(header_metadata(file))
    return metadata


def _fp8_model(meta, state: dict[str, torch.Tensor], linears: Mapping[str, str], where: Mapping[str, Path],
               scales: Mapping[str, torch.Tensor], dtype: torch.dtype, source: str, what: str,
               error: type[ErnieImageError]):
    """``meta`` (on the meta device) with its decoder linears in fp8 and the rest of ``state`` in ``dtype``.
    ``linears``: the file's key → the model's name of each linear weight, read one at a time (a bf16 one is
    quantized and dropped before the next is read)."""
    use_fp8_linears(meta)
    state = {name: tensor.to(dtype) for name, tensor in state.items()}
    for key, name in linears.items():
        (tensor,) = read_tensors(where, [key]).values()
        state[name], scale = (tensor, scales[key]) if key in scales else quantize_rows(tensor)
        state[f"{name}_scale"] = scale
        # A file's scale is per tensor or per row: the layer takes the shape it has.
        meta.get_submodule(name.removesuffix(".weight")).weight_scale = torch.empty(scale.shape, device="meta")
    tied = meta.config.tie_word_embeddings
    if tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    try:
        meta.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise error(f"{source}: the {what}'s weights do not fit its model ({e}). Download it again.") from e
    if tied:
        meta.lm_head.weight = meta.model.embed_tokens.weight
    # Its rotary frequencies are computed, not stored: built on the meta device, they are made again here.
    meta.model.rotary_emb = type(meta.model.rotary_emb)(config=meta.config)
    meta.config.dtype = dtype
    return meta.eval()


@builds_weights
def load_ministral(header: Header, where: Mapping[str, Path], config, dtype: torch.dtype, *, source: str, what: str,
                   instead: str, error: type[ErnieImageError] = ErnieImageError, lm_head: bool = True,
                   fp8: bool = False):
    """A ``…ForCausalLM`` (CPU, eval mode) from the tensors ``header`` declares and ``where`` holds, once the header
    is known to hold exactly the model: ``config`` (None: read off the shapes, for ComfyUI's repacks) must agree with
    it. ``lm_head=False``: the head is not used (the text encoder), so it is neither read nor needed. ``fp8``: the
    decoder linears in fp8 (always so for a file in core's fp8 layout)."""
    advice = f"Download it again, or {instead}"
    header, scales = _fp8_scales(header, where, dtype, source, what, advice, error)
    layout = LanguageModelLayout(header, source, what, instead, error)
    if any(header[key].dtype not in LM_DTYPES for key in layout.model_names if key not in scales):
        raise error(f"{source} holds quantized weights; load the bf16/fp16 {what} file instead")
    misplaced = [key for key in scales if not DECODER_LINEAR.match(layout.model_names.get(key, ""))]
    if misplaced:
        raise error(f"{source} holds {misplaced[0]} in fp8: only the decoder layers' projections can be. {advice}")
    fp8 = fp8 or bool(scales)
    layers = count_blocks(header, layout.prefix + "layers.", MAX_LAYERS, source, f"Ministral 3 {what}", advice, error)
    inferred = config is None
    if inferred:
        config = _config_from_header(header, layout, layers, source, what, error)
    elif config.num_hidden_layers != layers:
        raise error(f"{source}: its config says num_hidden_layers {config.num_hidden_layers!r}, but its weights hold "
                    f"{layers} layers: the config and the weights are not of one model, or one is damaged. {advice}")
    config = copy.deepcopy(config)
    if not lm_head:
        config.tie_word_embeddings = True  # the head shares the embeddings: nothing to read, nothing random
    meta = _meta_model(config, source, what, error)
    expected = {name: tuple(t.shape) for name, t in meta.state_dict().items() if lm_head or name != "lm_head.weight"}
    optional = {layout.file_name("lm_head.weight")} if config.tie_word_embeddings else set()
    check_structure(header, Architecture(f"Ministral 3 {what}", {layout.file_name(n): s for n, s in expected.items()},
                                         advice, optional=frozenset(optional),
                                         ignored=IGNORED if lm_head else (*IGNORED, *LM_HEADS)), source, error)
    wanted = [key for key, name in layout.model_names.items() if name in expected]
    linears = {key: layout.model_names[key] for key in wanted if fp8 and DECODER_LINEAR.match(layout.model_names[key])}
    state = {layout.model_names[key]: tensor
             for key, tensor in read_tensors(where, [k for k in wanted if k not in linears]).items()}
    if inferred and "lm_head.weight" in state:
        config.tie_word_embeddings = torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    if fp8:
        meta.config.tie_word_embeddings = config.tie_word_embeddings
        return _fp8_model(meta, state, linears, where, scales, dtype, source, what, error)
    # sdpa always: a config.json may name another implementation (eager, or flash_attention_2 that is not
    # installed), and the pack's PE decoding and the reference embeddings are sdpa's.
    model, info = type(meta).from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                             attn_implementation="sdpa", output_loading_info=True)
    random = set(info["missing_keys"]) - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    left = sorted(random | set(info["mismatched_keys"]))
    if left or info["error_msgs"]:
        raise error(f"{source}: transformers could not load {left[:3] or info['error_msgs'][:1]} of the {what} (it "
                    f"would have left them at random values). {advice}")
    return model.eval()


def load_ministral_folder(folder: Path, config, dtype: torch.dtype, *, what: str, instead: str,
                          error: type[ErnieImageError] = ErnieImageError, lm_head: bool = True, fp8: bool = False):
    """``load_ministral`` from a Hugging Face folder's safetensors shards (its ``config`` already read)."""
    header, where = read_folder_headers(folder, error)
    return load_ministral(header, where, config, dtype, source=str(folder), what=what, instead=instead, error=error,
                          lm_head=lm_head, fp8=fp8)


def read_ministral_file(
    path: Path,
    dtype: torch.dtype,
    *,
    what: str,
    instead: str,
    chat_template: str | None = None,
    error: type[ErnieImageError] = ErnieImageError,
    lm_head: bool = True,
    fp8: bool = False,
):
    """``(…ForCausalLM, tokenizer)`` from one ComfyUI-style file, on the CPU in eval mode.

    ``what`` names the model in errors ("text encoder", "prompt enhancer"), ``instead`` says what to load when the
    file cannot be used, ``chat_template`` is given to the tokenizer, ``error`` is the exception type raised;
    ``lm_head=False``: the head is not used (the text encoder); ``fp8``: as ``load_ministral``.
    """
    header = read_header(path)  # a wrong file is refused before it is read
    LanguageModelLayout(header, str(path), what, instead, error)
    if "tekken_model" not in header:
        raise error(f"{path} carries no tokenizer (no 'tekken_model' entry, as in ComfyUI's repack): {instead}")
    model = load_ministral(header, dict.fromkeys(header, path), None, dtype, source=str(path), what=what,
                           instead=instead, error=error, lm_head=lm_head, fp8=fp8)
    (tekken,) = read_safetensors(path, ["tekken_model"]).values()
    return model, _tekken_tokenizer(tekken, chat_template, instead, error)


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
