"""The PE nodes: in this process (listing, enabled off, lists, errors) and in a running ComfyUI (a local PE from the
repack file, interrupt, and an API key that reaches the server but no workflow, history or PNG)."""

from __future__ import annotations

import json
import os
import time

import folder_paths
import pytest
import requests
import websocket
from PIL import Image

from comfyui_ernie_image.nodes.pe.local.enhancer import LocalPromptEnhancer
from comfyui_ernie_image.nodes.pe.locate import pe_choices
from comfyui_ernie_image.nodes.pe.nodes import (
    ErnieImagePELoader,
    ErnieImagePERemote,
    ErnieImagePromptEnhance,
    result_cache,
)
from comfyui_ernie_image.nodes.pe.protocol import EnhancerError, PromptSpec, SamplingParams
from comfyui_ernie_image.nodes.pe.remote.enhancer import RemotePromptEnhancer
from comfyui_ernie_image.nodes.pe.runtime import Runtime
from helpers.pe_servers import FaultServer, RecordingProxy, chat_reply, reserved_port
from scripts.comfy_headless import free_port

# The headless ComfyUI inherits this process's environment when it starts: set the key, the server it is bound to,
# and another service's secret that no workflow may name, before any test runs.
KEY_ENV = "ERNIE_PE_API_KEY_E2E"
SECRET = "sk-e2e-4f3c2b1a0987654321"
KEY_SERVER_PORT = reserved_port()  # the e2e server the key is for, started by the test that uses it
os.environ[KEY_ENV] = SECRET
os.environ[f"{KEY_ENV}_URL"] = f"http://127.0.0.1:{KEY_SERVER_PORT}"
FOREIGN_ENV, FOREIGN_SECRET = "AWS_SECRET_ACCESS_KEY", "aws-e2e-secret-0123456789"
os.environ[FOREIGN_ENV] = FOREIGN_SECRET

SNAPSHOT_PE = "diffusers/ERNIE-Image-Turbo-tiny"
FOLDER_PE = "text_encoders/ernie-image-prompt-enhancer-tiny"
FILE_PE = "text_encoders/ernie-image-prompt-enhancer-tiny.safetensors"
FOLDER_LOADER = {"class_type": "ErnieImagePELoader",
                 "inputs": {"model_name": FOLDER_PE, "device": "default", "dtype": "auto"}}


def enhance_inputs(prompt: list[str], pe=None, enabled: bool = True, **overrides) -> dict:
    """The enhance node's inputs as ComfyUI passes them to a list node: every input a list."""
    values = {"width": 1024, "height": 1024, "enabled": enabled, "temperature": 0.6, "top_p": 0.8,
              "max_new_tokens": 16, "seed": 0, **overrides}
    return {"prompt": prompt, "pe": None if pe is None else [pe], **{k: [v] for k, v in values.items()}}


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path))
    result_cache.cache_clear()
    yield tmp_path
    result_cache.cache_clear()


def test_the_loader_lists_snapshots_folders_and_repack_files(comfy_paths):
    choices = pe_choices()
    assert {SNAPSHOT_PE, FOLDER_PE, FILE_PE} <= set(choices)
    schema_options = ErnieImagePELoader.define_schema().inputs[0].options
    assert schema_options == choices
    assert ErnieImagePELoader.validate_inputs(FILE_PE) is True
    assert "'text_encoders/missing.safetensors' was not found" in ErnieImagePELoader.validate_inputs(
        "text_encoders/missing.safetensors")


@pytest.mark.parametrize("name", [SNAPSHOT_PE, FOLDER_PE, FILE_PE])
def test_the_loader_returns_a_lazy_handle(comfy_paths, name):
    (handle,) = ErnieImagePELoader.execute(name, "cpu", "float32").result
    assert isinstance(handle, LocalPromptEnhancer) and not handle.loaded


def test_enabled_off_returns_the_prompts_and_touches_nothing(tiny_models, user_dir):
    dead = RemotePromptEnhancer("http://127.0.0.1:9", runtime=Runtime())  # nothing listens on port 9
    lazy = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"])
    for pe in (None, dead, lazy):
        output = ErnieImagePromptEnhance.execute(**enhance_inputs(["a cat", '"quoted" 中文'], pe, enabled=False))
        assert output.result == (["a cat", '"quoted" 中文'],)
    assert not lazy.loaded
    assert not (user_dir / "ernie_image").exists() and not (user_dir / "__ernie_image").exists()


def test_a_list_of_prompts_is_enhanced_in_order_and_cached(comfy_paths, user_dir):
    (pe,) = ErnieImagePELoader.execute(SNAPSHOT_PE, "cpu", "float32").result
    prompts = ["a cat", "a dog", "一只猫"]
    output = ErnieImagePromptEnhance.execute(**enhance_inputs(prompts, pe, width=848))
    (texts,) = output.result
    expected = pe.enhance([PromptSpec(p, 848, 1024) for p in prompts], SamplingParams(0.6, 0.8, 16, 0))
    assert texts == [c.text for c in expected]
    assert output.ui.as_dict() == {"text": ("\n\n".join(texts),)}
    assert (user_dir / "__ernie_image" / "pe_cache.sqlite3").is_file()  # a system user's folder (issue 24)


def test_no_pe_connected_is_a_clear_error(comfy_paths, user_dir):
    with pytest.raises(EnhancerError, match="No prompt enhancer is connected .*turn 'enabled' off"):
        ErnieImagePromptEnhance.execute(**enhance_inputs(["a cat"]))


def test_a_size_not_multiple_of_16_is_a_clear_error(comfy_paths, user_dir):
    """The frontend steps by 16, but the API and linked INT inputs pass any value through."""
    (pe,) = ErnieImagePELoader.execute(SNAPSHOT_PE, "cpu", "float32").result
    with pytest.raises(EnhancerError, match="width and height must be multiples of 16 \\(got 1000×777\\)"):
        ErnieImagePromptEnhance.execute(**enhance_inputs(["a cat"], pe, width=1000, height=777))
    assert not pe.loaded


def test_the_remote_node_checks_its_inputs_without_contacting_anything():
    """Nothing listens on either port: every check is made before any request."""
    (pe,) = ErnieImagePERemote.execute(f"http://127.0.0.1:{KEY_SERVER_PORT}/v1", "", KEY_ENV, 5.0, 0).result
    assert str(pe.root) == f"http://127.0.0.1:{KEY_SERVER_PORT}/v1" and pe.api_key_env == KEY_ENV
    with pytest.raises(EnhancerError, match="api_key_env takes the NAME of an environment variable"):
        ErnieImagePERemote.execute("http://127.0.0.1:9", "", "sk-pasted-key-1234", 5.0, 0)
    with pytest.raises(EnhancerError, match=rf"^the key in {KEY_ENV} \(api_key_env\) was not sent: ") as error:
        ErnieImagePERemote.execute("http://127.0.0.1:9", "", KEY_ENV, 5.0, 0)
    assert str(KEY_SERVER_PORT) not in str(error.value)  # the bound server is not told (issue 24)


def test_the_cache_input_is_last_optional_and_means_use_when_absent():
    """Added last and optional: a workflow saved before it loads unchanged (the API twins and graphs here that
    lack it run as "use")."""
    cache = ErnieImagePromptEnhance.define_schema().inputs[-1]
    assert (cache.id, cache.options, cache.default, cache.optional) == ("cache", ["use", "refresh", "off"], "use", True)
    fingerprint = ErnieImagePromptEnhance.fingerprint_inputs
    assert fingerprint(cache=["use"], seed=[0]) == fingerprint(cache=["use"], seed=[0]) == fingerprint(seed=[0])
    assert fingerprint(cache=["refresh"]) != fingerprint(cache=["refresh"])  # ComfyUI runs the node at every run


def test_cache_off_stores_nothing(comfy_paths, user_dir):
    (pe,) = ErnieImagePELoader.execute(SNAPSHOT_PE, "cpu", "float32").result
    output = ErnieImagePromptEnhance.execute(**enhance_inputs(["a cat"], pe), cache=["off"])
    assert output.result[0][0] and not (user_dir / "ernie_image").exists()


# --- a running ComfyUI ---------------------------------------------------------------------------------------------


def enhance_graph(pe_node: dict, prompt: str, **overrides) -> dict:
    inputs = {"prompt": prompt, "width": 1024, "height": 1024, "enabled": True, "temperature": 0.0, "top_p": 0.8,
              "max_new_tokens": 24, "seed": 0, **overrides}
    return {
        "1": pe_node,
        "2": {"class_type": "ErnieImagePromptEnhance", "inputs": {"pe": ["1", 0], **inputs}},
        "3": {"class_type": "PreviewAny", "inputs": {"source": ["2", 0]}},
    }


def test_e2e_the_repack_file_enhances_in_a_running_comfyui(comfy_server, tiny_models):
    loader = {"class_type": "ErnieImagePELoader", "inputs": {"model_name": FILE_PE, "device": "default",
                                                             "dtype": "auto"}}
    result = comfy_server.run(enhance_graph(loader, "a red cat"))
    assert result.status == "success", result.error
    (text,) = result.outputs["3"]["text"]
    expected = LocalPromptEnhancer.from_path(tiny_models["pe_single_file"], runtime=Runtime()).enhance(
        [PromptSpec("a red cat")], SamplingParams(0.0, 0.8, 24, 0))
    assert text == expected[0].text
    assert result.outputs["2"]["text"] == [text]  # also shown on the node


def test_e2e_interrupt_stops_the_enhancer_and_the_next_prompt_runs(comfy_server):
    client_id = "pe-interrupt-test"
    ws = websocket.create_connection(f"ws://127.0.0.1:{comfy_server.port}/ws?clientId={client_id}", timeout=120)
    # Greedy decoding of this prompt cycles through words without an EOS: it runs until interrupted.
    graph = enhance_graph(FOLDER_LOADER, "a long run", max_new_tokens=8192)
    response = requests.post(f"{comfy_server.url}/prompt", json={"prompt": graph, "client_id": client_id}, timeout=30)
    prompt_id = response.json()["prompt_id"]
    progress_at_interrupt, events = None, []
    while True:
        message = ws.recv()
        event = json.loads(message) if isinstance(message, str) else {"type": "binary", "data": {}}
        events.append(event["type"])
        data = event["data"]
        if event["type"] == "progress" and data.get("node") == "2" and progress_at_interrupt is None:
            progress_at_interrupt, interrupted_at = (data["value"], data["max"]), time.monotonic()
            comfy_server.interrupt()
        if event["type"] in ("execution_interrupted", "execution_success", "execution_error"):
            break
    ws.close()
    assert events[-1] == "execution_interrupted", events[-5:]
    value, most = progress_at_interrupt  # the bar counts prompts: a part of the one prompt was done
    assert most == 1 and 0 < value < 1 and time.monotonic() - interrupted_at < 5
    assert comfy_server.wait(prompt_id).status == "error"
    assert comfy_server.run(enhance_graph(FOLDER_LOADER, "next", max_new_tokens=4)).status == "success"


def test_e2e_free_unloads_the_enhancer_from_model_management(comfy_server):
    def run(seed: int) -> str:
        graph = enhance_graph(FOLDER_LOADER, "free test", max_new_tokens=4, seed=seed, temperature=0.6)
        result, log = comfy_server.run_logged(graph)
        assert result.status == "success", result.messages
        return log

    run(seed=300)  # loads the PE
    assert "Requested to load PromptEnhancerModule" not in run(seed=301), "the loaded PE was loaded again"
    comfy_server.free(unloads="PromptEnhancerModule")
    assert "Requested to load PromptEnhancerModule" in run(seed=302)


def _png_text(path) -> dict[str, str]:
    with Image.open(path) as image:
        return dict(image.text)


def test_e2e_the_api_key_reaches_the_server_but_no_workflow_history_or_png(comfy_server):
    fault = FaultServer(default=chat_reply("a red cat, detailed, soft light"), port=KEY_SERVER_PORT)
    try:
        remote = {"class_type": "ErnieImagePERemote", "inputs": {"base_url": fault.url, "model": "pe",
                                                                 "api_key_env": KEY_ENV, "timeout_s": 30.0,
                                                                 "max_retries": 0}}
        graph = enhance_graph(remote, "a red cat, secret-free")
        graph["4"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 64, "batch_size": 1, "color": 0}}
        graph["5"] = {"class_type": "SaveImage", "inputs": {"images": ["4", 0], "filename_prefix": "pe_key_test"}}
        workflow = {"nodes": [{"id": 1, "type": "ErnieImagePERemote",
                               "widgets_values": [fault.url, "pe", KEY_ENV, 30.0, 0]}]}  # what the frontend saves
        response = requests.post(f"{comfy_server.url}/prompt", timeout=30, json={
            "prompt": graph, "client_id": "pe-key-test", "extra_data": {"extra_pnginfo": {"workflow": workflow}}})
        assert response.status_code == 200, response.text
        result = comfy_server.wait(response.json()["prompt_id"])
        assert result.status == "success", result.error
        assert result.outputs["3"]["text"] == ["a red cat, detailed, soft light"]
        assert fault.received[-1].headers["Authorization"] == f"Bearer {SECRET}"

        history = requests.get(f"{comfy_server.url}/history/{result.prompt_id}", timeout=30).text
        (png,) = comfy_server.output_images(result)
        chunks = _png_text(png)
        assert KEY_ENV in chunks["prompt"] and KEY_ENV in chunks["workflow"] and KEY_ENV in history
        for saved in (chunks["prompt"], chunks["workflow"], history, json.dumps(graph), comfy_server.log()):
            assert SECRET not in saved
    finally:
        fault.close()


def test_e2e_a_workflow_naming_another_services_secret_is_refused_before_any_request(comfy_server):
    recorder = RecordingProxy(f"http://127.0.0.1:{free_port()}")  # records whatever reaches it: nothing may
    try:
        remote = {"class_type": "ErnieImagePERemote", "inputs": {"base_url": recorder.url, "model": "pe",
                                                                 "api_key_env": FOREIGN_ENV, "timeout_s": 30.0,
                                                                 "max_retries": 0}}
        result = comfy_server.run(enhance_graph(remote, "a shared workflow"))
        assert result.status == "error"
        message = result.error["exception_message"]
        assert message.startswith(f"api_key_env {FOREIGN_ENV} is refused: api_key_env may name only "
                                  "ERNIE_PE_API_KEY or ERNIE_PE_API_KEY_<NAME>")
        assert "Fix: set ERNIE_PE_API_KEY_<NAME>=<your key> and ERNIE_PE_API_KEY_<NAME>_URL" in message
        assert recorder.received == []
        history = requests.get(f"{comfy_server.url}/history/{result.prompt_id}", timeout=30).text
        assert FOREIGN_SECRET not in history + comfy_server.log()
    finally:
        recorder.close()


def _cached_nodes(result) -> set[str]:
    return {node for kind, data in result.messages if kind == "execution_cached" for node in data["nodes"]}


def test_e2e_refresh_enhances_at_every_run_and_use_reuses(comfy_server):
    for mode, rerun in (("use", False), ("refresh", True)):
        graph = enhance_graph(FOLDER_LOADER, f"cache {mode}", max_new_tokens=4, cache=mode)
        first, second = comfy_server.run(graph), comfy_server.run(graph)
        assert first.status == second.status == "success", second.error
        assert ("2" in _cached_nodes(second)) is not rerun, (mode, _cached_nodes(second))
        assert second.outputs["3"] == first.outputs["3"]  # the same text either way
