"""The shared workflows: each UI file in workflows/ and its API twin in tests/workflows/ describe the same graph,
and every node type they use is registered in the running server."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TWINS = sorted((REPO / "workflows").glob("*.json"))
SEED_INPUTS = {"seed", "noise_seed"}  # the frontend stores "control_after_generate" right after these


def _widget_values(ui_node: dict, info: dict) -> dict:
    """Map a UI node's ``widgets_values`` onto input names: every input not fed by a link, in the server's order."""
    linked = {i["name"] for i in ui_node.get("inputs", []) if i.get("link") is not None}
    order = info["input_order"].get("required", []) + info["input_order"].get("optional", [])
    values, out = iter(ui_node["widgets_values"]), {}
    for name in (n for n in order if n not in linked):
        out[name] = next(values)
        if name in SEED_INPUTS:
            next(values)
    return out


@pytest.mark.parametrize("ui_path", TWINS, ids=[p.name for p in TWINS])
def test_ui_workflow_and_api_twin_agree(comfy_server, ui_path):
    ui = json.loads(ui_path.read_text())
    api = json.loads((REPO / "tests" / "workflows" / ui_path.name).read_text())
    object_info = comfy_server.object_info()
    ui_nodes = [n for n in ui["nodes"] if n["type"] not in ("Note", "MarkdownNote")]
    assert Counter(n["type"] for n in ui_nodes) == Counter(n["class_type"] for n in api.values())
    for node in ui_nodes:
        assert node["type"] in object_info, f"{node['type']} is not registered"

    api_widgets = Counter(
        json.dumps({"type": n["class_type"], **{k: v for k, v in n["inputs"].items() if not isinstance(v, list)}},
                   sort_keys=True)
        for n in api.values()
    )
    ui_widgets = Counter(
        json.dumps({"type": n["type"], **_widget_values(n, object_info[n["type"]])}, sort_keys=True)
        for n in ui_nodes
    )
    assert ui_widgets == api_widgets
