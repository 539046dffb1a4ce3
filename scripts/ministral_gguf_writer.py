"""GGUF files of a Ministral 3 text encoder or PE as llama.cpp writes them (``convert_hf_to_gguf.py``, then
``llama-quantize``): the tests' tiny files, the GPU check's and the benchmark's true-size ones (``checks/gpu/
e2e_models.py``, ``bench/bench_gguf_text.py``). The product reads these files and never writes them.

What a community file has, as the converter at llama.cpp 0c1e57098 writes it (the fixtures of tests/fixtures/gguf
were made by it):

- its tensor names, from the ``gguf`` package's own map of transformers' names (``gguf.get_tensor_name_map``), in the
  converter's order (the safetensors keys sorted: per layer ``attn_norm``, ``ffn_down``, …, ``attn_v``), and no
  ``output.weight`` when the embeddings are tied (Ministral 3 3B's are);
- the query and key rows permuted for llama.cpp's RoPE (``converter_permute``; the pack's ``ministral_gguf.unpermute``
  undoes it). Random blocks are not permuted: their rows are drawn alike, so a permutation of them is another draw;
- its metadata (``general.architecture`` ``mistral3``, ``mistral3.*`` from the model's geometry and Ministral 3's
  rope settings, ``general.file_type``) and its byte-level BPE tokenizer in ``tokenizer.ggml.*`` (``vocabulary``);
- the types of ``llama-quantize``'s mixes (``q4_k_m_kind``, ``q8_0_kind``).

Weights given as values are quantized by the ``gguf`` package where it can (Q8_0, Q5_0, …) and are random valid blocks
in the K-quants it cannot write (``gguf_writer.encode``). Weights given on the meta device (``random_state``: a
true-size file) are random valid blocks in every type: values do not change the time or bytes measured, and the
package's Q8_0 quantizer alone would take about 20 s for the 3.4B values (0.018 s for 3.1M on a 2-core CPU, scaled),
on top of making the values; of random blocks the whole Q8_0 file (3.65 GB) took 13.4 s there, the Q4_K_M (2.14 GB)
9.8 s, most of it writing. Written tensor by tensor (``gguf_writer.write_gguf``: host memory holds one tensor's).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import torch

from scripts.gguf_writer import write_gguf

ARCH = "mistral3"
# Ministral 3's settings (transformers' ``Ministral3Config`` defaults) as the converter writes them.
SETTINGS = {"context_length": 262144, "rope.freq_base": 1e6, "rope.scaling.factor": 16.0,
            "rope.scaling.original_context_length": 16384, "rope.scaling.yarn_beta_fast": 32.0,
            "rope.scaling.yarn_beta_slow": 1.0, "rope.scaling.yarn_log_multiplier": 1.0,
            "attention.temperature_scale": 0.1, "attention.layer_norm_rms_epsilon": 1e-5}
HEAD_DIM = 128
# transformers' names of a layer's tensors in the converter's order (safetensors' keys sorted).
LAYER_ORDER = ("input_layernorm", "mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "post_attention_layernorm",
               "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj")
FILE_TYPES = {"Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}
# llama-quantize's types for rows that do not fill 256-value blocks (llama.cpp src/llama-quant.cpp,
# ``tensor_type_fallback``, read at 007dbbf3): a tiny model's 32-wide rows.
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def converter_permute(weights: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` (0c1e57098, ``conversion/llama.py``) of a query (``n_head`` heads) or key
    (the key-value heads) projection's rows."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits`` (src/llama-quant.cpp at 007dbbf3): the layers a Q4_K_M keeps its value and down
    projections of in Q6_K (the first and last eighth, and every third between)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_kind(layers: int, tied: bool = True) -> Callable[[str, torch.Tensor], str]:
    """llama-quantize's Q4_K_M (src/llama-quant.cpp at 007dbbf3, ``llama_tensor_get_type_impl``): Q4_K, but
    ``attn_v`` and ``ffn_down`` Q6_K where ``use_more_bits``, the head Q6_K (the token embeddings when ``tied``: no
    ``output.weight``), 1-D F32; rows not of whole 256-value blocks in ``FALLBACK``'s types (the tied embeddings
    then Q8_0, as there)."""
    head = "token_embd.weight" if tied else "output.weight"

    def kind(name: str, value: torch.Tensor) -> str:
        if value.ndim == 1:
            return "F32"
        parts = name.split(".")
        more = parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and use_more_bits(int(parts[1]), layers)
        chosen = "Q6_K" if more or name == head else "Q4_K"
        return chosen if value.shape[-1] % 256 == 0 else FALLBACK[chosen]
    return kind


def q8_0_kind(name: str, value: torch.Tensor) -> str:
    """The converter's ``--outtype q8_0``: every 2-D weight Q8_0, 1-D F32."""
    return "F32" if value.ndim == 1 else "Q8_0"


def kinds(file_type: str, layers: int, tied: bool) -> Callable[[str, torch.Tensor], str]:
    return q4_k_m_kind(layers, tied) if file_type == "Q4_K_M" else q8_0_kind


def random_state(config: Mapping, lm_head: bool = False) -> dict[str, torch.Tensor]:
    """transformers' tensors of a Ministral 3 of ``config``'s geometry (``TRUE_MINISTRAL``'s keys): the weights on
    the meta device (written as random blocks), the norms ones (``lm_head``: an untied head too)."""
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    shapes = {"self_attn.q_proj": (heads * HEAD_DIM, hidden), "self_attn.k_proj": (kv * HEAD_DIM, hidden),
              "self_attn.v_proj": (kv * HEAD_DIM, hidden), "self_attn.o_proj": (hidden, heads * HEAD_DIM),
              "mlp.gate_proj": (config["intermediate_size"], hidden), "mlp.up_proj": (config["intermediate_size"],
                                                                                    hidden),
              "mlp.down_proj": (hidden, config["intermediate_size"])}
    state = {"model.embed_tokens.weight": torch.empty(config["vocab_size"], hidden, device="meta")}
    for i in range(config["num_hidden_layers"]):
        for part in LAYER_ORDER:
            name = f"model.layers.{i}.{part}.weight"
            state[name] = torch.ones(hidden) if "layernorm" in part else torch.empty(shapes[part], device="meta")
    state["model.norm.weight"] = torch.ones(hidden)
    if lm_head:
        state["lm_head.weight"] = torch.empty(config["vocab_size"], hidden, device="meta")
    return state


def llama_cpp_tensors(state: Mapping[str, torch.Tensor], heads: int, kv_heads: int) -> dict[str, torch.Tensor]:
    """``state`` (transformers' names) under llama.cpp's names in the converter's order, query and key rows permuted
    where they have values."""
    layers = 1 + max(int(name.split(".")[2]) for name in state if name.startswith("model.layers."))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MISTRAL3, layers)
    order = ["model.embed_tokens.weight",
             *(f"model.layers.{i}.{part}.weight" for i in range(layers) for part in LAYER_ORDER),
             "model.norm.weight", "lm_head.weight"]
    tensors = {}
    for name in order:
        if name not in state:
            continue
        value = state[name]
        if not value.is_meta and name.endswith(("q_proj.weight", "k_proj.weight")):
            value = converter_permute(value, heads if "q_proj" in name else kv_heads)
        tensors[names.get_name(name, try_suffixes=(".weight",))] = value
    return tensors


def vocabulary(tokenizer, size: int) -> tuple[list[str], list[int], list[str]]:
    """The tokens, token types and merges of byte-level BPE ``tokenizer`` (a transformers fast tokenizer: its
    special tokens, 256 byte tokens and merged tokens, as ``tiny_models.make_tokenizer`` makes), grown to ``size``
    tokens: each special token followed by one byte token, then those followed by one more, each with its merge
    ("<s> a" makes "<s>a"). Valid merges of two tokens, which no text ever reaches (a special token is split off the
    text before BPE, and no merge makes one from characters): every text has the same ids as with ``tokenizer``."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = tokenizer.get_vocab()
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    if [vocab[t] for t in tokens] != list(range(len(tokens))) or len(tokens) > size:
        raise ValueError(f"a tokenizer of ids 0..n-1, at most {size}, is grown; this one has {len(tokens)}")
    special = sorted(tokenizer.added_tokens_decoder)
    types = [int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL) for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m)
              for m in json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]]
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    firsts = [tokens[i] + byte for i in special for byte in alphabet]
    grown = ((left, right) for level in ([tokens[i] for i in special], firsts) for left in level
             for right in alphabet)
    known = set(tokens)
    for left, right in grown:
        if len(tokens) == size:
            break
        if left + right not in known:
            tokens.append(left + right)
            known.add(left + right)
            types.append(int(gguf.TokenType.NORMAL))
            merges.append(f"{left} {right}")
    if len(tokens) < size:
        raise ValueError(f"{len(tokens)} tokens grown, not {size}: too few special tokens to grow from")
    return tokens, types, merges


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer, size: int) -> None:
    """``tokenizer`` grown to ``size`` tokens (``vocabulary``) as the converter's ``_set_vocab_gpt2`` writes it, the
    split before BPE GPT-2's (the tiny tokenizer's; a real Ministral 3 file says ``tekken``)."""
    tokens, types, merges = vocabulary(tokenizer, size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_unk_token_id(tokenizer.unk_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(True)


def write_ministral_gguf(path: Path, state: Mapping[str, torch.Tensor], config: Mapping, file_type: str, tokenizer,
                         name: str, seed: int = 0) -> Path:
    """A Ministral 3 of ``config``'s geometry (``TRUE_MINISTRAL``'s keys) with ``state``'s weights (transformers'
    names; on the meta device: random blocks, ``random_state``) as llama.cpp's ``file_type`` file (``Q4_K_M`` or
    ``Q8_0``) at ``path``, named ``name`` (``general.name``; the pack refuses Mistral's own releases' names), with
    ``tokenizer`` grown to the vocabulary's size. Written to a temporary name first: a file at ``path`` is whole."""
    layers, heads, kv_heads = (config[k] for k in ("num_hidden_layers", "num_attention_heads",
                                                   "num_key_value_heads"))

    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_type("model")
        writer.add_name(name)
        numbers = {"block_count": layers, "embedding_length": config["hidden_size"],
                   "feed_forward_length": config["intermediate_size"], "attention.head_count": heads,
                   "attention.head_count_kv": kv_heads, "attention.key_length": HEAD_DIM,
                   "attention.value_length": HEAD_DIM, "vocab_size": config["vocab_size"],
                   "rope.dimension_count": HEAD_DIM}
        for key, value in numbers.items():
            writer.add_uint32(f"{ARCH}.{key}", value)
        for key, value in SETTINGS.items():
            (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(f"{ARCH}.{key}", value)
        writer.add_string(f"{ARCH}.rope.scaling.type", "yarn")
        writer.add_file_type(FILE_TYPES[file_type])
        add_tokenizer(writer, tokenizer, config["vocab_size"])

    partial = path.with_name(path.name + ".partial")
    kind = kinds(file_type, layers, tied="lm_head.weight" not in state)
    write_gguf(partial, llama_cpp_tensors(state, heads, kv_heads), kind, arch=ARCH, seed=seed, extra=metadata)
    partial.replace(path)
    return path


def write_true_size(path: Path, config: Mapping, file_type: str, name: str, tokenizer=None) -> Path:
    """A true-size file of random blocks (``random_state``) with ``tiny_models.make_tokenizer``'s tokenizer grown to
    the vocabulary (the GPU check's safetensors text encoder's: the same ids for a plain-ASCII prompt)."""
    from scripts.tiny_models import make_tokenizer

    return write_ministral_gguf(path, random_state(config), config, file_type, tokenizer or make_tokenizer(), name)


def write_from_model(path: Path, language_model: torch.nn.Module, file_type: str, tokenizer, name: str) -> Path:
    """``language_model``'s weights (a transformers ``Ministral3Model`` or ``Ministral3ForCausalLM``; a tied head
    left out) as a GGUF file of ``file_type``."""
    config = language_model.config
    prefix = "" if hasattr(language_model, "lm_head") else "model."
    state = {prefix + k: v.detach() for k, v in language_model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    geometry = {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                "num_hidden_layers", "num_attention_heads", "num_key_value_heads")}
    return write_ministral_gguf(path, state, geometry, file_type, tokenizer, name)

