"""The shared workflows (``workflows/``, UI format) and their API twins (``tests/workflows/``):

- each loads in the real ComfyUI frontend (``comfyui-frontend-package``, headless Chromium) with no missing
  node types and no invalid widget values, and a screenshot is taken;
- each UI file and its twin describe the same graph (same nodes, same widget values);
- each twin runs to an image through the headless server, on tiny models saved under the released names.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import pytest
import requests

from comfy_headless import ComfyServer
from conftest import COMFY_DIR, REPO
from helpers.pe_servers import transformers_serve

WORKFLOWS = sorted((REPO / "workflows").glob("*.json"))
IDS = [p.stem for p in WORKFLOWS]
RELEASE_SNAPSHOTS = ("ERNIE-Image-Turbo", "ERNIE-Image")
RELEASE_DIT_FILES = ("ernie-image-turbo.safetensors", "ernie-image.safetensors")
RELEASE_TEXT_ENCODER, RELEASE_VAE = "ministral-3-3b.safetensors", "flux2-vae.safetensors"
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CHROMIUM = "/usr/bin/chromium"
# Set ERNIE_UPDATE_SCREENSHOTS=1 to refresh the README pictures in docs/ from this test.
DOCS = REPO / "docs"


@pytest.fixture(scope="module")
def release_models(tiny_models, tmp_path_factory) -> Path:
    """The tiny models under the names of the released files, so the shared workflows find what they name."""
    root = tmp_path_factory.mktemp("release_models")
    for folder in ("diffusers", "diffusion_models", "text_encoders", "vae"):
        (root / folder).mkdir()
    for name in RELEASE_SNAPSHOTS:
        (root / "diffusers" / name).symlink_to(tiny_models["snapshot"], target_is_directory=True)
    for name in RELEASE_DIT_FILES:
        (root / "diffusion_models" / name).symlink_to(tiny_models["single_file"])
    (root / "text_encoders" / RELEASE_TEXT_ENCODER).symlink_to(tiny_models["text_encoder_file"])
    (root / "vae" / RELEASE_VAE).symlink_to(tiny_models["vae_file"])
    return root


@pytest.fixture(scope="module")
def ui_server(release_models, tmp_path_factory):
    server = ComfyServer(COMFY_DIR, tmp_path_factory.mktemp("ui_base"), REPO, release_models, ui=True)
    server.start()
    # A first visit opens the template browser; a tested user has seen it.
    requests.post(f"{server.url}/settings/Comfy.TutorialCompleted", json=True, timeout=10)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"],
        )
        yield chromium
        chromium.close()


FIND_PROBLEMS = """() => {
  const problems = [];
  for (const node of window.app.graph._nodes) {
    if (!(node.type in LiteGraph.registered_node_types)) { problems.push(`missing node type ${node.type}`); continue; }
    for (const w of node.widgets || []) {
      const o = w.options || {};
      if (w.type === 'combo' && Array.isArray(o.values) && !o.values.includes(w.value))
        problems.push(`${node.type}.${w.name}: '${w.value}' is not one of ${JSON.stringify(o.values)}`);
      if (w.type === 'number' && ((o.min !== undefined && w.value < o.min) || (o.max !== undefined && w.value > o.max)))
        problems.push(`${node.type}.${w.name}: ${w.value} is outside [${o.min}, ${o.max}]`);
    }
  }
  return problems;
}"""


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_workflow_loads_in_the_frontend(ui_server, browser, path, tmp_path):
    page = browser.new_page(viewport={"width": 1600, "height": 900})
    page.goto(ui_server.url, timeout=120_000)
    page.wait_for_function("window.app && window.app.graph", timeout=120_000)
    page.evaluate("async (workflow) => { await window.app.loadGraphData(workflow); }", json.loads(path.read_text()))
    page.wait_for_timeout(1000)
    problems = page.evaluate(FIND_PROBLEMS)
    shot = tmp_path / f"{path.stem}.png"
    page.screenshot(path=str(shot))
    page.close()
    assert problems == []
    assert shot.stat().st_size > 10_000
    if os.environ.get("ERNIE_UPDATE_SCREENSHOTS"):
        DOCS.mkdir(exist_ok=True)
        shutil.copy(shot, DOCS / shot.name)


def _widget_values(ui_node: dict, info: dict) -> dict:
    """Map a UI node's ``widgets_values`` onto input names, in the server's input order: every widget input has a
    value (a widget fed by a link too, then ignored), and a seed with "control after generate" one more."""
    linked = {i["name"] for i in ui_node.get("inputs", []) if i.get("link") is not None}
    specs = info["input"].get("required", {}) | info["input"].get("optional", {})
    order = info["input_order"].get("required", []) + info["input_order"].get("optional", [])
    values, out = iter(ui_node["widgets_values"]), {}
    for name in order:
        kind, options = specs[name][0], (specs[name][1] if len(specs[name]) > 1 else {})
        if not (isinstance(kind, list) or kind in WIDGET_TYPES):
            continue
        value = next(values)
        if name not in linked:
            out[name] = value
        if options.get("control_after_generate"):
            next(values)
    return out


def _api_twin(path: Path) -> dict:
    return json.loads((REPO / "tests" / "workflows" / path.name).read_text())


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_ui_workflow_and_api_twin_agree(ui_server, path):
    ui, api = json.loads(path.read_text()), _api_twin(path)
    object_info = ui_server.object_info()
    ui_nodes = [n for n in ui["nodes"] if n["type"] not in ("Note", "MarkdownNote")]
    assert Counter(n["type"] for n in ui_nodes) == Counter(n["class_type"] for n in api.values())

    def widgets(class_type: str, values: dict) -> str:
        return json.dumps({"type": class_type, **values}, sort_keys=True)

    api_widgets = Counter(
        widgets(n["class_type"], {k: v for k, v in n["inputs"].items() if not isinstance(v, list)})
        for n in api.values()
    )
    ui_widgets = Counter(widgets(n["type"], _widget_values(n, object_info[n["type"]])) for n in ui_nodes)
    assert ui_widgets == api_widgets


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_api_twin_runs_to_an_image(ui_server, tiny_models, path, tmp_path):
    graph = _api_twin(path)
    for node in graph.values():  # tiny models, small images: the graph is the point, not the size
        if node["class_type"].startswith("Empty") and "width" in node["inputs"]:
            node["inputs"].update(width=128, height=128)
        if node["class_type"] == "ErnieImagePromptEnhance":
            node["inputs"]["max_new_tokens"] = 16
    with ExitStack() as stack:
        for node in graph.values():
            if node["class_type"] == "ErnieImagePERemote":  # a real OpenAI-compatible server on the tiny PE
                node["inputs"]["base_url"] = stack.enter_context(transformers_serve(tiny_models["pe_folder"], tmp_path))
        result = ui_server.run(graph)
    if any(node["inputs"].get("quantization", "none") != "none" for node in graph.values()):
        # Quantization needs a CUDA GPU: here the workflow must stop at the loader with the reason and the fix.
        assert result.status == "error" and "needs an NVIDIA GPU (CUDA)" in result.error["exception_message"]
        return
    assert result.status == "success", result.messages
    assert [p for p in ui_server.output_images(result) if p.is_file()]
