"""Cache-DiT and compile nodes in real headless ComfyUI servers (tiny models, CPU).

"The same image" means pixel-identical PNGs. A second, fresh server process gives the reference for "a run alone
in a fresh process"; the shared server runs the stories (runs before, interrupts, bypass).
"""

from __future__ import annotations

import json
import struct
import threading
import time
import uuid

import numpy as np
import pytest
import requests
import websocket

from comfyui_ernie_image.nodes.accel.cache_presets import CacheSettings
from conftest import COMFY_DIR, REPO
from helpers.reference import saved_image
from helpers.workflows import text_to_image

SNAPSHOT = "ERNIE-Image-Turbo-tiny"
TEXT_EVENT = 3  # ComfyUI's BinaryEventTypes.TEXT: text shown on a node


def cache_node(preset: str = "custom", **fields) -> tuple[str, dict]:
    return "ErnieImageCacheDiT", dict(vars(CacheSettings()), preset=preset, **fields)


STATIC_TS = cache_node(steps_mask="medium", steps_mask_cache="static", taylorseer_order=1)
# A: Base-like (KSampler, CFG 4, a negative prompt of another length); B: Turbo-like (SamplerCustom, CFG 1).
RUN_A = dict(prompt="a red cat sits on a blue mat", negative="dark", width=128, height=128, steps=10, cfg=4.0,
             seed=21, sampler="ksampler")
RUN_B = dict(prompt="an old house by the river at night", width=176, height=112, steps=8, cfg=1.0, seed=22,
             sampler="custom")


def _image(server, model_nodes=(), **run) -> np.ndarray:
    """The saved image of one run; a cached run must really sample (not come from ComfyUI's output cache)."""
    log_start = len(server.log())
    result = server.run(text_to_image(snapshot=SNAPSHOT, model_nodes=model_nodes, prefix=uuid.uuid4().hex[:8], **run))
    assert result.status == "success", result.messages
    if any(node == "ErnieImageCacheDiT" for node, _ in model_nodes):
        time.sleep(0.3)  # the server process writes its log
        assert f"Cache-DiT [custom] {run['steps']} steps" in server.log()[log_start:], "the sampler did not run"
    (path,) = server.output_images(result)
    return saved_image(path)


@pytest.fixture(scope="module")
def fresh(tiny_models, tmp_path_factory) -> dict[str, np.ndarray]:
    """Run B alone in a fresh server process: cached first (its very first run), then plain."""
    from scripts.comfy_headless import ComfyServer

    base = tmp_path_factory.mktemp("fresh_comfy")
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / "comfyui-ernie-image").symlink_to(REPO, target_is_directory=True)
    server = ComfyServer(COMFY_DIR, base, base / "custom_nodes", tiny_models["models_dir"])
    server.start()
    try:
        return {"cached_b": _image(server, (STATIC_TS,), **RUN_B), "plain_b": _image(server, **RUN_B)}
    finally:
        server.stop()


def test_the_nodes_document_their_presets(comfy_server):
    info = comfy_server.object_info()
    cache = info["ErnieImageCacheDiT"]["input"]["required"]
    assert cache["preset"][1]["options"] == ["quality", "balanced", "fast", "ultra", "custom"]
    tooltip = cache["preset"][1]["tooltip"]
    assert "ultra: F2B0 R0.3 W8 TaylorSeer1 mask ultra/dynamic. Caches at most 36/50 Base steps" in tooltip
    assert "and 4/8 Turbo steps" in tooltip
    modes = info["ErnieImageCompile"]["input"]["required"]["mode"][1]["options"]
    assert modes == ["default", "max-autotune-no-cudagraphs", "off"]


def test_threshold_zero_gives_the_plain_image(comfy_server):
    plain = _image(comfy_server, **RUN_A)
    zero = _image(comfy_server, (cache_node(residual_diff_threshold=0.0),), **RUN_A)
    assert np.array_equal(zero, plain)


def test_a_run_after_another_equals_a_fresh_process_and_bypass_restores_plain(comfy_server, fresh):
    """A then B through the same cached MODEL (prompt, size, steps, CFG, sampler changed): B is what B alone
    gives in a fresh process. Then the graph without the node gives the plain image again."""
    _image(comfy_server, (STATIC_TS,), **RUN_A)
    cached_b = _image(comfy_server, (STATIC_TS,), **RUN_B)
    assert np.array_equal(cached_b, fresh["cached_b"])

    plain_b = _image(comfy_server, **RUN_B)
    assert np.array_equal(plain_b, fresh["plain_b"])
    difference = np.abs(cached_b - plain_b)
    assert difference.max() > 0, "nothing was cached: the test would prove nothing"
    assert difference.mean() < 2.0, "the cached image is far from the plain one"


def test_an_interrupted_cached_run_leaves_nothing_for_the_next(comfy_server, fresh):
    client_id = uuid.uuid4().hex
    ws = websocket.create_connection(f"ws://127.0.0.1:{comfy_server.port}/ws?clientId={client_id}", timeout=120)
    graph = text_to_image(snapshot=SNAPSHOT, model_nodes=(STATIC_TS,), prompt="a long cached run", width=512,
                          height=512, steps=400, seed=5)
    response = requests.post(f"{comfy_server.url}/prompt", json={"prompt": graph, "client_id": client_id}, timeout=30)
    prompt_id = response.json()["prompt_id"]
    interrupted = False
    while True:
        message = ws.recv()
        if not isinstance(message, str):
            continue
        event = json.loads(message)
        if event["type"] == "progress" and event["data"]["value"] >= 3 and not interrupted:
            interrupted = True
            threading.Thread(target=comfy_server.interrupt).start()
        if event["type"] in ("execution_interrupted", "execution_success", "execution_error"):
            break
    ws.close()
    assert event["type"] == "execution_interrupted"
    assert comfy_server.wait(prompt_id).status == "error"

    assert np.array_equal(_image(comfy_server, (STATIC_TS,), **RUN_B), fresh["cached_b"])


def test_each_run_reports_on_the_node_and_in_the_log(comfy_server):
    client_id = uuid.uuid4().hex
    ws = websocket.create_connection(f"ws://127.0.0.1:{comfy_server.port}/ws?clientId={client_id}", timeout=120)
    log_start = len(comfy_server.log())
    graph = text_to_image(snapshot=SNAPSHOT, model_nodes=(cache_node("fast"),), prompt="a report", steps=8, seed=7)
    response = requests.post(f"{comfy_server.url}/prompt", json={"prompt": graph, "client_id": client_id}, timeout=30)
    texts = []
    while True:
        message = ws.recv()
        if isinstance(message, bytes):
            event, length = struct.unpack(">II", message[:8])
            if event == TEXT_EVENT:
                texts.append((message[8:8 + length].decode(), message[8 + length:].decode()))
        elif json.loads(message)["type"] in ("execution_success", "execution_error"):
            break
    ws.close()
    assert comfy_server.wait(response.json()["prompt_id"]).status == "success"
    expected = "Cache-DiT [fast] 8 steps, F4B0 R0.2 W8 TaylorSeer1 mask fast/dynamic: cond: "
    assert any(node == "model_0" and text.startswith(expected) for node, text in texts), texts
    time.sleep(0.5)  # the server process writes its log
    assert f"ERNIE-Image {expected}" in comfy_server.log()[log_start:]


def test_compile_and_cache_in_one_graph(comfy_server):
    cached = _image(comfy_server, (STATIC_TS,), **RUN_B)
    both = _image(comfy_server, (("ErnieImageCompile", {"mode": "default"}), STATIC_TS), **RUN_B)
    assert np.abs(both - cached).max() <= 1.0
