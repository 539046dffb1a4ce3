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
from typing import Any

import torch

from .decode import StaticDecoder, kv_cache_bytes

MAX_ROWS = 64  # the decode step's compiled shapes cover batches of up to 64 (decode._COVERED_ROWS)
CPU_ROWS = 16
MEMORY_SHARE = 0.9  # of the free memory a batch may plan for: the rest absorbs what the estimate leaves out


def row_bytes(config, prompt_length: int, max_new_tokens: int, dtype: torch.dtype) -> int:
    """Memory one prompt of a batch needs while it is generated (an estimate from the model's shapes)."""
    element = torch.empty((), dtype=dtype).element_size()
    cache_length = StaticDecoder.shape(1, prompt_length, max_new_tokens)[1]
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    # The prompt pass, per token: the residual and normed states, q/k/v/attention output, the fused gate-up product
    # and the activated half.
    per_token = 2 * config.hidden_size + (2 * heads + 2 * kv_heads) * head_dim + 3 * config.intermediate_size
    scores = heads * prompt_length * prompt_length * 4  # float attention scores where attention is not fused
    sampling = 8 * config.vocab_size * 4  # float logits, probabilities, their sorted copies and sums
    return kv_cache_bytes(config, 1, cache_length, dtype) + prompt_length * per_token * element + scores + sampling


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


class PromptProgress:
    """The runtime a batch's generation sees: the host's in every way, except that its progress in tokens moves the
    host's bar of prompts (the prompts done before this batch, plus this batch's share)."""

    def __init__(self, host: Any, bar: Callable[[float], None], done: int, rows: int):
        self._host, self._bar, self._done, self._rows = host, bar, done, rows

    def progress(self, total: int) -> Callable[[int], None]:
        return lambda tokens: self._bar(self._done + self._rows * min(tokens / max(total, 1), 1.0))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)
