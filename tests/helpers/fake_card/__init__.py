"""A custom node folder for tests only, installed beside the pack in a headless ComfyUI on the CPU: core's memory
queries answer for a CUDA card of ``ERNIE_TEST_FAKE_CARD_GIB`` GiB, and the pack's costs are given (no GPU to probe).
Both are faults the CPU cannot produce; with them the real server's executor makes the pack's memory plans, as
``tests/test_plan_in_core.py``'s ``card`` fixture does in the tests' own process. It adds no nodes."""

from __future__ import annotations

import os
import sys

import comfy.cli_args
import comfy.model_management as mm
from server import PromptServer

GIB = 2**30
TOTAL = int(float(os.environ["ERNIE_TEST_FAKE_CARD_GIB"]) * GIB)
CONTEXT = GIB // 2  # what a CUDA context takes of a real card, outside torch's allocator

comfy.cli_args.args.cpu = False  # the server runs with --cpu: core's device stays the CPU
mm.is_device_cuda = lambda device: True
mm.get_total_memory = lambda dev=None, torch_total_too=False: (TOTAL, TOTAL) if torch_total_too else TOTAL
mm.get_free_memory = lambda dev=None, torch_free_too=False: ((TOTAL - CONTEXT, 0) if torch_free_too
                                                             else TOTAL - CONTEXT)
mm.MAX_PINNED_MEMORY = 16 * GIB


def _pack_module(suffix: str):
    """The pack's module ``<pack>.<suffix>`` as ComfyUI imported it (under its folder's name)."""
    return next(module for name, module in list(sys.modules.items()) if name.endswith(f".{suffix}")
                and "ernie" in name)


def _given_costs(json_data: dict) -> dict:
    """Before each prompt (every custom node is imported by then): the pack's planner reads these costs."""
    planning, costs = _pack_module("nodes.planning"), _pack_module("nodes.plan.costs")
    planning.costs_here = lambda device: costs.Costs(
        "fake-card", 25e9, 8e9,
        {"dit:bf16": 0.16, "dit:fp8_cast": 0.20, "dit:fp8_matmul": 0.11, "dit:gguf:Q4_K": 0.15, "text:bf16": 0.04,
         "text:fp8": 0.05, "pe:bf16": 0.02, "pe:fp8": 0.02, "vae": 0.09},
        {"text:bf16": 2.0, "text:fp8": 2.5, "pe:bf16": 0.5, "pe:fp8": 0.6, "image:png": 0.2})
    planning.host_room = lambda: 48 * GIB
    return json_data


PromptServer.instance.add_on_prompt_handler(_given_costs)
NODE_CLASS_MAPPINGS: dict = {}
