"""Decode attention for the PE's static-cache fast path: grouped-query attention that never repeats K/V.

Why: with a static cache transformers always hands attention a mask, and its ``sdpa`` path under ``torch.compile``
then repeats K/V from the KV heads to the query heads (``repeat_kv``: 8 → 32 heads for the PE) before calling SDPA.
That writes and reads four times the whole static cache per layer per token (~70 MB per layer at 2048 slots, ~1.9 GB
per token next to 6.9 GB of weights), and the mask keeps SDPA on its general kernels. A decode step has one query
token, so attention is two small matrix products per KV head: the query heads that share a KV head become the rows of
one product, and K/V are read once, in place.

``register()`` adds it to transformers' ``AttentionInterface`` under ``NAME`` (with ``sdpa``'s mask, so it receives
the same mask as ``sdpa``); ``using(model, NAME)`` switches a model to it for a block and back. Prompts (``q_len > 1``)
go to transformers' own ``sdpa_attention_forward`` unchanged. Plain torch and transformers, no ComfyUI.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

NAME = "ernie_pe_grouped_decode"  # no "sdpa"/"flash"/"flex" inside: transformers picks checks by substring


def grouped_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Exact attention of one query token per row: ``query [B, H, 1, D]``, ``key``/``value [B, Hkv, S, D]``, ``mask``
    broadcastable to ``[B, H, 1, S]`` (bool: True attends; float: added) → ``[B, 1, H, D]``.

    Query head ``h`` reads KV head ``h // (H / Hkv)``, as with ``repeat_kv``. The scores come out of the matmul in
    the input dtype (accumulated in fp32 inside it, then rounded, as in transformers' eager attention: an fp32 copy
    of K would triple the traffic this saves); scale, mask and softmax are fp32.
    """
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    grouped = query.view(batch, kv_heads, group, dim)  # the G query heads of a KV head are the rows of its product
    scores = torch.matmul(grouped, key.transpose(-1, -2)).float() * scaling  # [B, Hkv, G, S]
    if mask is not None:
        mask = mask[..., : key.shape[-2]]  # some transformers versions hand a mask longer than the cache
        if mask.shape[1] != 1:  # a per-head mask [B, H, 1, S] → the grouped layout [B, Hkv, G, S]
            mask = mask.reshape(mask.shape[0], kv_heads, group, mask.shape[-1])
        if mask.dtype == torch.bool:
            # The dtype's minimum, not -inf: a row with nothing to attend gives a finite (uniform) softmax, no NaN.
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    output = torch.matmul(probs, value)  # [B, Hkv, G, D]
    return output.reshape(batch, 1, heads, dim)  # heads in query order; transformers wants [B, q_len, H, D]


def decode_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: grouped attention for decode steps, ``sdpa`` for the rest."""
    if query.shape[2] != 1 or dropout > 0.0 or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return grouped_query_attention(query, key, value, attention_mask, scale), None


def register() -> None:
    """Make ``NAME`` a valid ``attn_implementation`` (idempotent). Its masks are built as for ``sdpa``: a name
    without a mask function would get no mask at all (no padding, no causality)."""
    AttentionInterface.register(NAME, decode_attention_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextmanager
def using(model: torch.nn.Module, implementation: str | None) -> Iterator[None]:
    """Run a block with ``model`` on another ``attn_implementation`` (None: leave it), then switch back, so
    whatever else uses the model (plain ``generate``) sees its own attention."""
    previous = model.config._attn_implementation
    if implementation is None or implementation == previous:
        yield
        return
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
