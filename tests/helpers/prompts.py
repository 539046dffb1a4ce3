"""Token prompts for the PE's decoders: a batch left-padded as the enhancer pads it."""

from __future__ import annotations

import torch


def left_padded(seed: int, lengths: tuple[int, ...], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts of ``lengths`` (ids from 3, below ``vocab``) left-padded with 0 to the longest: ids and mask."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    input_ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        input_ids[row, width - length:] = torch.randint(3, vocab, (length,), generator=generator)
        mask[row, width - length:] = 1
    return input_ids, mask
