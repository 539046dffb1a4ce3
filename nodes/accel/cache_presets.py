"""Cache-DiT settings: the advanced fields (one to one with cache-dit) and the presets (engine: no ComfyUI here).

Every preset is cache-dit's own hybrid recipe, DBCache + a steps computation mask (SCM) + TaylorSeer: the mask
fixes which steps must compute (cache-dit's ``steps_mask`` policies, which adapt to the step count and to 8-step
distilled models), and on the mask's other steps DBCache reuses the cached residual of the middle blocks only
where the first blocks' residual changed less than the threshold ("dynamic" cache, which cache-dit recommends
over "static": static masks blur). Presets are named for the user's choice (quality … ultra), not after the
mask policies they use, so the two cannot be confused.
"""

from __future__ import annotations

from dataclasses import dataclass

STEPS_MASKS = ("off", "slow", "medium", "fast", "ultra")
MASK_CACHE_POLICIES = ("dynamic", "static")
BASE_STEPS, TURBO_STEPS, RELEASED_BLOCKS = 50, 8, 36  # what the documented numbers are for


@dataclass(frozen=True)
class CacheSettings:
    """cache-dit's DBCache fields (same names, same meaning), TaylorSeer's order and the steps mask.

    The defaults are cache-dit's own defaults: with 8 warm-up steps they cache nothing in an 8-step run.
    """

    Fn_compute_blocks: int = 8  # first blocks computed at every step; their residual decides
    Bn_compute_blocks: int = 0  # last blocks computed at every step, after the cached middle
    residual_diff_threshold: float = 0.08  # relative L1 change of the Fn residual below which a step is cached
    max_warmup_steps: int = 8  # steps that always compute (with a mask: at most its first run of compute steps)
    max_cached_steps: int = -1  # -1: no limit
    max_continuous_cached_steps: int = -1  # -1: no limit
    taylorseer_order: int = 0  # 0: reuse the cached residual as it is; n: extrapolate it (TaylorSeer, order n)
    steps_mask: str = "off"  # cache-dit's steps_mask policy: which steps must compute
    steps_mask_cache: str = "dynamic"  # on the mask's cache steps: "dynamic" (threshold) or "static" (always)

    def __post_init__(self) -> None:
        if self.steps_mask not in STEPS_MASKS:
            raise ValueError(f"steps_mask must be one of {STEPS_MASKS}, got {self.steps_mask!r}")
        if self.steps_mask_cache not in MASK_CACHE_POLICIES:
            raise ValueError(f"steps_mask_cache must be one of {MASK_CACHE_POLICIES}, got {self.steps_mask_cache!r}")
        if self.Fn_compute_blocks < 1 or self.Bn_compute_blocks < 0:
            raise ValueError("Fn_compute_blocks must be at least 1 and Bn_compute_blocks at least 0")

    def brief(self) -> str:
        """The settings in cache-dit's notation, e.g. ``F8B0 R0.08 W8 TaylorSeer1 mask medium/dynamic``."""
        parts = [f"F{self.Fn_compute_blocks}B{self.Bn_compute_blocks}", f"R{self.residual_diff_threshold:g}",
                 f"W{self.max_warmup_steps}"]
        if self.max_cached_steps >= 0:
            parts.append(f"M{self.max_cached_steps}")
        if self.max_continuous_cached_steps >= 0:
            parts.append(f"MC{self.max_continuous_cached_steps}")
        if self.taylorseer_order:
            parts.append(f"TaylorSeer{self.taylorseer_order}")
        if self.steps_mask != "off":
            parts.append(f"mask {self.steps_mask}/{self.steps_mask_cache}")
        return " ".join(parts)


@dataclass(frozen=True)
class Preset:
    """A named setting with what it does to Base (50 steps) and Turbo (8 steps) runs.

    ``base_cached`` / ``turbo_cached``: the cache steps of the preset's mask, i.e. the most steps it can cache
    (all of them with ``static``; with ``dynamic``, those whose residual stayed under the threshold).
    """

    settings: CacheSettings
    base_cached: int
    turbo_cached: int
    trade: str

    def ceiling(self, steps: int, cached: int, blocks: int = RELEASED_BLOCKS) -> float:
        """Speed-up when every cache step is taken: block calls uncached / cached (embeddings ignored)."""
        s = self.settings
        return steps * blocks / ((steps - cached) * blocks + cached * (s.Fn_compute_blocks + s.Bn_compute_blocks))

    def describe(self) -> str:
        return (f"{self.settings.brief()}. Caches at most {self.base_cached}/{BASE_STEPS} Base steps "
                f"(≤{self.ceiling(BASE_STEPS, self.base_cached):.2f}x) and {self.turbo_cached}/{TURBO_STEPS} "
                f"Turbo steps (≤{self.ceiling(TURBO_STEPS, self.turbo_cached):.2f}x). {self.trade}")


def _hybrid(mask: str, fn: int, threshold: float) -> CacheSettings:
    return CacheSettings(Fn_compute_blocks=fn, Bn_compute_blocks=0, residual_diff_threshold=threshold,
                         taylorseer_order=1, steps_mask=mask, steps_mask_cache="dynamic")


# Thresholds follow cache-dit's published recipes: ~0.08-0.12 with 8 Fn blocks (its DrawBench table), larger with
# fewer Fn blocks, whose residual moves more (0.2-0.35 with F1 in its SCM examples). Not tuned on ERNIE-Image's
# real weights, which no machine here has.
PRESETS: dict[str, Preset] = {
    "quality": Preset(_hybrid("slow", 8, 0.08), 12, 1,
                      "Closest to uncached: caches only late steps whose residual barely moved."),
    "balanced": Preset(_hybrid("medium", 8, 0.12), 21, 2,
                       "cache-dit's default block split with a medium mask: little visible change."),
    "fast": Preset(_hybrid("fast", 4, 0.2), 30, 3,
                   "Fewer compute blocks on cached steps: fine detail may soften."),
    "ultra": Preset(_hybrid("ultra", 2, 0.3), 36, 4,
                    "Most steps cached with 2 compute blocks: the fastest, with the largest drift."),
}
PRESET_NAMES = (*PRESETS, "custom")


def resolve(preset: str, **fields) -> CacheSettings:
    """The settings of ``preset``; with ``custom``, the advanced ``fields`` (CacheSettings' names) as given."""
    if preset == "custom":
        return CacheSettings(**fields)
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {PRESET_NAMES}, got {preset!r}")
    return PRESETS[preset].settings

