"""ComfyUI citizenship through the running server: progress, interrupt, and /free."""

from __future__ import annotations

import json
import threading
import time

import requests
import websocket

from helpers.workflows import text_to_image

SNAPSHOT = "ERNIE-Image-Turbo-tiny"


def test_interrupt_stops_sampling_and_the_next_prompt_runs(comfy_server):
    steps = 400
    client_id = "interrupt-test"
    ws = websocket.create_connection(f"ws://127.0.0.1:{comfy_server.port}/ws?clientId={client_id}", timeout=120)
    graph = text_to_image(snapshot=SNAPSHOT, prompt="a long run", width=512, height=512, steps=steps, seed=99)
    response = requests.post(f"{comfy_server.url}/prompt", json={"prompt": graph, "client_id": client_id}, timeout=30)
    prompt_id = response.json()["prompt_id"]

    progress, interrupted_at, events = [], None, []
    while True:
        message = ws.recv()
        if not isinstance(message, str):
            continue  # binary preview frames
        event = json.loads(message)
        events.append(event["type"])
        if event["type"] == "progress" and event["data"].get("prompt_id") == prompt_id:
            progress.append(event["data"]["value"])
            if event["data"]["value"] >= 3 and interrupted_at is None:
                interrupted_at = (time.time(), event["data"]["value"])
                threading.Thread(target=comfy_server.interrupt).start()
        if event["type"] in ("execution_interrupted", "execution_success", "execution_error"):
            break
    ws.close()

    assert events[-1] == "execution_interrupted", events[-5:]
    assert max(progress) < steps // 2, "sampling went on long after the interrupt"
    assert time.time() - interrupted_at[0] < 10
    result = comfy_server.wait(prompt_id)
    assert result.status == "error"

    after = comfy_server.run(text_to_image(snapshot=SNAPSHOT, prompt="after interrupt", steps=2, seed=100))
    assert after.status == "success", after.messages


def test_free_unloads_the_pack_models_from_model_management(comfy_server):
    def run(seed: int) -> str:
        result, log = comfy_server.run_logged(text_to_image(snapshot=SNAPSHOT, prompt="free test", steps=1, seed=seed))
        assert result.status == "success", result.messages
        return log

    run(seed=200)  # loads everything
    assert "Requested to load ErnieImageModel" not in run(seed=201), "a loaded model was loaded again"
    comfy_server.free(unloads="ErnieImageModel")  # ComfyUI's record of loaded models lets it go
    assert "Requested to load ErnieImageModel" in run(seed=202)
