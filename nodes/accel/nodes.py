"""Cache-DiT and compile nodes: MODEL in, MODEL out (schemas and plumbing only)."""

from __future__ import annotations

from comfy_api.v0_0_2 import io

from .cache_presets import MASK_CACHE_POLICIES, PRESET_NAMES, PRESETS, STEPS_MASKS, CacheSettings, resolve
from .compile import MODES
from .patching import OFF, CacheJob, apply_cache, apply_compile

_DEFAULTS = CacheSettings()  # cache-dit's defaults, the starting point of `custom`
_CUSTOM_ONLY = " (preset 'custom' only)"


def _preset_tooltip() -> str:
    lines = [f"{name}: {preset.describe()}" for name, preset in PRESETS.items()]
    lines.append("custom: the fields below, as cache-dit defines them (its defaults cache nothing in 8 steps).")
    return "\n".join(lines)


def _advanced_inputs() -> list:
    d = _DEFAULTS
    return [
        io.Int.Input("Fn_compute_blocks", default=d.Fn_compute_blocks, min=1, max=128,
                     tooltip="First blocks computed at every step; the change of their residual decides caching."
                     + _CUSTOM_ONLY),
        io.Int.Input("Bn_compute_blocks", default=d.Bn_compute_blocks, min=0, max=128,
                     tooltip="Last blocks computed at every step, after the cached middle blocks." + _CUSTOM_ONLY),
        io.Float.Input("residual_diff_threshold", default=d.residual_diff_threshold, min=0.0, max=1.0, step=0.01,
                       tooltip="Cache a step when the Fn residual changed less than this (relative L1). 0: never "
                       "cache (the image equals uncached)." + _CUSTOM_ONLY),
        io.Int.Input("max_warmup_steps", default=d.max_warmup_steps, min=0, max=1000,
                     tooltip="Steps that always compute first (with a steps mask: at most its first compute run)."
                     + _CUSTOM_ONLY),
        io.Int.Input("max_cached_steps", default=d.max_cached_steps, min=-1, max=1000,
                     tooltip="Most steps cached in a run; -1: no limit." + _CUSTOM_ONLY),
        io.Int.Input("max_continuous_cached_steps", default=d.max_continuous_cached_steps, min=-1, max=1000,
                     tooltip="Most cached steps in a row; -1: no limit." + _CUSTOM_ONLY),
        io.Int.Input("taylorseer_order", default=d.taylorseer_order, min=0, max=4,
                     tooltip="TaylorSeer: extrapolate the cached residual with this order; 0: off." + _CUSTOM_ONLY),
        io.Combo.Input("steps_mask", options=list(STEPS_MASKS), default=d.steps_mask,
                       tooltip="cache-dit's steps computation mask policy: which steps must compute, adapted to "
                       "the step count (4, 6 and 8+ steps). off: none." + _CUSTOM_ONLY),
        io.Combo.Input("steps_mask_cache", options=list(MASK_CACHE_POLICIES), default=d.steps_mask_cache,
                       tooltip="On the mask's other steps: dynamic caches when the residual is under the "
                       "threshold (cache-dit's advice); static always caches (fixed speed, blurs)." + _CUSTOM_ONLY),
    ]


class ErnieImageCacheDiT(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageCacheDiT",
            display_name="ERNIE-Image Cache-DiT",
            category="ERNIE-Image/acceleration",
            description="Samples faster with cache-dit's DBCache: on steps where the first blocks' output barely "
            "changes, the middle blocks' cached residual is reused. Set up fresh for every sampling run (never a "
            "stale cache) and removed after it; cond and uncond are cached apart. Base (50 steps) and Turbo "
            "(8 steps) alike. After each run the node and the log show steps computed / cached.",
            inputs=[
                io.Model.Input("model"),
                io.Combo.Input("preset", options=list(PRESET_NAMES), default="balanced", tooltip=_preset_tooltip()),
                *_advanced_inputs(),
            ],
            outputs=[io.Model.Output()],
            hidden=[io.Hidden.unique_id],
        )

    @classmethod
    def execute(cls, model, preset: str = "balanced", **fields) -> io.NodeOutput:
        settings = resolve(preset, **fields)
        return io.NodeOutput(apply_cache(model, CacheJob(settings, preset, cls.hidden.unique_id)))


class ErnieImageCompile(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ErnieImageCompile",
            display_name="ERNIE-Image Compile",
            category="ERNIE-Image/acceleration",
            description="torch.compile of the DiT's repeated blocks (regional: one block compiled, reused by all), "
            "for each sampling run and removed after it. The first run also compiles (once for a single pass, once for "
            "batched CFG); new prompts and sizes do not recompile. Works before or after the Cache-DiT node. The "
            "ERNIE-Image loaders already compile by default on NVIDIA GPUs since Ampere (RTX 30 and later) with "
            "Triton: use this node to pick another mode or to turn that off.",
            inputs=[
                io.Model.Input("model"),
                io.Combo.Input("mode", options=[*MODES, OFF], default="default",
                               tooltip="default: quick to compile. max-autotune-no-cudagraphs: tries more kernels; "
                               "much longer first compile. off: no compilation (eager), also where the loader "
                               "would compile by default."),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, mode: str = "default") -> io.NodeOutput:
        return io.NodeOutput(apply_compile(model, mode))


ACCEL_NODES = [ErnieImageCacheDiT, ErnieImageCompile]
