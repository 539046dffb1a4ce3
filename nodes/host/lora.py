"""Core's LoRA reading: its key conversions and weight adapters (LoRA, DoRA, LoHa, LoKr, diffs), whether a
patch core read fits the weight it names (core itself, given one that does not, logs an error when the model loads and
leaves the weight as it was; 0.3.75 has no ``comfy.lora.calculate_shape`` to ask), and how large a change it can make
(core adds a change past the weight's range as it is: a black or noise image)."""

from __future__ import annotations

import math

import comfy.lora
import comfy.lora_convert
import comfy.weight_adapter
import torch


def convert_lora(lora: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``lora`` with the key layouts core converts (e.g. BFL's) in core's names."""
    return comfy.lora_convert.convert_lora(lora)


def lora_patches(lora: dict[str, torch.Tensor], key_map: dict[str, str]) -> dict:
    """The patches core's adapters read from ``lora`` for the model keys ``key_map`` names (layer → model key)."""
    return comfy.lora.load_lora(lora, key_map, log_missing=False)


# Core's weight adapters (``comfy.weight_adapter``), told apart by their class names and read through their
# ``weights`` tuples as core's formulas use them. The orthogonal ones rotate blocks of rows: no product to make.
_BLOCK_ADAPTERS = ("OFTAdapter", "BOFTAdapter")
_DORA_INDEX = {"LoRAAdapter": 4, "LoHaAdapter": 7, "LoKrAdapter": 8}  # where each keeps its DoRA scale


def _meta(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor's shape alone: core's formulas run on the meta device give the shape of the weight a patch makes,
    with no arithmetic done."""
    return None if tensor is None else torch.empty(tensor.shape, device="meta")


def _product(a: torch.Tensor | None, b: torch.Tensor | None, tucker: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b``, or with a Tucker core as LyCORIS writes it (core's ``einsum``)."""
    if tucker is not None:
        return torch.einsum("i j k l, j r, i p -> p r k l", tucker, b, a)
    return torch.mm(a, b)


def _made(patch) -> torch.Tensor | None:
    """What ``patch`` adds to (or sets as) its weight, on the meta device, by core's own formula for each kind; None
    for the kinds this does not model (GLoRA: core's own handling stands)."""
    if isinstance(patch, tuple):  # ("diff", (tensor,)) or ("set", (tensor,))
        return _meta(patch[1][0])
    v = [_meta(t) if isinstance(t, torch.Tensor) else t for t in patch.weights]
    kind = type(patch).__name__
    if kind == "LoRAAdapter":
        up, down, _, mid, _, reshape = v
        if reshape is not None:
            raise ValueError(f"it pads the weight to {list(reshape)}")
        if mid is not None:  # LoCon's middle weight, as core folds it into the down weight
            down = (torch.mm(down.transpose(0, 1).flatten(1), mid.transpose(0, 1).flatten(1))
                    .reshape(down.shape[1], down.shape[0], *mid.shape[2:]).transpose(0, 1))
        return torch.mm(up.flatten(1), down.flatten(1))
    if kind == "LoHaAdapter":
        w1a, w1b, _, w2a, w2b, t1, t2 = v[:7]
        return _product(w1a, w1b, t1) * _product(w2a, w2b, t2)
    if kind == "LoKrAdapter":
        w1, w2, _, w1a, w1b, w2a, w2b, t2 = v[:8]
        w1 = w1 if w1 is not None else _product(w1a, w1b)
        w2 = w2 if w2 is not None else _product(w2a, w2b, t2)
        return torch.kron(w1.unsqueeze(2).unsqueeze(2) if w2.dim() == 4 else w1, w2)
    return None


def _dora_scale(patch) -> torch.Tensor | None:
    weights = getattr(patch, "weights", ())
    index = _DORA_INDEX.get(type(patch).__name__)
    return _meta(weights[index]) if index is not None and len(weights) > index else None


def misfit(patch, shape: tuple[int, ...]) -> str | None:
    """Why core could not apply ``patch`` exactly to a weight of ``shape`` (None: it fits). A patch fits when it
    makes a matrix of the weight's rows by the weight's other sides (so a conv's ``[out, in, k, k]`` takes
    ``[out, in·k·k]``), where core would merely reshape whatever has as many numbers, or fail and log."""
    try:
        if type(patch).__name__ in _BLOCK_ADAPTERS:
            blocks = patch.weights[0].shape  # OFT [n, b, b], BOFT [m, n, b, b]: n blocks of b rows
            made, needs = blocks[-3] * blocks[-1], shape[0]
            return None if made == needs else f"its {blocks[-3]} blocks of {blocks[-1]} rows make {made} rows"
        made = _made(patch)
        if made is None:
            return None
        if isinstance(patch, tuple) and tuple(made.shape) != tuple(shape):
            return f"the LoRA makes {list(made.shape)}, the weight is {list(shape)}"
        if made.shape[0] != shape[0] or made[0].numel() != math.prod(shape[1:]):
            return (f"the LoRA makes {[made.shape[0], made[0].numel()]}, the weight is "
                    f"{[shape[0], math.prod(shape[1:])]}")
        dora = _dora_scale(patch)
        if dora is not None:  # DoRA rescales the patched weight by its magnitudes, axis by axis (core's formula)
            norm = (shape[0], *[1] * (len(shape) - 1)) if dora.shape[0] == shape[0] else (1, *shape[1:2],
                                                                                         *[1] * (len(shape) - 2))
            weight = torch.empty(shape, device="meta")
            weight *= dora / torch.empty(norm, device="meta")
    except (RuntimeError, ValueError) as e:
        return f"{e}".split("\n")[0]
    return None


def _largest(tensor: torch.Tensor) -> float:
    return float(tensor.detach().double().abs().max()) if tensor.numel() else 0.0


def _product_bound(a: torch.Tensor, b: torch.Tensor, tucker: torch.Tensor | None = None) -> float:
    """The largest magnitude an entry of ``_product(a, b, tucker)`` can have, without making the product: each row of
    ``|a|`` against the largest entry of each row of ``|b|`` (a sum over the Tucker core's sides for LyCORIS')."""
    a, b = a.detach().double().abs().flatten(1), b.detach().double().abs().flatten(1)
    if tucker is not None:  # "i j k l, j r, i p -> p r k l": |t| times a column sum of |a| and one of |b|
        return _largest(tucker) * float(a.sum(0).max()) * float(b.sum(0).max())
    return float((a @ b.amax(dim=1)).max()) if a.numel() and b.numel() else 0.0


def _scale(alpha: float | None, rank: int | None) -> float:
    """Core's ``alpha / rank`` (1 without an alpha); an alpha over rank 0 is infinite (core divides by zero)."""
    if alpha is None or rank is None:
        return 1.0
    return abs(alpha) / rank if rank else math.inf


def largest_change(patch, strength: float) -> float | None:
    """The largest change ``patch`` can make to one number of its weight at ``strength`` (by core's formula for each
    kind, bounded without making the weight: a few row sums of its factors); None for the kinds this does not model
    (OFT, BOFT, GLoRA)."""
    if isinstance(patch, tuple):  # ("diff", (tensor,)) adds, ("set", (tensor,)) replaces
        return _largest(patch[1][0]) * (abs(strength) if patch[0] == "diff" else 1.0)
    v, kind = patch.weights, type(patch).__name__
    if kind == "LoRAAdapter":
        up, down, alpha, mid = v[:4]
        rank = down.shape[0]
        if mid is not None:  # LoCon's middle weight, folded into the down weight as core does (a small product)
            down = (torch.mm(down.transpose(0, 1).flatten(1).double(), mid.transpose(0, 1).flatten(1).double())
                    .reshape(down.shape[1], down.shape[0], *mid.shape[2:]).transpose(0, 1))
        change = _scale(alpha, rank) * _product_bound(up, down)
    elif kind == "LoHaAdapter":
        w1a, w1b, alpha, w2a, w2b, t1, t2 = v[:7]
        change = _scale(alpha, w1b.shape[0]) * _product_bound(w1a, w1b, t1) * _product_bound(w2a, w2b, t2)
    elif kind == "LoKrAdapter":
        w1, w2, alpha, w1a, w1b, w2a, w2b, t2 = v[:8]
        rank = w2b.shape[0] if w2 is None else w1b.shape[0] if w1 is None else None
        first = _largest(w1) if w1 is not None else _product_bound(w1a, w1b)
        second = _largest(w2) if w2 is not None else _product_bound(w2a, w2b, t2)
        change = _scale(alpha, rank) * first * second
    else:
        return None
    return abs(strength) * change


def plain_lora_factors(entries: list, shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor, float]] | None:
    """Core's patch entries for one linear weight of ``shape`` (``ModelPatcher.patches[key]``) as ``(up, down,
    scale)`` triples, where core's ``calculate_weight`` adds ``scale · (up @ down)`` for each in turn (in float32, cast
    to the weight's dtype): when every entry is core's plain LoRA (``LoRAAdapter``: no LoCon middle, DoRA scale or
    padding) added at the weight's own scale (``strength_model`` 1, no offset or function), with factors of the
    weight's shape ([out, rank] and [rank, in], rank > 0). None for anything else (LoHa, LoKr, DoRA, diffs, stacked
    models' lists …), which stays with ``calculate_weight``. The scale is core's ``strength · (alpha / rank)``, in its
    order of operations."""
    if len(shape) != 2:
        return None
    triples = []
    for entry in entries:
        if len(entry) != 5:
            return None
        strength, adapter, strength_model, offset, function = entry  # as 0.3.75's add_patches appends them
        if (type(adapter) is not comfy.weight_adapter.LoRAAdapter or strength_model != 1.0 or offset is not None
                or function is not None or len(adapter.weights) != 6):
            return None
        up, down, alpha, mid, dora_scale, reshape = adapter.weights
        if (mid is not None or dora_scale is not None or reshape is not None or up.dim() != 2 or down.dim() != 2
                or down.shape[0] == 0 or up.shape[1] != down.shape[0] or (up.shape[0], down.shape[1]) != tuple(shape)):
            return None
        triples.append((up, down, strength * (alpha / down.shape[0] if alpha is not None else 1.0)))
    return triples
