"""Placeholder until the probe lands (coordinator's working tree only)."""

from __future__ import annotations

import torch


def costs_here(device: torch.device):
    return None
