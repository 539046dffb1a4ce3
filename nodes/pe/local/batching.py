"""Splitting a list of prompts for the local PE into batches that fit the device.

A batch's memory is mostly its KV cache: 100 prompts of 2048 new tokens would want about 35 GB at once. A batch
here holds as many prompts as the host says are free (``Runtime.free_memory``, measured after the weights are
loaded), counting for each prompt its KV cache at the fast path's cache length, the working memory of its prompt
pass and of sampling; on the CPU at most a fixed few (a bigger batch gains little there). A prompt's text does not
depend on the other prompts of its batch (``decode``), so the split changes no text. Plain torch, no ComfyUI.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .decode import StaticDecoder

MAX_ROWS = 64  # the decode step's compiled shapes cover batches of up to 64 (decode._COVERED_ROWS)
CPU_ROWS = 16
MEMORY_SHARE = 0.9  # of the free memory a batch may plan for: the rest absorbs what the estimate leaves out


def kv_cache_bytes(config, rows: int, prompt_length: int, max_new_tokens: int, dtype: torch.dtype) -> int:
    """Memory the KV cache of a batch of ``rows`` prompts of ``prompt_length`` tokens takes: the fast path's cache, its
    batch and length rounded up to their shape bucket (``StaticDecoder.shape``)."""
    rows, length = StaticDecoder.shape(rows, prompt_length, max_new_tokens)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    return rows * length * per_token * dtype.itemsize


def row_bytes(config, prompt_length: int, max_new_tokens: int, dtype: torch.dtype) -> int:
    """Memory one prompt of a batch needs while it is generated (an estimate from the model's shapes)."""
    element = dtype.itemsize
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    # The prompt pass, per token: the residual and normed states, q/k/v/attention output, the fused gate-up product
    # and the activated half.
    per_token = 2 * config.hidden_size + (2 * heads + 2 * kv_heads) * head_dim + 3 * config.intermediate_size
    scores = heads * prompt_length * prompt_length * 4  # float attention scores where attention is not fused
    sampling = 8 * config.vocab_size * 4  # float logits, probabilities, their sorted copies and sums
    kv_cache = kv_cache_bytes(config, 1, prompt_length, max_new_tokens, dtype)
    return kv_cache + prompt_length * per_token * element + scores + sampling


def batch_rows(free: int | None, per_row: int, count: int, device: torch.device) -> int:
    """Prompts per batch: what ``free`` bytes hold (None: unknown), at most ``MAX_ROWS`` (``CPU_ROWS`` on the CPU).
    A power of two unless all prompts fit at once: the fast path pads a batch to one, so more would be paid for."""
    cap = CPU_ROWS if device.type == "cpu" else MAX_ROWS
    fits = cap if free is None else int(free * MEMORY_SHARE) // max(per_row, 1)
    rows = 1 << (max(1, min(fits, cap)).bit_length() - 1)
    return count if count <= min(fits, cap) else rows


def next_batch(done: int, count: int, rows: int) -> int:
    """How many of the prompts left go in the next batch: the batches of a list even in size (none far smaller)."""
    left = count - done
    return math.ceil(left / math.ceil(left / rows))


def batch_progress(bar: Callable[[float], None], done: int, rows: int, max_new_tokens: int) -> Callable[[int], None]:
    """A batch's progress in new tokens as the host's bar of prompts: the prompts done before this batch, plus this
    batch's share of its ``rows`` prompts."""
    return lambda tokens: bar(done + rows * min(tokens / max(max_new_tokens, 1), 1.0))
