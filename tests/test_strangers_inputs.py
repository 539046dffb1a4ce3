"""Issue 24, inputs: a workflow from a stranger sets every widget, and links can carry any value past ComfyUI's own
checks (0.3.75 checks no V3 Combo value, and numbers only when they are constant widget values). Every node of the
pack refuses a value its own schema does not allow, at execute, naming the node, the input, the value and what is
allowed; through the running server (the executor a user runs) and for every input of every node."""

from __future__ import annotations

import asyncio
import json
import math
import re
import uuid

import pytest
import requests
from comfy_api.v0_0_2 import io

from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.extension import ErnieImageExtension

SNAPSHOT = "ERNIE-Image-Turbo-tiny"
FOLDER_PE = "text_encoders/ernie-image-prompt-enhancer-tiny"
TAIL = ". Set it to an allowed value (a value from a shared workflow or linked from another node is checked here too)."
NODES = asyncio.run(ErnieImageExtension().get_node_list())  # the classes ComfyUI registers, as it gets them


def _refusal(server, graph: dict) -> str:
    """The message of the pack's error that ends the prompt (the run fails in the node, not in validation). The
    prompt goes as JSON text of Python's json, which writes NaN as ComfyUI's server reads it (requests refuses to)."""
    body = json.dumps({"prompt": graph, "client_id": uuid.uuid4().hex})
    response = requests.post(f"{server.url}/prompt", data=body, headers={"Content-Type": "application/json"},
                             timeout=30)
    assert response.status_code == 200, response.text
    result = server.wait(response.json()["prompt_id"])
    assert result.status == "error", result.messages
    assert result.error["exception_type"].endswith("ErnieImageError"), result.error
    return result.error["exception_message"].strip()


def _preview(source: list) -> dict:
    """Core's PreviewAny: an output node that takes anything, so that the node before it runs."""
    return {"class_type": "PreviewAny", "inputs": {"source": source}}


@pytest.mark.parametrize("device", ["cuda:7", "meta"])
def test_a_pe_device_this_machine_lacks_is_refused_by_name_in_the_server(comfy_server, device):
    """0.3.75 passes a V3 Combo value unchecked: ``cuda:7`` made a handle that failed at first use, ``meta`` a raw
    KeyError."""
    graph = {"pe": {"class_type": "ErnieImagePELoader",
                    "inputs": {"model_name": FOLDER_PE, "device": device, "dtype": "auto"}},
             "show": _preview(["pe", 0])}
    message = _refusal(comfy_server, graph)
    assert re.fullmatch(rf"ERNIE-Image Prompt Enhancer Loader \(ErnieImagePELoader\): input 'device' = '{device}' is "
                        rf"not one of its options \('auto', 'default', 'cpu'(, 'cuda:\d+')*\){re.escape(TAIL)}",
                        message)


@pytest.mark.parametrize(("link", "value", "words"), [
    ("PrimitiveInt", ("steps", 5000), "= 5000 is outside its range (1 to 1000)"),
    ("PrimitiveInt", ("steps", 0), "= 0 is outside its range (1 to 1000)"),
    ("PrimitiveFloat", ("shift", -1.0), "= -1.0 is outside its range (0.01 to 100.0)"),
    ("PrimitiveFloat", ("shift", math.nan), "= nan is not a finite number"),  # JSON's NaN passes min/max tests
    (None, ("shift", math.nan), "= nan is not a finite number"),  # a constant NaN passes ComfyUI's validation too
])
def test_a_number_outside_the_schedulers_range_is_refused_also_when_linked_in_the_server(comfy_server, link, value,
                                                                                       words):
    """A core Primitive node's INT or FLOAT output linked into the scheduler reaches execute without ComfyUI's
    min/max test (``steps`` 5000 ran)."""
    name, number = value
    inputs = {"model": ["loader", 0], "steps": 8, "shift": 4.0}
    graph = {"loader": {"class_type": "ErnieImageLoader",
                        "inputs": {"model_name": SNAPSHOT, "weight_dtype": "default", "quantization": "none"}},
             "sigmas": {"class_type": "ErnieImageScheduler", "inputs": inputs}, "show": _preview(["sigmas", 0])}
    if link is None:
        inputs[name] = number
    else:
        graph["number"] = {"class_type": link, "inputs": {"value": number}}
        inputs[name] = ["number", 0]
    message = _refusal(comfy_server, graph)
    assert message == f"ERNIE-Image Scheduler (ErnieImageScheduler): input '{name}' {words}{TAIL}"


def _widgets() -> list[tuple[type, str]]:
    """(node, input) for every Combo, Int and Float input of every node of the pack."""
    kinds = (io.Combo.Input, io.Int.Input, io.Float.Input)
    return [(node, spec.id) for node in NODES for spec in node.define_schema().inputs if isinstance(spec, kinds)]


def _attacks(spec) -> list[tuple[object, str]]:
    """Values a workflow or a link can give that ``spec`` does not allow, and the start of each refusal's reason."""
    if isinstance(spec, io.Combo.Input):
        return [(value, "not one of its options (") for value in ("../not-an-option", 1, True)]
    whole = isinstance(spec, io.Int.Input)
    outside = f"outside its range ({spec.min} to {spec.max})"
    bounds = [(bound, outside) for bound in (spec.min - 1, spec.max + 1)]
    if whole:
        return bounds + [(2.5, "not a whole number (a float)"), (True, "not a whole number (a bool)")]
    return bounds + [(math.nan, "not a finite number"), ("8", "not a number (a str)")]


def test_every_node_of_the_pack_checks_its_inputs():
    """Every class ComfyUI registers runs the schema check (a node added later too, without code of its own)."""
    assert NODES and all(getattr(node.execute.__func__, "_inputs_checked", False) for node in NODES)


@pytest.mark.parametrize(("node", "name"), _widgets(), ids=lambda x: getattr(x, "__name__", x))
def test_every_widget_of_every_node_refuses_a_value_its_schema_does_not_allow(comfy_paths, node, name):
    """Called as the executor calls execute (by input name): the check comes first, before any file or device is
    touched. Lists come as lists to a node with ``is_input_list``."""
    schema = node.define_schema()
    spec = next(s for s in schema.inputs if s.id == name)
    assert isinstance(spec, io.Combo.Input) or None not in (spec.min, spec.max)  # every number of the pack is bounded
    for bad, reason in _attacks(spec):
        with pytest.raises(ErnieImageError) as error:
            node.execute(**{name: [bad] if schema.is_input_list else bad})
        assert str(error.value).startswith(
            f"{schema.display_name} ({schema.node_id}): input '{name}' = {bad!r} is {reason}"), str(error.value)
        assert str(error.value).endswith(TAIL)
