"""The tokenizer a GGUF language model carries in its metadata, as a transformers fast tokenizer (engine: no ComfyUI).

llama.cpp's converter (``convert_hf_to_gguf.py``, ``TextModel._set_vocab_gpt2``) stores a byte-level BPE tokenizer as
fields: ``tokenizer.ggml.model`` ``gpt2``; ``.pre``, the name of the split made before BPE (Mistral's tekken
tokenizers: ``tekken``); ``.tokens`` (every token, ids in order, in GPT-2's byte-to-character form), ``.token_type``
(3, CONTROL, for a special token), ``.merges`` ("a b" each), and the special tokens' ids. Each field is read under
a byte bound (``MAX_LIST_BYTES``) and checked before anything is built: as many tokens as the model has embeddings,
no token twice, every merge of two tokens, BOS and EOS special tokens of the vocabulary.

The split before BPE is llama.cpp's for the ``pre`` name, written as the tokenizer.json it came from has it
(llama.cpp 0c1e57098, ``src/llama-vocab.cpp``, ``LLAMA_VOCAB_PRE_TYPE_TEKKEN``'s "original regex from
tokenizer.json", and ``ignore_merges`` set for it; ``gpt-2``: GPT-2's split, which ``tokenizers``' ByteLevel makes).
Other names are refused in words: this reads Ministral 3's tokenizer, not every model's.
"""

from __future__ import annotations

import numpy as np

from ..errors import ErnieImageError, quoted

FIELDS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
          "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
          "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token")
# Ministral 3's 131,072 tokens take some 2 MB as GGUF strings, its merges about as much: far under this bound.
MAX_LIST_BYTES = 32 << 20
CONTROL = 3  # llama.cpp's token type of a special token (gguf.TokenType.CONTROL)
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?"
                r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
# pre name → (its split, None: GPT-2's, which ByteLevel makes; whether whole words in the vocabulary skip the merges)
SPLITS = {"tekken": (TEKKEN_SPLIT, True), "gpt-2": (None, False)}


def is_tokenizer_field(key: str) -> bool:
    return key in FIELDS


def gguf_tokenizer(read_field, vocab_size: int, source: str, instead: str,
                   error: type[ErnieImageError] = ErnieImageError, add_bos: bool | None = None):
    """A ``PreTrainedTokenizerFast`` from the fields ``read_field(key, max_bytes)`` reads (``GGUFFile.field``), once
    they hold a byte-level BPE tokenizer of ``vocab_size`` tokens (the model's embeddings); otherwise ``error``
    naming ``source`` and saying to use ``instead``. ``add_bos``: whether it puts BOS before a text (None: as the
    file's ``add_bos_token`` says, yes where it says nothing)."""
    def refuse(why: str) -> ErnieImageError:
        return error(f"{source} carries {why}: it is not the tokenizer of a Ministral 3 model. {instead}")

    kind, pre = read_field("tokenizer.ggml.model", 1 << 10), read_field("tokenizer.ggml.pre", 1 << 10)
    if kind is None:
        raise refuse("no tokenizer (no tokenizer.ggml.model field; llama.cpp's converter writes one)")
    if kind != "gpt2":
        raise refuse(f"a tokenizer of kind {quoted(kind)} (tokenizer.ggml.model; Ministral 3's is byte-level BPE, "
                     "'gpt2')")
    if pre not in SPLITS:
        raise refuse(f"a tokenizer whose split before BPE is {quoted(pre)} (tokenizer.ggml.pre; "
                     f"{' or '.join(map(repr, SPLITS))} are read)")
    tokens, types, merges = (read_field(f"tokenizer.ggml.{key}", MAX_LIST_BYTES)
                             for key in ("tokens", "token_type", "merges"))
    if not _strings(tokens) or len(tokens) != vocab_size:
        raise refuse(f"{_count(tokens)} tokens (tokenizer.ggml.tokens) for a model of {vocab_size} token embeddings")
    if not isinstance(types, np.ndarray) or types.dtype.kind not in "iu" or types.shape != (vocab_size,):
        raise refuse(f"{_count(types)} token types (tokenizer.ggml.token_type) for {vocab_size} tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) < len(tokens):
        twice = next(t for i, t in enumerate(tokens) if vocab[t] != i)
        raise refuse(f"the token {quoted(twice)} twice")
    pairs = [tuple(merge.split(" ")) for merge in merges] if _strings(merges) else None
    bad = next((p for p in pairs if len(p) != 2 or p[0] not in vocab or p[1] not in vocab), None) if pairs else 0
    if pairs is None or bad is not None:
        raise refuse(f"the merge {quoted(' '.join(bad))}, which is not two of its tokens" if bad else
                     f"{_count(merges)} merges (tokenizer.ggml.merges), where BPE has a list of \"a b\" strings")
    ids = {}
    for name in ("bos", "eos", "unknown", "padding"):
        value = read_field(f"tokenizer.ggml.{name}_token_id", 16)
        if value is None and name in ("bos", "eos"):
            raise refuse(f"no {name}_token_id")
        if value is not None and not (isinstance(value, int) and 0 <= value < vocab_size):
            raise refuse(f"a {name}_token_id of {quoted(value)} for {vocab_size} tokens")
        if value is not None and name in ("bos", "eos") and types[value] != CONTROL:
            raise refuse(f"the {name}_token_id {value} ({quoted(tokens[value])}), which is not a special token")
        ids[name] = value
    if add_bos is None:
        add_bos = read_field("tokenizer.ggml.add_bos_token", 16) is not False
    return _build(tokens, types, pairs, SPLITS[pre], ids, add_bos, source, instead, error)


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _count(value) -> str:
    return str(len(value)) if isinstance(value, list | np.ndarray) else "no list of"


def _build(tokens: list[str], types: np.ndarray, merges: list[tuple[str, str]], split: tuple[str | None, bool],
           ids: dict, add_bos: bool, source: str, instead: str, error: type[ErnieImageError]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    pattern, ignore_merges = split
    unknown = tokens[ids["unknown"]] if ids["unknown"] is not None else None
    try:
        tokenizer = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=unknown,
                                         ignore_merges=ignore_merges))
    except Exception as e:  # tokenizers raises its own Exception subclass for a vocabulary it cannot build
        raise error(f"{source} carries a tokenizer that cannot be built ({quoted(e)}). {instead}") from e
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pattern is None)
    tokenizer.pre_tokenizer = byte_level if pattern is None else pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), byte_level])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i in np.flatnonzero(types == CONTROL)])
    bos, eos = tokens[ids["bos"]], tokens[ids["eos"]]
    if add_bos:
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                                 special_tokens=[(bos, ids["bos"])])
    pad = tokens[ids["padding"]] if ids["padding"] is not None else None
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, unk_token=unknown,
                                   pad_token=pad)
