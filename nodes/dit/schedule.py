"""ERNIE-Image's reference sampling schedule (engine: no ComfyUI here)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..errors import ErnieImageError
from ..model_files import read_json

DEFAULT_SHIFT = 4.0  # Baidu's scheduler config; ComfyUI's native ERNIE uses 3.0


def reference_sigmas(steps: int, shift: float = DEFAULT_SHIFT) -> torch.Tensor:
    """The ``steps + 1`` sigmas (ending at 0) that ``ErnieImagePipeline`` samples with.

    Computed by diffusers' own ``FlowMatchEulerDiscreteScheduler`` from ``linspace(1, 0, steps + 1)[:-1]``,
    exactly as the pipeline does, so the schedule cannot drift from the reference.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler

    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 0.0, steps + 1)[:-1], device="cpu")
    return scheduler.sigmas.to(torch.float32).clone()


def snapshot_shift(snapshot: Path) -> float:
    """The shift in a snapshot's ``scheduler/scheduler_config.json`` (the trained 4.0 when absent): a finite number
    above 0, else an error naming the file (a shared snapshot's config would otherwise set every sigma)."""
    config = snapshot / "scheduler" / "scheduler_config.json"
    shift = read_json(config).get("shift", DEFAULT_SHIFT) if config.is_file() else DEFAULT_SHIFT
    if isinstance(shift, bool) or not isinstance(shift, int | float) or not math.isfinite(shift) or shift <= 0:
        raise ErnieImageError(f"{config} gives the shift {str(shift)[:40]!r}, not a number above 0 (ERNIE-Image's is "
                              "4.0). The file is damaged: download the snapshot's scheduler/ again.")
    return float(shift)
