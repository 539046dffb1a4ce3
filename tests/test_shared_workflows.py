"""The shared workflows (``workflows/``, UI format) and their API twins (``tests/workflows/``):

- each loads in the real ComfyUI frontend (``comfyui-frontend-package``, headless Chromium) with no missing
  node types and no invalid widget values, and a screenshot is taken;
- each opens laid out as the frontend draws it: no node covers another, every widget and every note's text lies inside
  its node, and every link runs left to right;
- each UI file and its twin describe the same graph (same nodes, same widget values);
- each twin runs to an image through the headless server, on tiny models saved under the released names;
- every single file a workflow loads comes with its download (``models`` entries: name, url, directory) and the
  frontend offers exactly those downloads when the files are missing; a snapshot (a folder, which the frontend cannot
  download) is named in the workflow's note with where it goes;
- the workflow on ComfyUI's own ERNIE-Image loaders (ComfyUI >= 0.19, newer than the test ComfyUI) is checked
  against what ComfyUI 0.19's source says, and its pack nodes against the running server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import pytest
import requests
from safetensors.torch import save_file

from conftest import COMFY_DIR, REPO
from helpers.lora import LAYERS, deltas, lora_file
from helpers.pe_servers import transformers_serve
from scripts.comfy_headless import ComfyServer
from scripts.tiny_models import write_gguf_dit

WORKFLOWS = sorted((REPO / "workflows").glob("*.json"))
IDS = [p.stem for p in WORKFLOWS]
# Workflows on ComfyUI's own ERNIE-Image support, which the test ComfyUI (0.3.75) lacks: its UNETLoader cannot detect
# the ERNIE-Image DiT nor its CLIPLoader the Ministral 3 3B text encoder. Checked structurally instead.
NEEDS_COMFYUI_019 = {
    "ernie_image_turbo_native": "needs ComfyUI >= 0.19 (native ERNIE-Image loaders); the test ComfyUI is 0.3.75: "
    "checked by test_native_workflow_matches_comfyui_0_19 instead",
}
RELEASE_SNAPSHOTS = ("ERNIE-Image-Turbo", "ERNIE-Image")
RELEASE_DIT_FILES = ("ernie-image-turbo.safetensors", "ernie-image.safetensors")
RELEASE_TEXT_ENCODER, RELEASE_VAE = "ministral-3-3b.safetensors", "flux2-vae.safetensors"
RELEASE_PE = "ernie-image-prompt-enhancer.safetensors"
WORKFLOW_LORA = "ernie-image-turbo-lora.safetensors"
COMMUNITY_GGUF = "ernie-image-turbo-Q4_K_M.gguf"
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
    (root / "text_encoders" / RELEASE_PE).symlink_to(tiny_models["pe_single_file"])
    # A community GGUF of the DiT, as the GGUF workflow names it (random valid blocks of its types).
    write_gguf_dit(root / "diffusion_models" / COMMUNITY_GGUF)
    # A LoRA is the user's own (no release to download): the LoRA workflow names this one.
    (root / "loras").mkdir()
    save_file(lora_file("peft", deltas(LAYERS, seed=1)), root / "loras" / WORKFLOW_LORA)
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


def open_workflow(ui_server, browser, workflow: dict, width: int = 1600, height: int = 900):
    """A new page of the real frontend with ``workflow`` (UI format) loaded into it, as a user opens a file."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.goto(ui_server.url, timeout=120_000)
    page.wait_for_function("window.app && window.app.graph", timeout=120_000)
    page.evaluate("async (workflow) => { await window.app.loadGraphData(workflow); }", workflow)
    return page


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_workflow_loads_in_the_frontend(ui_server, browser, path, tmp_path):
    page = open_workflow(ui_server, browser, json.loads(path.read_text()))
    page.wait_for_timeout(1000)
    problems = page.evaluate(FIND_PROBLEMS)
    missing_models_dialogs = page.locator(".comfy-missing-models").count()  # every file is there under its name
    shot = tmp_path / f"{path.stem}.png"
    page.screenshot(path=str(shot))
    page.close()
    # The native workflow too: ComfyUI 0.3.75 already has every core node it uses and the "flux2" CLIPLoader type.
    assert problems == []
    assert missing_models_dialogs == 0
    assert shot.stat().st_size > 10_000
    if os.environ.get("ERNIE_UPDATE_SCREENSHOTS"):
        DOCS.mkdir(exist_ok=True)
        shutil.copy(shot, DOCS / shot.name)


# Shows the whole graph at scale 1 in the page (drawing a node places its widgets) and draws it.
SHOW_WHOLE_GRAPH = """() => {
  const nodes = window.app.graph._nodes, ds = window.app.canvas.ds;
  ds.scale = 1;
  ds.offset = [80 - Math.min(...nodes.map((n) => n.pos[0])), 160 - Math.min(...nodes.map((n) => n.pos[1]))];
  window.app.canvas.setDirty(true, true);
  window.app.canvas.draw(true, true);
}"""
# What a user sees wrong in a workflow's layout once the frontend has placed and drawn it (LiteGraph's own boxes: a
# node's title bar lies above its pos, NODE_TITLE_HEIGHT high; a widget's y is set where it is drawn).
FIND_LAYOUT_PROBLEMS = """() => {
  const problems = [], T = LiteGraph.NODE_TITLE_HEIGHT, nodes = window.app.graph._nodes;
  const name = (n) => `${n.type} #${n.id} '${n.title}'`;
  const box = (n) => [n.pos[0], n.pos[1] - T, n.pos[0] + n.size[0], n.pos[1] + n.size[1]];
  nodes.forEach((a, i) => nodes.slice(i + 1).forEach((b) => {
    const [p, q] = [box(a), box(b)];
    if (p[0] < q[2] && q[0] < p[2] && p[1] < q[3] && q[1] < p[3]) problems.push(`${name(a)} overlaps ${name(b)}`);
  }));
  for (const n of nodes) {
    for (const w of n.widgets || []) {
      const height = w.computedHeight ?? LiteGraph.NODE_WIDGET_HEIGHT;
      if (!(w.y >= 0 && w.y + height <= n.size[1] + 0.5))
        problems.push(`${name(n)}: widget ${w.name} spans ${w.y}..${w.y + height}, the node's body 0..${n.size[1]}`);
    }
    const text = (n.widgets || []).find((w) => w.element)?.element;
    if (['Note', 'MarkdownNote'].includes(n.type) && text && text.scrollHeight > text.clientHeight + 1)
      problems.push(`${name(n)}: its text needs ${text.scrollHeight} px, its box shows ${text.clientHeight}`);
  }
  for (const link of Object.values(window.app.graph.links || {})) {
    if (!link) continue;
    const [from, to] = [window.app.graph.getNodeById(link.origin_id), window.app.graph.getNodeById(link.target_id)];
    if (from.pos[0] + from.size[0] > to.pos[0]) problems.push(`${name(from)} -> ${name(to)} runs right to left`);
  }
  return problems;
}"""


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_workflow_layout_in_the_frontend(ui_server, browser, path):
    """As the frontend places it: no node covers another, every widget and every note's text lies inside its node,
    and every link runs left to right, as ComfyUI's own templates read."""
    # The whole of the widest workflow at scale 1.
    page = open_workflow(ui_server, browser, json.loads(path.read_text()), width=3840, height=2400)
    page.evaluate(SHOW_WHOLE_GRAPH)
    page.wait_for_timeout(1000)
    problems = page.evaluate(FIND_LAYOUT_PROBLEMS)
    page.close()
    assert problems == []


def _widget_values(ui_node: dict, info: dict) -> dict:
    """Map a UI node's ``widgets_values`` onto input names, in the server's input order: every widget input has a
    value (a widget fed by a link too, then ignored), and a seed with "control after generate" one more. A workflow
    saved before an optional input was added has no value for it (the frontend then shows its default)."""
    linked = {i["name"] for i in ui_node.get("inputs", []) if i.get("link") is not None}
    specs = info["input"].get("required", {}) | info["input"].get("optional", {})
    order = info["input_order"].get("required", []) + info["input_order"].get("optional", [])
    optional = set(info["input_order"].get("optional", []))
    values, out = iter(ui_node["widgets_values"]), {}
    for name in order:
        kind, options = specs[name][0], (specs[name][1] if len(specs[name]) > 1 else {})
        if not (isinstance(kind, list) or kind in WIDGET_TYPES):
            continue
        value = next(values, None) if name in optional else next(values)
        if value is None and name in optional:
            continue  # saved before this optional input existed
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
    if path.stem in NEEDS_COMFYUI_019:
        pytest.skip(NEEDS_COMFYUI_019[path.stem])
    assert_runs_to_an_image(ui_server, tiny_models, _api_twin(path), tmp_path)


def assert_runs_to_an_image(ui_server, tiny_models, graph: dict, tmp_path: Path) -> None:
    """``graph`` (API format) runs to an image on the headless server, at a small size; a DiT quantization other
    than none or auto stops at the loader with the reason, as it must on the CPU."""
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
    if any(node["inputs"].get("quantization", "none") not in ("none", "auto") for node in graph.values()):
        # Quantization needs a CUDA GPU: here the workflow must stop at the loader with the reason and the fix.
        assert result.status == "error" and "needs an NVIDIA GPU (CUDA)" in result.error["exception_message"]
        return
    assert result.status == "success", result.messages
    assert [p for p in ui_server.output_images(result) if p.is_file()]


# --- Model downloads -------------------------------------------------------------------------------------------------

# ComfyUI's repack of ERNIE-Image on Hugging Face, as ComfyUI's official ERNIE-Image templates download it: the
# properties.models of their UNETLoader / CLIPLoader / VAELoader nodes in Comfy-Org/workflow_templates,
# templates/image_ernie_image_turbo.json (commit 15053963: the Turbo DiT, ministral-3-3b, the prompt enhancer, the VAE)
# and templates/image_ernie_image.json (commit 476c15aa: the Base DiT).
REPACK = "https://huggingface.co/Comfy-Org/ERNIE-Image/resolve/main/"
RELEASE_URLS = {
    "ernie-image-turbo.safetensors": REPACK + "diffusion_models/ernie-image-turbo.safetensors",
    "ernie-image.safetensors": REPACK + "diffusion_models/ernie-image.safetensors",
    RELEASE_TEXT_ENCODER: REPACK + "text_encoders/ministral-3-3b.safetensors",
    RELEASE_PE: REPACK + "text_encoders/ernie-image-prompt-enhancer.safetensors",
    RELEASE_VAE: REPACK + "vae/flux2-vae.safetensors",
}
# The loader inputs that name a model, and the ComfyUI folder they read. The pack's combined lists name a file of
# another folder, or a snapshot, with the folder in front: "text_encoders/<file>", "diffusers/<snapshot>".
LOADER_FOLDERS = {
    ("UNETLoader", "unet_name"): "diffusion_models",
    ("CLIPLoader", "clip_name"): "text_encoders",
    ("VAELoader", "vae_name"): "vae",
    ("ErnieImageLoader", "model_name"): "diffusers",
    ("ErnieImageDiTLoader", "model_name"): "diffusion_models",
    ("ErnieImageTextEncoderLoader", "model_name"): "diffusers",
    ("ErnieImagePELoader", "model_name"): "diffusers",
    ("ErnieImageVAELoader", "vae_name"): "vae",
}
# Widgets that name the user's own files, which no release offers for download (the note says where they go).
USER_FILES = {("ErnieImageLoraLoader", "lora_name")}
# The community's GGUF files of the DiT: no release of Baidu's or ComfyUI's to download either (the note says so).
COMMUNITY_SUFFIXES = (".gguf",)
HF_RESOLVE_URL = r"https://huggingface\.co/[\w.-]+/[\w.-]+/resolve/[\w.-]+/(?:[\w.-]+/)*"


def _model_widgets(ui: dict, object_info: dict):
    """(node, widget value, folder, file name) for every loader widget of ``ui``; the file name is None for a
    snapshot (a folder)."""
    for node in ui["nodes"]:
        if node["type"] in ("Note", "MarkdownNote"):
            continue
        for name, value in _widget_values(node, object_info[node["type"]]).items():
            folder = LOADER_FOLDERS.get((node["type"], name))
            if (node["type"], name) in USER_FILES or (isinstance(value, str) and value.endswith(COMMUNITY_SUFFIXES)):
                continue
            if folder is None:
                assert not (isinstance(value, str) and value.endswith(".safetensors")), \
                    f"{node['type']}.{name} names a model file; add the loader to LOADER_FOLDERS"
                continue
            prefix, _, rest = value.partition("/")
            if rest and prefix in ("diffusers", "text_encoders", "diffusion_models", "vae"):
                folder, value_file = prefix, rest
            else:
                value_file = value
            yield node, value, folder, None if folder == "diffusers" else value_file


def _declared_models(ui: dict) -> list[dict]:
    return [m for n in ui["nodes"] for m in n.get("properties", {}).get("models", [])] + ui.get("models", [])


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_every_model_file_has_its_download(ui_server, path):
    """ComfyUI's frontend offers a node's ``properties.models`` entry when its ``name`` equals one of the node's
    widget values and no file of that name is in the entry's ``directory`` (loadGraphData and
    getSelectedModelsMetadata, comfyui-frontend-package 1.32.9), as the official templates use it. A pack widget that
    holds "text_encoders/<file>" can never equal a file name of that folder (the entry would always show as missing,
    and download to text_encoders/text_encoders/), so its entry is a workflow-level ``models`` entry, which the
    frontend checks the same way without matching it to a widget."""
    ui = json.loads(path.read_text())
    expected_nodes: dict[int, set] = {}
    expected_workflow = set()
    for node, value, folder, file in _model_widgets(ui, ui_server.object_info()):
        if file is None:
            continue  # a snapshot: no download (the note says where it goes)
        if value == file:
            expected_nodes.setdefault(node["id"], set()).add((file, folder))
        else:
            expected_workflow.add((file, folder))
    declared_nodes = {n["id"]: {(m["name"], m["directory"]) for m in n["properties"]["models"]}
                      for n in ui["nodes"] if n.get("properties", {}).get("models")}
    assert declared_nodes == expected_nodes
    assert {(m["name"], m["directory"]) for m in ui.get("models", [])} == expected_workflow
    for model in _declared_models(ui):
        assert set(model) == {"name", "url", "directory"}
        assert re.fullmatch(HF_RESOLVE_URL + re.escape(model["name"]), model["url"]), model
        assert model["url"] == RELEASE_URLS.get(model["name"]), f"not the repack's confirmed URL: {model}"


DOWNLOAD_WORKFLOWS = [p for p in WORKFLOWS if _declared_models(json.loads(p.read_text()))]


@pytest.mark.parametrize("path", DOWNLOAD_WORKFLOWS, ids=[p.stem for p in DOWNLOAD_WORKFLOWS])
def test_frontend_offers_the_downloads_of_missing_files(ui_server, browser, path):
    """The real frontend, on a ComfyUI whose model folders look empty, lists every declared file for download."""
    page = browser.new_page(viewport={"width": 1600, "height": 900})
    # The folders exist (so each entry's directory is valid) but list no files.
    page.route(re.compile(r".*/experiment/models/[^/?]+$"), lambda route: route.fulfill(json=[]))
    page.goto(ui_server.url, timeout=120_000)
    page.wait_for_function("window.app && window.app.graph", timeout=120_000)
    page.evaluate("async (workflow) => { await window.app.loadGraphData(workflow); }", json.loads(path.read_text()))
    dialog = page.locator(".comfy-missing-models")
    dialog.wait_for(timeout=30_000)
    offered = {(span.inner_text().strip(), span.get_attribute("title"))
               for span in dialog.locator("span[title]").all()}
    errors = dialog.locator(".p-message").all_inner_texts()
    page.close()
    declared = {(f"{m['directory']} / {m['name']}", m["url"]) for m in _declared_models(json.loads(path.read_text()))}
    assert offered == declared
    assert errors == []


@pytest.mark.parametrize("path", WORKFLOWS, ids=IDS)
def test_snapshot_workflows_say_where_the_snapshot_goes(ui_server, path):
    ui = json.loads(path.read_text())
    notes = "\n".join(n["widgets_values"][0] for n in ui["nodes"] if n["type"] in ("Note", "MarkdownNote"))
    for _, value, folder, _ in _model_widgets(ui, ui_server.object_info()):
        if folder == "diffusers":
            name = value.removeprefix("diffusers/")
            assert f"baidu/{name}" in notes and f"models/diffusers/{name}/" in notes, (name, notes)


# --- The workflow on ComfyUI's own ERNIE-Image support (ComfyUI >= 0.19) ----------------------------------------------

# Read from comfyanonymous/ComfyUI at commit 18dd46b2, which added ERNIE-Image (ComfyUI 0.19; the official ERNIE-Image
# templates' nodes carry "ver": "0.19.0"):
# - comfy/supported_models.py, class ErnieImage: unet_config {"image_model": "ernie"}, sampling_settings
#   {"multiplier": 1000.0, "shift": 3.0}, latent_format = latent_formats.Flux2 (so EmptyFlux2LatentImage);
#   comfy/ldm/ernie/model.py (read at commit 27e7ad36) calls its blocks without an attention mask (no text mask).
# - comfy/sd.py: detect_te_model gives TEModel.MINISTRAL_3_3B for a text encoder of hidden size 3072, and
#   load_text_encoder_state_dicts loads it with comfy.text_encoders.ernie whatever the CLIPLoader type (the type is
#   not consulted for it); the official templates use "flux2".
# - nodes.py: the widgets of the core nodes below, in this order, and the choices of UNETLoader and CLIPLoader.
# The sampling settings are the official Turbo template's (templates/image_ernie_image_turbo.json): KSampler 8 steps,
# CFG 1, euler, simple, denoise 1; negative = ConditioningZeroOut of the positive.
CORE_WIDGETS_019 = {
    "UNETLoader": ["unet_name", "weight_dtype"],
    "CLIPLoader": ["clip_name", "type", "device"],
    "VAELoader": ["vae_name"],
    "CLIPTextEncode": ["text"],
    "ConditioningZeroOut": [],
    "EmptyFlux2LatentImage": ["width", "height", "batch_size"],
    "KSampler": ["seed", "control_after_generate", "steps", "cfg", "sampler_name", "scheduler", "denoise"],
    "VAEDecode": [],
    "SaveImage": ["filename_prefix"],
}
CHOICES_019 = {
    ("UNETLoader", "weight_dtype"): ["default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2"],
    ("CLIPLoader", "type"): ["stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart",
                             "cosmos", "lumina2", "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image",
                             "hunyuan_image", "flux2", "ovis", "longcat_image"],
    ("CLIPLoader", "device"): ["default", "cpu"],
}
EXPECTED_019 = {
    ("UNETLoader", "unet_name"): set(RELEASE_DIT_FILES),
    ("CLIPLoader", "clip_name"): {RELEASE_TEXT_ENCODER},
    ("CLIPLoader", "type"): {"flux2"},
    ("VAELoader", "vae_name"): {RELEASE_VAE},
    ("KSampler", "steps"): {8},
    ("KSampler", "cfg"): {1.0},
    ("KSampler", "sampler_name"): {"euler"},
    ("KSampler", "scheduler"): {"simple"},
    ("KSampler", "denoise"): {1.0},
}


def _invalid_widgets(node: dict, info: dict) -> list[str]:
    """What the server's own input specs reject among a UI node's widget values."""
    specs = info["input"].get("required", {}) | info["input"].get("optional", {})
    problems = []
    for name, value in _widget_values(node, info).items():
        kind, options = specs[name][0], (specs[name][1] if len(specs[name]) > 1 else {})
        choices = kind if isinstance(kind, list) else options.get("options") if kind == "COMBO" else None
        if choices is not None and value not in choices:
            problems.append(f"{node['type']}.{name}: {value!r} is not one of {choices}")
        if kind in ("INT", "FLOAT") and not options.get("min", value) <= value <= options.get("max", value):
            problems.append(f"{node['type']}.{name}: {value} is outside [{options.get('min')}, {options.get('max')}]")
    return problems


@pytest.mark.parametrize("stem", sorted(NEEDS_COMFYUI_019))
def test_native_workflow_matches_comfyui_0_19(ui_server, stem):
    path = REPO / "workflows" / f"{stem}.json"
    ui, api = json.loads(path.read_text()), _api_twin(path)
    object_info = ui_server.object_info()
    nodes = [n for n in ui["nodes"] if n["type"] not in ("Note", "MarkdownNote")]

    core = [n for n in nodes if not n["type"].startswith("ErnieImage")]
    assert {n["type"] for n in core} == set(CORE_WIDGETS_019)
    for node in core:
        names = CORE_WIDGETS_019[node["type"]]
        assert len(node["widgets_values"]) == len(names), node["type"]
        for name, value in zip(names, node["widgets_values"], strict=True):
            if (node["type"], name) in CHOICES_019:
                assert value in CHOICES_019[node["type"], name], (node["type"], name, value)
            if (node["type"], name) in EXPECTED_019:
                assert value in EXPECTED_019[node["type"], name], (node["type"], name, value)
    for api_node in api.values():  # the twin sets each of 0.19's widgets (a value, or a link in its place)
        if not api_node["class_type"].startswith("ErnieImage"):
            widgets = set(CORE_WIDGETS_019[api_node["class_type"]]) - {"control_after_generate"}
            literal = {k for k, v in api_node["inputs"].items() if not isinstance(v, list)}
            assert literal <= widgets <= set(api_node["inputs"]), api_node

    pack = [n for n in nodes if n["type"].startswith("ErnieImage")]
    assert {n["type"] for n in pack} >= {"ErnieImagePELoader", "ErnieImagePromptEnhance", "ErnieImageCacheDiT",
                                          "ErnieImageCompile"}
    assert [p for n in pack for p in _invalid_widgets(n, object_info[n["type"]])] == []
    pe_loader = next(n for n in pack if n["type"] == "ErnieImagePELoader")
    assert _widget_values(pe_loader, object_info["ErnieImagePELoader"])["model_name"] == f"text_encoders/{RELEASE_PE}"

    note = next(n["widgets_values"][0] for n in ui["nodes"] if n["type"] == "Note")
    assert "ComfyUI 0.19" in note and "shift 3.0" in note and "no text mask" in note
