"""Workflows saved before the memory plan's ``auto`` inputs still load and run (issue 43).

``tests/workflows/saved_2026_12_04/`` keeps the shared workflows as main shipped them on 2026-12-04, before their
loaders were set to ``auto``: ``ui/`` the UI files of ``workflows/``, ``api/`` their API twins of ``tests/workflows/``.
A user's saved copy of a shipped workflow looks like these; they are never edited.

- each saved workflow that differs from the shipped one (the shipped ones are tested in ``test_shared_workflows``)
  loads in the real frontend with its explicit values kept and each input it lacks at the node's default, and its
  API twin runs to an image in the real core;
- a workflow with fewer widget values than its nodes (as an older version of the nodes saved it) opens with the
  missing inputs at ``auto``, and runs to an image both as the frontend submits it and in API form without the
  missing optional inputs.
"""

from __future__ import annotations

import json

import pytest
import test_shared_workflows as shared
from test_shared_workflows import FIND_PROBLEMS, NEEDS_COMFYUI_019, assert_runs_to_an_image, open_workflow

from conftest import REPO

# The shared workflows' fixtures (module-scoped: this module starts its own UI server and browser).
release_models, ui_server, browser = shared.release_models, shared.ui_server, shared.browser
SAVED = REPO / "tests" / "workflows" / "saved_2026_12_04"


def _differs_from_shipped(stem: str) -> bool:
    return any((SAVED / kind / f"{stem}.json").read_text() != (REPO / where / f"{stem}.json").read_text()
               for kind, where in (("ui", "workflows"), ("api", "tests/workflows")))


CHANGED = [p.stem for p in sorted((SAVED / "ui").glob("*.json")) if _differs_from_shipped(p.stem)]
LOADERS = ("ErnieImageLoader", "ErnieImageDiTLoader", "ErnieImageTextEncoderLoader", "ErnieImagePELoader")
# Every widget's name and value of every loader node, as the frontend holds them once the workflow is open.
LOADER_WIDGETS = """(loaders) => window.app.graph._nodes.filter((n) => loaders.includes(n.type)).map((n) => ({
  id: n.id, type: n.type, widgets: (n.widgets || []).map((w) => [w.name, w.value]) }))"""


def _ui(stem: str) -> dict:
    return json.loads((SAVED / "ui" / f"{stem}.json").read_text())


def _api(stem: str) -> dict:
    return json.loads((SAVED / "api" / f"{stem}.json").read_text())


def _open(ui_server, browser, workflow: dict) -> tuple[list[str], list[dict], dict]:
    """Opens ``workflow`` in the frontend: its problems (FIND_PROBLEMS), its loaders' widgets, and the prompt the
    frontend would queue (API format)."""
    page = open_workflow(ui_server, browser, workflow)
    page.wait_for_timeout(1000)
    problems = page.evaluate(FIND_PROBLEMS)
    loaders = page.evaluate(LOADER_WIDGETS, list(LOADERS))
    prompt = page.evaluate("async () => (await window.app.graphToPrompt()).output")
    page.close()
    return problems, loaders, prompt


def _defaults(info: dict) -> dict:
    specs = info["input"].get("required", {}) | info["input"].get("optional", {})
    return {name: spec[1].get("default") for name, spec in specs.items() if len(spec) > 1}


def test_every_saved_workflow_is_kept():
    """The fixtures hold every shipped workflow, UI file and API twin alike."""
    shipped = {p.name for p in (REPO / "workflows").glob("*.json")}
    assert {p.name for p in (SAVED / "ui").glob("*.json")} == shipped
    assert {p.name for p in (SAVED / "api").glob("*.json")} == shipped
    assert CHANGED  # the shipped workflows moved on to auto; the saved ones did not


@pytest.mark.parametrize("stem", CHANGED)
def test_saved_workflow_loads_with_its_values(ui_server, browser, stem):
    """Saved values are kept (an explicit value is honoured), inputs the file lacks show the node's default."""
    saved = _ui(stem)
    problems, loaders, _ = _open(ui_server, browser, saved)
    assert problems == []
    object_info = ui_server.object_info()
    saved_values = {n["id"]: n["widgets_values"] for n in saved["nodes"] if n["type"] in LOADERS}
    assert {loader["id"] for loader in loaders} == set(saved_values)
    for loader in loaders:
        values, kept = [value for _, value in loader["widgets"]], saved_values[loader["id"]]
        defaults = _defaults(object_info[loader["type"]])
        assert values[:len(kept)] == kept, loader
        assert values[len(kept):] == [defaults[name] for name, _ in loader["widgets"][len(kept):]], loader


@pytest.mark.parametrize("stem", CHANGED)
def test_saved_api_twin_runs_to_an_image(ui_server, tiny_models, stem, tmp_path):
    if stem in NEEDS_COMFYUI_019:
        pytest.skip(NEEDS_COMFYUI_019[stem])
    assert_runs_to_an_image(ui_server, tiny_models, _api(stem), tmp_path)


def _fewer_widgets() -> dict:
    """The saved GGUF workflow as older nodes saved it: the DiT loader with model_name and weight_dtype only (before
    quantization), the text encoder's loader with model_name only (before device and weight_dtype)."""
    ui = _ui("ernie_image_turbo_gguf")
    for node in ui["nodes"]:
        if node["type"] == "ErnieImageDiTLoader":
            node["widgets_values"] = node["widgets_values"][:2]
        if node["type"] == "ErnieImageTextEncoderLoader":
            node["widgets_values"] = node["widgets_values"][:1]
    return ui


def test_workflow_with_fewer_widget_values_opens_at_auto_and_runs(ui_server, browser, tiny_models, tmp_path):
    problems, loaders, prompt = _open(ui_server, browser, _fewer_widgets())
    assert problems == []
    widgets = {loader["type"]: dict(loader["widgets"]) for loader in loaders}
    assert widgets["ErnieImageDiTLoader"]["quantization"] == "auto"
    assert widgets["ErnieImageTextEncoderLoader"]["device"] == "auto"
    assert widgets["ErnieImageTextEncoderLoader"]["weight_dtype"] == "auto"
    assert_runs_to_an_image(ui_server, tiny_models, prompt, tmp_path)  # as the frontend queues it


def test_api_workflow_without_optional_inputs_runs(ui_server, tiny_models, tmp_path):
    """The API form of an older save: the text encoder's loader names its model only (device and weight_dtype are
    optional inputs, then ``auto``)."""
    graph = _api("ernie_image_turbo_gguf")
    (encoder,) = [n for n in graph.values() if n["class_type"] == "ErnieImageTextEncoderLoader"]
    encoder["inputs"] = {"model_name": encoder["inputs"]["model_name"]}
    assert_runs_to_an_image(ui_server, tiny_models, graph, tmp_path)
