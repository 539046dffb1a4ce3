"""cache-dit's DBCache on a DiT's block list, for one sampling run (engine: no ComfyUI here).

``CacheRun`` installs cache-dit through an explicit ``BlockAdapter`` on the block list (so it needs neither
cache-dit's model registry nor its ERNIE adapter, which builds before 1.5.1 lack), keeps one cache context per
kind of model call, and takes everything out again when the run ends.

- Blocks: ERNIE-Image blocks are called ``block(x, rotary_pos_emb, temb, attention_mask)`` and return ``x``:
  cache-dit's ``ForwardPattern.Pattern_3``. cache-dit swaps the block list for one cached-blocks module for the
  duration of each forward; the forward's ``for layer in self.layers`` loop then runs once and hands that module
  the whole ``temb`` list, which the blocks share. That is all cache-dit's ERNIE patch functor ensures (it moves
  ``temb = [...]`` before the loop), so no functor is applied: the pack's DiT and ComfyUI's native one both build
  ``temb`` before their loop and give the cached blocks the full list as they are.
- Contexts: cache-dit counts steps by calls and tells CFG passes apart by call parity; ComfyUI batches cond and
  uncond only when memory allows and skips uncond at CFG 1. So each kind of call (``cond_or_uncond``: cond,
  uncond, or both batched) gets its own cache context, and before each call its step counters are set to the
  step the sampler is at (``step_index`` on the run's sigmas): which steps compute never depends on the order or
  the number of calls.
"""

from __future__ import annotations

import copy
import statistics
from collections import defaultdict

import torch

from ..errors import ErnieImageError
from .cache_presets import CacheSettings

CALL_NAMES = {(0,): "cond", (1,): "uncond", (0, 1): "cond+uncond", (1, 0): "cond+uncond"}


def step_index(sample_sigmas: torch.Tensor, sigma: float) -> int:
    """The sampling step that ``sigma`` belongs to: step ``i`` runs from ``sample_sigmas[i]`` (inclusive) down to
    ``sample_sigmas[i + 1]``, so a second-order sampler's extra calls stay within their step."""
    starts = sample_sigmas[:-1].float().cpu()
    tolerance = 1e-5 * max(float(starts.abs().max()), 1.0)
    return max(int((starts >= sigma - tolerance).sum()) - 1, 0)


def steps_computation_mask(settings: CacheSettings, steps: int) -> tuple[list[int] | None, str]:
    """cache-dit's steps mask for this run (1 = compute, 0 = may cache), or None and why there is none."""
    import cache_dit

    if settings.steps_mask == "off":
        return None, ""
    if steps < 8 and steps not in (4, 6):  # cache-dit defines masks for 4, 6 and 8+ steps only
        return None, f"no '{settings.steps_mask}' steps mask for {steps} steps (cache-dit has them for 4, 6, 8+)"
    return cache_dit.steps_mask(total_steps=steps, mask_policy=settings.steps_mask), ""


def check_block_count(settings: CacheSettings, blocks: int) -> None:
    """Fn + Bn compute blocks must leave middle blocks to cache."""
    if settings.Fn_compute_blocks + settings.Bn_compute_blocks >= blocks:
        raise ErnieImageError(
            f"Fn_compute_blocks + Bn_compute_blocks ({settings.Fn_compute_blocks} + {settings.Bn_compute_blocks}) "
            f"must be fewer than the model's {blocks} blocks, or nothing is left to cache. Lower them."
        )


def stored_streams(settings: CacheSettings) -> int:
    """How many tensors shaped like the blocks' stream (``[batch, tokens, width]``) one cache context keeps across
    steps: 2, or 3 + 2n with TaylorSeer of order n. Counted on cache-dit 1.5.3, at any Bn, by
    ``test_cache_engine.py::test_the_memory_estimate_counts_what_cache_dit_keeps``."""
    order = settings.taylorseer_order
    return 3 + 2 * order if order else 2


def _ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` → ``3-5,9``."""
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def _instance_attrs(objects: list) -> list[dict[str, object]]:
    return [dict(vars(o)) for o in objects]


class CacheRun:
    """DBCache on ``getattr(holder, blocks_name)`` for one run of ``steps`` steps: ``install``, then ``activate``
    before each model call, then ``remove`` (always, also after an error or an interrupt)."""

    def __init__(self, holder: torch.nn.Module, blocks_name: str, settings: CacheSettings, steps: int):
        self.holder, self.blocks_name, self.settings, self.steps = holder, blocks_name, settings, steps
        self.mask, self.note = steps_computation_mask(settings, steps)
        self._adapter = self._manager = self._name = None
        self._context_kwargs: dict = {}
        self._contexts: dict[tuple[int, ...], object] = {}
        self._seen: dict[tuple[int, ...], set[int]] = defaultdict(set)
        self._touched = [holder, getattr(holder, blocks_name)]  # what cache-dit sets attributes on
        self._attrs_before = _instance_attrs(self._touched)

    def configs(self) -> tuple:
        """cache-dit's DBCacheConfig and TaylorSeer config (None when off) for this run."""
        import cache_dit

        s = self.settings
        cache_config = cache_dit.DBCacheConfig(
            Fn_compute_blocks=s.Fn_compute_blocks, Bn_compute_blocks=s.Bn_compute_blocks,
            residual_diff_threshold=s.residual_diff_threshold, max_warmup_steps=s.max_warmup_steps,
            max_cached_steps=s.max_cached_steps, max_continuous_cached_steps=s.max_continuous_cached_steps,
            enable_separate_cfg=False,  # CFG passes are told apart by context, never by call parity
            num_inference_steps=self.steps,
            steps_computation_mask=self.mask, steps_computation_policy=s.steps_mask_cache,
        )
        calibrator = (cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=s.taylorseer_order)
                      if s.taylorseer_order > 0 else None)
        return cache_config, calibrator

    def install(self) -> None:
        """Put cache-dit's hooks on the block list (cache-dit patches the holder's ``forward``)."""
        import cache_dit
        from cache_dit.caching.block_adapters import FakeDiffusionPipeline

        blocks = getattr(self.holder, self.blocks_name)
        check_block_count(self.settings, len(blocks))
        cache_config, calibrator = self.configs()
        # A transformer-only "pipeline": cache-dit keeps its context across forwards instead of per pipeline call.
        self._adapter = cache_dit.BlockAdapter(
            pipe=FakeDiffusionPipeline(self.holder), transformer=self.holder, blocks=blocks,
            blocks_name=self.blocks_name, forward_pattern=cache_dit.ForwardPattern.Pattern_3,
            check_forward_pattern=False, has_separate_cfg=False,
        )
        cache_dit.enable_cache(self._adapter, cache_config=cache_config, calibrator_config=calibrator)
        self._manager = self._adapter.pipe._context_manager
        self._name = self._adapter.unique_blocks_name[0][0]
        self._context_kwargs = dict(name=self._name, cache_config=cache_config, calibrator_config=calibrator)

    def activate(self, call: tuple[int, ...], step: int) -> None:
        """Make ``call``'s context (e.g. ``(0, 1)``: cond and uncond batched) the one the cached blocks use next,
        at sampling step ``step``."""
        context = self._contexts.get(call)
        if context is None:
            context = self._contexts[call] = self._manager.new_context(**copy.deepcopy(self._context_kwargs))
        # cache-dit binds the block list to one context name; the manager has no public way to point that name at
        # an existing context, so its registry entry is set directly.
        self._manager._cached_context_manager[self._name] = context
        # The cached blocks add one step when they start (mark_step_begin): set the counters one short of `step`.
        # (TaylorSeer keeps counting calls: its extrapolation distance must never be zero, as it would be for a
        # second-order sampler's two calls at one step.)
        context.executed_steps = context.transformer_executed_steps = step
        self._seen[call].add(step)

    def remove(self) -> None:
        """Take every hook and attribute out again; safe to call after a failed or partial ``install``."""
        import cache_dit

        try:
            if self._adapter is not None and getattr(self._adapter, "_is_normalized", False):
                cache_dit.disable_cache(self._adapter)
        finally:
            for context in self._contexts.values():
                context.clear_buffers()
            # cache-dit's release leaves the holder's `forward` as an instance attribute (a re-bound original):
            # drop whatever was not there before and put back what was, so the module is exactly as it was.
            for obj, before in zip(self._touched, self._attrs_before, strict=True):
                for name in set(vars(obj)) - set(before):
                    delattr(obj, name)
                vars(obj).update(before)

    def summary(self) -> str:
        """Steps computed and cached per kind of call, with the residual diffs that decided."""
        parts = []
        for call, context in sorted(self._contexts.items()):
            seen, cached = self._seen[call], sorted(set(context.cached_steps))
            text = f"{CALL_NAMES.get(call, str(call))}: {len(seen) - len(cached)} computed, {len(cached)} cached"
            if cached:
                text += f" (steps {_ranges(cached)})"
            diffs = [d for d in context.residual_diffs.values() if d > 0]  # cache-dit marks skipped checks <= 0
            if diffs:
                text += f", residual diff mean {statistics.fmean(diffs):.3f} max {max(diffs):.3f}"
            parts.append(text)
        head = f"{self.steps} steps, {self.settings.brief()}" + (f" ({self.note})" if self.note else "")
        return f"{head}: " + ("; ".join(parts) if parts else "no model calls")
