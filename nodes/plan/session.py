"""The plan of the graph being run, shared by every loader and stage (engine: no ComfyUI).

The loaders live in peer features that cannot import one another, yet each needs the plan of the whole graph: the
pack's top module registers how a plan is made from a prompt (``register``), and each feature asks for it with the
prompt it was given (``plan_for``). A plan is made again only when the graph's models
or settings change (the maker keys it), so asking at every node costs a dictionary lookup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from .planner import Placement, Plan

AUTO = "auto"  # the loaders' value that follows the plan

_maker: list[Callable[[Mapping], Plan | None]] = []
_latest: list[Plan | None] = [None]


def register(maker: Callable[[Mapping], Plan | None]) -> None:
    _maker[:] = [maker]


def plan_for(prompt: Mapping | None) -> Plan | None:
    """The plan of the graph ``prompt`` (ComfyUI's API-format prompt), made or kept by the registered maker; None
    where there is none (no prompt, no maker, a device or flag that fixes placement)."""
    if prompt is None or not _maker:
        return _latest[0]
    _latest[0] = _maker[0](prompt)
    return _latest[0]


def plan_for_node(node: type) -> Plan | None:
    """``plan_for`` the prompt a V3 node was given as its hidden input (none where it is called outside a run)."""
    return plan_for(getattr(getattr(node, "hidden", None), "prompt", None))


_short: list[int] = [0]  # bytes the card gave less than planned, as out-of-memory errors measured it
_retried: list[int | None] = [None]  # the plan whose prompt has retried once


def out_of_memory(measured_peak: int) -> bool:
    """A planned stage ran out of memory at ``measured_peak`` bytes: later plans count the card smaller by what the
    plan missed (at least 256 MiB), and the stage may retry once (True) unless this plan has retried already."""
    plan = _latest[0]
    if plan is None or _retried[0] == id(plan):
        return False
    _short[0] += max(measured_peak - plan.peak, 0) + 2**28
    _retried[0] = id(plan)
    logging.warning("ERNIE-Image: out of memory at %.1f GiB, where the plan predicted a peak of %.1f GiB: planning "
                    "again with %.1f GiB less usable, and retrying once", measured_peak / 2**30, plan.peak / 2**30,
                    _short[0] / 2**30)
    return True


def short() -> int:
    """Bytes to take off the usable memory: what out-of-memory errors showed the plans missed."""
    return _short[0]


def form_setting(role: str, value: str, fallback: str) -> str:
    """A loader's form input as the plan resolves it: ``value`` itself unless it is ``auto``; then the setting of
    the plan's form for ``role``, or ``fallback`` (the input's old default) where there is no plan."""
    if value != AUTO:
        return value
    placement = _placement(role)
    return placement.form.setting if placement is not None else fallback


def place(role: str) -> str | None:
    """Where the latest plan runs ``role`` (None: no plan, or the graph has no such model)."""
    placement = _placement(role)
    return placement.place if placement is not None else None


def _placement(role: str) -> Placement | None:
    return _latest[0].of(role) if _latest[0] is not None else None


# The form each loader made of a file, while ComfyUI may reuse its output: a DiT's form changes only when its loader
# runs again, so the plans made meanwhile keep it (the text encoder and the PE follow the plan's forms themselves).
_held: dict[tuple[str, str], str] = {}


def loaded(role: str, source: str, setting: str) -> None:
    """``role``'s loader made ``source`` in the form of ``setting``: later plans keep that form."""
    _held[(role, source)] = setting


def loading(role: str, source: str) -> None:
    """``role``'s loader runs again for ``source``: the plan it asks for may pick any form."""
    _held.pop((role, source), None)


def held_form(role: str, source: str) -> str | None:
    """The form ``role``'s loader made of ``source`` (None: not loaded in this process, or loading again)."""
    return _held.get((role, source))


def held_forms() -> tuple[tuple[tuple[str, str], str], ...]:
    return tuple(sorted(_held.items()))


_started: list[float | None] = [None]


def prompt_started() -> None:
    """A prompt's first stage of the pack begins (the text encode, or sampling where the encode was cached)."""
    if _started[0] is None:
        _started[0] = time.perf_counter()


def prompt_finished() -> None:
    """The prompt's decode is done: the log states the time beside the plan's prediction."""
    started, _started[0] = _started[0], None
    if started is None or _latest[0] is None:
        return
    logging.info("ERNIE-Image: prompt took %.1f s (predicted warm %.1f s)", time.perf_counter() - started,
                 _latest[0].warm)


def forget() -> None:
    """No plan, no correction, no held form and no prompt timing until the next graph asks (a new process's
    state)."""
    _latest[0], _started[0], _retried[0] = None, None, None
    _short[0] = 0
    _held.clear()
