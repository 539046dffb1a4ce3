"""A custom node folder for tests only, installed beside the pack in a headless ComfyUI on the CPU: core's memory
queries answer for a CUDA card of ``ERNIE_TEST_FAKE_CARD_GIB`` GiB, and the pack's costs are given (no GPU to probe).
Both are faults the CPU cannot produce; with them the real server's executor makes the pack's memory plans, as
``tests/test_plan_in_core.py``'s ``card`` fixture does in the tests' own process. It adds no nodes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import comfy.cli_args
import comfy.model_management as mm
from server import PromptServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the tests' faults
from helpers.card_faults import CPU_SECONDS, GIB, PAGEABLE, PINNED, SECONDS, answer_as_card  # noqa: E402

answer_as_card(setattr, mm, comfy.cli_args.args, float(os.environ["ERNIE_TEST_FAKE_CARD_GIB"]))


def _pack_module(suffix: str):
    """The pack's module ``<pack>.<suffix>`` as ComfyUI imported it (under its folder's name)."""
    return next(module for name, module in list(sys.modules.items()) if name.endswith(f".{suffix}")
                and "ernie" in name)


def _given_costs(json_data: dict) -> dict:
    """Before each prompt (every custom node is imported by then): the pack's planner reads the tests' costs."""
    planning, costs = _pack_module("nodes.planning"), _pack_module("nodes.plan.costs")
    planning.costs_here = lambda device: costs.Costs("fake-card", PINNED, PAGEABLE, dict(SECONDS), dict(CPU_SECONDS))
    planning.host_room = lambda: 48 * GIB
    return json_data


PromptServer.instance.add_on_prompt_handler(_given_costs)
NODE_CLASS_MAPPINGS: dict = {}
