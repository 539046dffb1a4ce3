"""Every input of every node of the pack checked against the node's own schema, when the node runs (ComfyUI adapter).

ComfyUI 0.3.75 checks a V3 node's inputs only in part, and only while it validates a prompt: Combo values not at all
(its list check looks for V1's list-typed inputs), numbers against min/max only when they are constant widget values.
A value that arrives through a link (a Primitive node, any node's INT output) reaches ``execute`` unchecked, and a
shared workflow chooses all of them (``device = meta``, ``steps = 5000``). So the pack checks each value where it
arrives, at ``execute``, against what the node itself declares in ``define_schema()``: Combo options (a list computed
at schema time, such as the devices or the model files, is computed again and checked against), Int and Float
min/max, and the Python type of Int, Float, Boolean and String values. One rule for every node: ``guard_nodes`` wraps
each node's ``execute`` when the extension lists its nodes, so a node added later is checked without code of its own.

Inputs that several features declare alike live here too, so that no feature imports another for them: the weight
storage of the two Ministral models (the text encoder and the PE), ``lm_weight_dtype_input``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from comfy_api.v0_0_2 import io

from .errors import ErnieImageError

_SHOWN_OPTIONS = 12  # a model list can be long: the error names the first ones and the count
_SHOWN_CHARS = 80  # a value from a workflow is quoted this far at most


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS - 1] + "…"


def _options_text(options: list) -> str:
    shown = ", ".join(_shown(option) for option in options[:_SHOWN_OPTIONS])
    if len(options) > _SHOWN_OPTIONS:
        shown += f", … ({len(options)} in all)"
    return shown or "none: the list is empty (nothing of that kind was found)"


class AliasedCombo(io.Combo.Input):
    """A Combo that also allows values it does not list: ``canonical`` maps such a value (an option's spelling from
    before a rename) to the option it means, so that workflows saved before the rename keep loading. ComfyUI itself
    leaves the check of a Combo that the node's ``validate_inputs`` takes to that function (``execution.py``)."""

    def __init__(self, id: str, options: list[str], canonical: Callable[[str], str], **kwargs: Any):
        super().__init__(id, options=options, **kwargs)
        self.canonical = canonical


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _problem(spec: io.Input, value: Any) -> str | None:
    """What is wrong with one value of input ``spec``, in words; None when it is fine."""
    if isinstance(spec, io.Combo.Input):
        options = list(spec.options or [])
        if isinstance(spec, AliasedCombo) and isinstance(value, str):
            value = spec.canonical(value)
        if not any(value == option and type(value) is type(option) for option in options):  # True is not 1
            return f"is not one of its options ({_options_text(options)})"
        return None
    if isinstance(spec, io.Int.Input | io.Float.Input):
        if isinstance(spec, io.Int.Input) and not _is_int(value):
            return f"is not a whole number (a {type(value).__name__})"
        if isinstance(spec, io.Float.Input) and not (_is_int(value) or isinstance(value, float)):
            return f"is not a number (a {type(value).__name__})"
        if isinstance(value, float) and not math.isfinite(value):  # JSON's NaN passes ComfyUI's own min/max test
            return "is not a finite number"
        low, high = spec.min, spec.max
        if (low is not None and value < low) or (high is not None and value > high):
            return f"is outside its range ({'-∞' if low is None else low} to {'∞' if high is None else high})"
        return None
    if isinstance(spec, io.Boolean.Input) and not isinstance(value, bool):
        return f"is not true or false (a {type(value).__name__})"
    if isinstance(spec, io.String.Input) and not isinstance(value, str):
        return f"is not text (a {type(value).__name__})"
    return None  # sockets (MODEL, ERNIE_PE, ...): ComfyUI matches their types when it validates the links


def check_inputs(node: type[io.ComfyNode], values: Mapping[str, Any]) -> None:
    """Raise ``ErnieImageError`` naming the node, the input, the value and what is allowed, for the first value of
    ``values`` (input name → value, as ``execute`` gets them) that the node's schema does not allow. Inputs not given
    (optional ones) and None (an optional socket left empty) are not checked; for a node with ``is_input_list`` each
    value is a list and every item is checked."""
    schema = node.define_schema()  # now: computed option lists are as ComfyUI would list them at this moment
    for spec in schema.inputs:
        if spec.id not in values or values[spec.id] is None:
            continue
        items = values[spec.id] if schema.is_input_list and isinstance(values[spec.id], list) else [values[spec.id]]
        for value in items:
            problem = _problem(spec, value)
            if problem is not None:
                raise ErnieImageError(
                    f"{schema.display_name or schema.node_id} ({schema.node_id}): input '{spec.id}' = {_shown(value)} "
                    f"{problem}. Set it to an allowed value (a value from a shared workflow or linked from another "
                    "node is checked here too)."
                )


def _named_arguments(function: Callable, node: type, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The arguments of a call of ``execute`` by input name, positional ones and ``**fields`` included."""
    signature = inspect.signature(function)
    named: dict[str, Any] = {}
    for name, value in list(signature.bind_partial(node, *args, **kwargs).arguments.items())[1:]:  # [0] is cls
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            named[name] = value
    return named


def guard(node: type[io.ComfyNode]) -> type[io.ComfyNode]:
    """``node`` with its ``execute`` checking every input first (``check_inputs``); a node guarded already, or one
    whose ``execute`` is inherited from a guarded class, is left as it is. ComfyUI clones the class per run; the clone
    keeps the guarded ``execute``."""
    own = node.__dict__.get("execute")
    function = getattr(own, "__func__", None)
    if function is None or getattr(function, "_inputs_checked", False):
        return node

    if inspect.iscoroutinefunction(function):  # ComfyUI awaits an async execute: the wrapper must be one too
        @functools.wraps(function)
        async def execute(cls, *args, **kwargs):
            check_inputs(cls, _named_arguments(function, cls, args, kwargs))
            return await function(cls, *args, **kwargs)
    else:
        @functools.wraps(function)
        def execute(cls, *args, **kwargs):
            check_inputs(cls, _named_arguments(function, cls, args, kwargs))
            return function(cls, *args, **kwargs)

    execute._inputs_checked = True
    node.execute = classmethod(execute)
    return node


LM_WEIGHT_DTYPES = ("auto", "default", "fp8_e4m3fn")  # the Ministral models' weight storage (``fp8_linear``)


def lm_weight_dtype_input(name: str, what: str, note: str = "") -> io.Combo.Input:
    """The weight storage of a Ministral model (``what``: "text encoder", "prompt enhancer"), one input for both so
    they read alike; optional, so that workflows saved before it load unchanged. ``note``: a sentence of its own."""
    return io.Combo.Input(name, options=list(LM_WEIGHT_DTYPES), default="auto", optional=True,
                          tooltip="auto: what the memory plan picks for this card and the whole graph (the log "
                          "states the plan). default: as loaded (bf16 on GPUs that run it well; an fp8 file stays "
                          "fp8). "
                          f"fp8_e4m3fn: the {what}'s decoder layers in fp8 (about half its memory), cast to the "
                          f"compute dtype as each layer runs: any GPU and the CPU.{' ' + note if note else ''}")


def wants_fp8(weight_dtype: str) -> bool:
    """Whether ``lm_weight_dtype_input``'s value asks for fp8 (an fp8 file is fp8 either way)."""
    return weight_dtype == "fp8_e4m3fn"


def guard_nodes(nodes: Iterable[type[io.ComfyNode]]) -> list[type[io.ComfyNode]]:
    """Every node of ``nodes`` guarded (``guard``), in order."""
    return [guard(node) for node in nodes]
