"""One DiT forward shared by the ranks of a process group (engine: torch and torch.distributed, no ComfyUI).

Every rank calls ``split_forward`` with the same inputs, around its own copy of the DiT, and gets the whole
output. The same code runs on gloo (CPU processes, the tests) and on NCCL (one process per GPU).

- ``cfg``: the rows of the batch (cond and uncond, when ComfyUI batches them) split across the ranks; each runs the
  whole DiT on its rows, and the outputs are all-gathered. A batch with fewer rows than ranks (CFG 1, or cond and
  uncond run apart) splits its image tokens instead, as ``sequence`` does.
- ``sequence`` (DeepSpeed-Ulysses): the joint sequence (image tokens, then text) is padded to a multiple of the
  world size (the padding masked as keys) and each rank runs the blocks on its slice. Attention needs every key:
  an all-to-all before it trades the slice of all heads for all tokens of ``heads / world`` heads, and one after it
  trades back. The embeddings before the blocks and the final layers after them run whole on every rank (2 % of
  the work); the slices are all-gathered after the last block.

The DiT itself is unchanged: for the forward only, its block list is wrapped (``SequenceShard``) and each block's
attention plan is wrapped (``UlyssesAttention``), inside whatever else wraps the blocks for the run (cache-dit's
cached blocks then work on the slices, and its cache decision, averaged over the group, is the same on every rank).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

CFG, SEQUENCE = "cfg", "sequence"
MODES = (CFG, SEQUENCE)

# forward(x, timestep, context, text_lens) -> prediction: one rank's DiT, as the wrappers around it call it.
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True)
class Split:
    """How a forward is shared: ``mode`` (``cfg`` or ``sequence``), this process's ``rank`` of ``world``."""

    mode: str
    rank: int
    world: int


def split_forward(forward: Forward, dit: torch.nn.Module, split: Split, x: torch.Tensor, timestep: torch.Tensor,
                  context: torch.Tensor, text_lens: list[int]) -> torch.Tensor:
    """The whole prediction for ``x`` on every rank, this rank computing its share with ``forward`` on ``dit``."""
    if split.mode == CFG and x.shape[0] >= split.world:
        return _by_rows(forward, split, x, timestep, context, text_lens)
    with sequence_split(dit, split):
        return forward(x, timestep, context, text_lens)


def _by_rows(forward: Forward, split: Split, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
             text_lens: list[int]) -> torch.Tensor:
    sizes = [len(rows) for rows in torch.arange(x.shape[0]).tensor_split(split.world)]  # the larger shares first
    start = sum(sizes[: split.rank])
    rows = slice(start, start + sizes[split.rank])
    out = forward(x[rows], timestep[rows], context[rows], text_lens[rows])
    # all_gather takes equal shapes: the smaller shares are padded to the largest, and trimmed after.
    padded = torch.cat([out, out.new_zeros(sizes[0] - out.shape[0], *out.shape[1:])]).contiguous()
    parts = [torch.empty_like(padded) for _ in range(split.world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


@contextlib.contextmanager
def sequence_split(dit: torch.nn.Module, split: Split) -> Iterator[None]:
    """While the block runs, ``dit``'s blocks run on this rank's slice of the sequence, attending through the
    all-to-alls. ``dit.layers`` is the list its forward loops over (cache-dit's cached blocks, while they are
    installed); every block's ``self_attention.plan`` is what attends."""
    attentions = {id(m.self_attention): m.self_attention for m in dit.modules() if hasattr(m, "self_attention")}
    plans = {key: attention.plan for key, attention in attentions.items()}
    blocks = dit.layers
    try:
        for key, attention in attentions.items():
            attention.plan = UlyssesAttention(plans[key], split.world)
        dit.layers = torch.nn.ModuleList([SequenceShard(blocks, split)])
        yield
    finally:
        dit.layers = blocks
        for key, attention in attentions.items():
            attention.plan = plans[key]


class SequenceShard(torch.nn.Module):
    """The DiT's block list run on one rank's slice of the joint sequence; called like one block."""

    def __init__(self, blocks: torch.nn.ModuleList, split: Split):
        super().__init__()
        self.blocks, self.split = blocks, split

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], temb,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, length, _ = hidden.shape  # [B, S, H]
        world, rank = self.split.world, self.split.rank
        padding = -length % world
        if padding:
            hidden = F.pad(hidden, (0, 0, 0, padding))
            rope = tuple(F.pad(r, (0, 0, 0, 0, 0, padding)) for r in rope)  # [B, S, 1, head_dim]
            keys = mask if mask is not None else torch.ones(batch, 1, 1, length, dtype=torch.bool,
                                                            device=hidden.device)
            mask = F.pad(keys, (0, padding), value=False)  # [B, 1, 1, S]: the padding is never a key
        part = (length + padding) // world
        window = slice(rank * part, (rank + 1) * part)
        local, local_rope = hidden[:, window], tuple(r[:, window] for r in rope)
        for block in self.blocks:
            local = block(local, local_rope, temb, mask)
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat(parts, dim=1)[:, :length]


class UlyssesAttention:
    """A block's attention plan around the all-to-alls: [B, heads, tokens of this rank, head_dim] in and out, the
    ``inner`` plan attending over all tokens of ``heads / world`` heads."""

    def __init__(self, inner, world: int):  # inner: the block's own plan (dit/attention.py AttentionPlan)
        self.inner, self.world = inner, world

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = (_heads_to_tokens(t, self.world) for t in (q, k, v))
        return _tokens_to_heads(self.inner.attend(q, k, v, mask), self.world)


def _heads_to_tokens(t: torch.Tensor, world: int) -> torch.Tensor:
    """[B, H, s, d] (all heads, this rank's s tokens) → [B, H / world, world · s, d] (this rank's heads, all)."""
    batch, heads, tokens, dim = t.shape
    send = t.reshape(batch, world, heads // world, tokens, dim).transpose(0, 1).contiguous()  # head group j → rank j
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send)  # received[j]: rank j's tokens of this rank's heads
    return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // world, world * tokens, dim)


def _tokens_to_heads(t: torch.Tensor, world: int) -> torch.Tensor:
    """The inverse of ``_heads_to_tokens``: [B, H / world, S, d] → [B, H, S / world, d]."""
    batch, heads, tokens, dim = t.shape
    send = t.reshape(batch, heads, world, tokens // world, dim).permute(2, 0, 1, 3, 4).contiguous()  # tokens j → j
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send)  # received[j]: rank j's heads of this rank's tokens
    return received.transpose(0, 1).reshape(batch, world * heads, tokens // world, dim)
