"""ERNIE-Image's reference sampling schedule (engine: no ComfyUI here)."""

from __future__ import annotations

from pathlib import Path

import torch

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
    """The shift in a snapshot's ``scheduler/scheduler_config.json`` (the trained 4.0 when absent)."""
    config = snapshot / "scheduler" / "scheduler_config.json"
    return read_json(config).get("shift", DEFAULT_SHIFT) if config.is_file() else DEFAULT_SHIFT
