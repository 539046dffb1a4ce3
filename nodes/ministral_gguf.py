"""Ministral 3 language models (the text encoder, the PE) from GGUF files as llama.cpp's converter writes them
(engine: no ComfyUI here).

The community's GGUF text encoders and PEs are made with llama.cpp's ``convert_hf_to_gguf.py`` (and its
``llama-quantize`` for the K-quants): its tensor names (``token_embd.weight``, ``blk.<i>.attn_q.weight``, …), its
metadata (``general.architecture`` ``mistral3``, or ``llama`` from older converters; ``<arch>.block_count``, …) and
the tokenizer in ``tokenizer.ggml.*`` (``gguf/tokenizer.py``). The converter reorders the rows of every query and key
projection for llama.cpp's RoPE (llama.cpp 0c1e57098, ``conversion/llama.py``, ``LlamaModel.permute``: per head,
``reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)``; the keys with the key-value head count); ``unpermute``
undoes it. It moves whole rows, and a quantized row is whole blocks, so the blocks are reordered without decoding.

As for safetensors (``ministral_file``), the header is checked before anything is built: names mapped to
transformers' (an unknown one refused), layers counted and capped, every tensor there with the shape of the model the
token embeddings and the first layer imply, the metadata's numbers (layers, width, heads, vocabulary, rope settings)
agreeing with the tensors and with Ministral 3, the types ones the pack reads. Shapes cannot tell ERNIE-Image's text
encoder and PE from Mistral's own Ministral 3 3B (26 layers of 3072, 131,072 tokens), so ``general.name`` is logged,
and a file whose name is one of Mistral's releases is refused. Values are checked as each tensor is read.

The decoder layers' projections stay in their blocks where quantized (``gguf/linear.py``: decoded per call, where the
layer runs), and so do the text encoder's token embeddings (only the rows looked up are decoded); the PE's embeddings
(its tied head reads the whole table at every token), a separate head and the norms are decoded once into the compute
dtype.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch

from .cancel import check_cancel
from .errors import ErnieImageError, quoted
from .fp8_linear import DECODER_LINEAR
from .gguf.dequant import BLOCKS, SUPPORTED, UNSUPPORTED_ADVICE, dequantize
from .gguf.linear import GGUFBlockEmbedding, GGUFBlockLinear
from .gguf.reader import GGUFTensor, first_bad_value, read_gguf
from .gguf.tokenizer import gguf_tokenizer, is_tokenizer_field
from .ministral_file import HEAD_DIM, MAX_LAYERS, _meta_model
from .model_files import builds_weights
from .structure import Architecture, check_structure, count_blocks, natural

ARCHITECTURES = ("mistral3", "llama")  # llama.cpp's converter today, and before it had Ministral 3
# A layer's tensors: llama.cpp's names → transformers' (``model.layers.<i>.`` before them).
LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")
EMBEDDINGS = "model.embed_tokens.weight"
# Mistral's own Ministral 3 releases (``Ministral-3-3B-Instruct-2512``, …): the converter names a file after them.
MISTRAL_RELEASE = re.compile(r"ministral[\s_-]*3\b.*\b(instruct|reasoning|base)\b", re.IGNORECASE)
NAME_FIELDS = ("general.name", "general.basename", "general.finetune")
# Ministral 3's settings (transformers' Ministral3Config defaults, which ``ministral_file`` builds ComfyUI's repacks
# with) and the fields llama.cpp's converter writes them to: a file that says otherwise is not ERNIE-Image's model.
ROPE_FIELDS = {"rope.freq_base": "rope_theta", "rope.scaling.factor": "factor",
               "rope.scaling.original_context_length": "original_max_position_embeddings",
               "rope.scaling.yarn_beta_fast": "beta_fast", "rope.scaling.yarn_beta_slow": "beta_slow",
               "rope.scaling.yarn_log_multiplier": "mscale_all_dim",
               "attention.temperature_scale": "llama_4_scaling_beta"}


def model_name(name: str) -> str | None:
    """transformers' name of the GGUF tensor ``name``, or None for a name no Ministral 3 tensor has."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    match = _LAYER.match(name)
    if match is None or match[2] not in LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}.weight"


def gguf_name(name: str) -> str:
    """The GGUF name of transformers' tensor ``name`` (``model_name``'s inverse)."""
    top = {v: k for k, v in TOP_NAMES.items()}
    if name in top:
        return top[name]
    _, _, index, *part, _ = name.split(".")
    layer = {v: k for k, v in LAYER_NAMES.items()}[".".join(part)]
    return f"blk.{index}.{layer}.weight"


def _held_as_blocks(name: str, kind: str, lm_head: bool) -> bool:
    """Whether transformers' tensor ``name`` of GGUF type ``kind`` stays in its blocks: a quantized decoder projection,
    or the token table of a model whose head does not read it (``lm_head=False``: the text encoder)."""
    return kind in BLOCKS and (bool(DECODER_LINEAR.match(name)) or (name == EMBEDDINGS and not lm_head))


def held_bytes(name: str, tensor: GGUFTensor, dtype: torch.dtype, lm_head: bool = True) -> int:
    """The bytes the file's tensor ``name`` (llama.cpp's name) takes once loaded computing in ``dtype`` (what the
    memory plan counts): what stays in its blocks (``_held_as_blocks``) those, any other tensor decoded into
    ``dtype``; a head the model does not use (``lm_head=False``, the text encoder) none."""
    model = model_name(name)
    if model is None or (model == "lm_head.weight" and not lm_head):
        return 0
    if _held_as_blocks(model, tensor.kind, lm_head):
        return tensor.nbytes
    return tensor.numel * dtype.itemsize


def unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """The rows of a query or key projection (``[rows, …]``: values, or a quantized row's blocks) in transformers'
    order, from llama.cpp's (``LlamaModel.permute`` undone)."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


class MinistralGGUF:
    """A GGUF file's Ministral 3 language model, its header checked: the tensors by transformers' names, the
    config they make, and the file (for its tokenizer)."""

    def __init__(self, path: Path, what: str, instead: str, error: type[ErnieImageError] = ErnieImageError,
                 lm_head: bool = True):
        self.path, self.what, self.instead, self.error, self.lm_head = path, what, instead, error, lm_head
        self.advice = f"Download it again, or {instead}"
        try:
            self.file = read_gguf(path, lambda key: key.startswith(("general.", *ARCHITECTURES)) or
                                  is_tokenizer_field(key))
        except ErnieImageError as e:
            raise error(str(e)) from None
        self.architecture = self._field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise error(f"{path} holds a {quoted(self.architecture)} model (general.architecture), not a Ministral 3 "
                        f"{what}. {instead}")
        self._refuse_other_model()
        header = self.file.header()
        if not lm_head:
            header.pop("output.weight", None)  # the text encoder's head is not used: neither read nor needed
        unknown = sorted((k for k in header if model_name(k) is None), key=natural)
        if unknown:
            raise error(f"{path} holds {quoted(unknown[0])}, which no Ministral 3 {what} has (llama.cpp names its "
                        f"tensors token_embd, blk.<i>.attn_q, …): {self.advice}")
        layers = count_blocks(header, "blk.", MAX_LAYERS, str(path), f"Ministral 3 {what}", self.advice, error)
        self.config = self._config(header, layers)
        meta = _meta_model(self.config, str(path), what, error)
        expected = {gguf_name(n): tuple(t.shape) for n, t in meta.state_dict().items() if n != "lm_head.weight"}
        if not self.config.tie_word_embeddings:
            expected["output.weight"] = tuple(meta.lm_head.weight.shape)
        check_structure(header, Architecture(f"Ministral 3 {what}", expected, self.advice), str(path), error)
        self._check_metadata()
        odd = sorted((k for k in header if self.file.tensors[k].kind not in SUPPORTED), key=natural)
        if odd:
            raise error(f"{path} stores {odd[0]} as {self.file.tensors[odd[0]].kind}, a GGUF type this pack does "
                        f"not read. {UNSUPPORTED_ADVICE}")
        self.tensors = {model_name(k): self.file.tensors[k] for k in header}

    def _field(self, key: str, max_bytes: int = 1 << 16):
        try:
            return self.file.field(key, max_bytes)
        except ErnieImageError as e:
            raise self.error(str(e)) from None

    def _refuse_other_model(self) -> None:
        names = {key: self._field(key, 1 << 10) for key in NAME_FIELDS}
        logging.info("ERNIE-Image: %s: a GGUF %s named %s", self.path, self.what, quoted(names["general.name"]))
        for key, value in names.items():
            if isinstance(value, str) and MISTRAL_RELEASE.search(value):
                # Unverified either way: no model card says whether ERNIE-Image's text encoder is one of Mistral's
                # checkpoints unchanged (its snapshot ships the whole Mistral3Model, vision tower included), and
                # community guides pair ERNIE-Image with these files (README, "GGUF text encoders and PEs").
                raise self.error(
                    f"{self.path} is named {quoted(value)} ({key}): Mistral's own Ministral 3, not ERNIE-Image's "
                    f"{self.what} as its snapshot ships it. Their tensors have the same shapes; whether the weights "
                    f"are the same, no model card says, and another {self.what} would change every image without an "
                    f"error, so the pack does not take it. {self.instead}, or convert ERNIE-Image's own with "
                    "llama.cpp's convert_hf_to_gguf.py.")

    def _config(self, header, layers: int):
        """The Ministral 3 geometry the token embeddings and the first layer imply (Ministral 3's rope settings)."""
        from transformers import Ministral3Config

        read_off = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_gate.weight"]
        for key in read_off:
            if key not in header:
                raise self.error(f"{self.path} is not a Ministral 3 {self.what} (missing '{key}'). {self.advice}")
            if len(header[key].shape) != 2 or 0 in header[key].shape:
                raise self.error(f"{self.path} is not a Ministral 3 {self.what}: {key} has shape "
                                 f"{list(header[key].shape)}, not [rows, columns]. {self.advice}")
        vocab, hidden = header[read_off[0]].shape
        query, key, intermediate = (header[k].shape[0] for k in read_off[1:])
        if query % HEAD_DIM or key % HEAD_DIM or (query // HEAD_DIM) % (key // HEAD_DIM):
            raise self.error(f"{self.path} is not a Ministral 3 {self.what}: its attention projections ({query}, "
                             f"{key} rows) are not whole {HEAD_DIM}-wide heads, query heads by key heads. "
                             f"{self.advice}")
        return Ministral3Config(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
            num_attention_heads=query // HEAD_DIM, num_key_value_heads=key // HEAD_DIM, head_dim=HEAD_DIM,
            tie_word_embeddings="output.weight" not in header)

    def _check_metadata(self) -> None:
        """The metadata's numbers where the file has them: the tensors' (a file whose header contradicts itself is
        damaged) and Ministral 3's rope and norm settings."""
        config, arch = self.config, self.architecture
        told = {"block_count": config.num_hidden_layers, "embedding_length": config.hidden_size,
                "feed_forward_length": config.intermediate_size, "attention.head_count": config.num_attention_heads,
                "attention.head_count_kv": config.num_key_value_heads, "attention.key_length": HEAD_DIM,
                "attention.value_length": HEAD_DIM, "rope.dimension_count": HEAD_DIM, "vocab_size": config.vocab_size}
        for key, number in told.items():
            value = self._field(f"{arch}.{key}")
            if value is not None and value != number:
                raise self.error(f"{self.path} says {arch}.{key} = {quoted(value)}, but its tensors make it "
                                 f"{number}: the file is damaged. {self.advice}")
        settings = {**{f"{arch}.{key}": config.rope_parameters[name] for key, name in ROPE_FIELDS.items()},
                    f"{arch}.attention.layer_norm_rms_epsilon": config.rms_norm_eps}
        for key, number in settings.items():
            value = self._field(key)
            if value is not None and not (isinstance(value, int | float) and np.float32(value) == np.float32(number)):
                raise self.error(f"{self.path} says {key} = {quoted(value)}, where Ministral 3 has {number}: it is "
                                 f"not ERNIE-Image's {self.what}. {self.instead}")

    def tokenizer(self, add_bos: bool | None = None):
        """The tokenizer from the file's metadata, checked against the model's vocabulary (``gguf/tokenizer``;
        ``add_bos`` as there)."""
        return gguf_tokenizer(self._field, self.config.vocab_size, str(self.path), self.advice, self.error, add_bos)

    def _read(self, name: str, tensor: GGUFTensor) -> torch.Tensor:
        data = tensor.read()
        bad = first_bad_value(gguf_name(name), tensor.kind, data)
        if bad is not None:
            raise self.error(f"{self.path}: {bad}; a weight must be made of finite numbers. The file is damaged. "
                             f"{self.advice}")
        heads = {"q_proj": self.config.num_attention_heads, "k_proj": self.config.num_key_value_heads}
        projection = name.split(".")[-2]
        if projection in heads:
            rows = tensor.shape[0]
            data = unpermute(data.reshape(rows, -1), heads[projection]).reshape(data.shape)
        return data

    @builds_weights
    def build(self, dtype: torch.dtype):
        """The ``Ministral3ForCausalLM`` (CPU, eval mode) computing in ``dtype``: the decoder's quantized
        projections (and, without a head, the token table) held as blocks, every other weight decoded into
        ``dtype``. Cancel before each tensor. Without a head (the text encoder), ``lm_head`` is None."""
        meta = _meta_model(self.config, str(self.path), self.what, self.error)
        state = {}
        for name in sorted(self.tensors, key=natural):
            check_cancel()
            tensor = self.tensors[name]
            data = self._read(name, tensor)
            if _held_as_blocks(name, tensor.kind, self.lm_head):
                parent, _, child = name.removesuffix(".weight").rpartition(".")
                layer = (GGUFBlockEmbedding(data, tensor.kind, tensor.shape, dtype) if name == EMBEDDINGS else
                         GGUFBlockLinear(data, tensor.kind, tensor.shape))
                setattr(meta.get_submodule(parent), child, layer)
            elif tensor.kind in BLOCKS:
                state[name] = dequantize(data, tensor.kind, tensor.shape, torch.float32).to(dtype)
            else:
                state[name] = data.to(dtype)
        if not self.lm_head:
            meta.lm_head = None  # not read, not run: the text encoder is the language model alone
        tied = self.lm_head and self.config.tie_word_embeddings
        if tied:
            state["lm_head.weight"] = state[EMBEDDINGS]
        try:
            meta.load_state_dict(state, strict=False, assign=True)
        except RuntimeError as e:
            raise self.error(f"{self.path}: the {self.what}'s weights do not fit its model ({e}). "
                             f"{self.advice}") from e
        left = [name for name, t in [*meta.named_parameters(), *meta.named_buffers()] if t.is_meta]
        left = [name for name in left if "rotary_emb" not in name]
        if left:  # the header checks make this unreachable; said in words should they ever differ
            raise self.error(f"{self.path}: {left[0]} of the {self.what} was not read. {self.advice}")
        if tied:
            meta.lm_head.weight = meta.model.embed_tokens.weight
        # Its rotary frequencies are computed, not stored: built on the meta device, they are made again here.
        meta.model.rotary_emb = type(meta.model.rotary_emb)(config=meta.config)
        meta.config.dtype = dtype
        return meta.eval()


def read_ministral_gguf(path: Path, dtype: torch.dtype, *, what: str, instead: str,
                        error: type[ErnieImageError] = ErnieImageError, lm_head: bool = True,
                        add_bos: bool | None = None):
    """``(Ministral3ForCausalLM, tokenizer)`` from a llama.cpp GGUF file, on the CPU in eval mode; the arguments as
    ``ministral_file.read_ministral_file``'s (``lm_head=False``: the head is neither read nor needed; ``add_bos``:
    ``gguf_tokenizer``'s)."""
    model = MinistralGGUF(path, what, instead, error, lm_head)
    tokenizer = model.tokenizer(add_bos)  # checked before any weight is read
    return model.build(dtype), tokenizer
