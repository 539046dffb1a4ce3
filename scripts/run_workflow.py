"""The main job: run the Turbo example workflow through a headless ComfyUI and report where the image went.

Real weights are used when the models folder's ``diffusers/ERNIE-Image-Turbo`` holds a snapshot. A folder named
with ``--models`` (or ``$ERNIE_MODELS_DIR``) must exist and hold it: it is never swapped for anything else. With no
folder named, ``./models`` is used when it holds the snapshot; otherwise, and with ``--tiny``, tiny random models in
the same layout are generated (in ``.cache/tiny-models``) and the output says so: the whole path runs anywhere, and
its image shows nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import uuid
from pathlib import Path

import requests
import websocket

from scripts.comfy_headless import ComfyServer

REPO = Path(__file__).resolve().parents[1]
WORKFLOW = REPO / "tests" / "workflows" / "ernie_image_turbo.json"
REAL_SNAPSHOT = "ERNIE-Image-Turbo"
TINY_SNAPSHOT = "ERNIE-Image-Turbo-tiny"


def _shown(path: Path) -> str:
    """A path as given on the command line, cut short (it is the user's text)."""
    text = str(path)
    return text if len(text) <= 200 else text[:200] + "…"


def named_models(models_dir: Path) -> Path:
    """The snapshot in the models folder the user named, or SystemExit saying what is missing there."""
    snapshot = models_dir / "diffusers" / REAL_SNAPSHOT
    if not models_dir.is_dir():
        raise SystemExit(f"demo: the models folder {_shown(models_dir)} does not exist. Name a ComfyUI models "
                         f"folder that holds diffusers/{REAL_SNAPSHOT}/, or run `bash scripts/demo.sh --tiny` for "
                         "tiny random models.")
    if not (snapshot / "model_index.json").is_file():
        inside = " (this folder is a snapshot itself: name the models folder that holds diffusers/)" if (
            models_dir / "model_index.json").is_file() else ""
        raise SystemExit(f"demo: the models folder {_shown(models_dir)} holds no {REAL_SNAPSHOT} snapshot: "
                         f"{_shown(snapshot / 'model_index.json')} is missing{inside}. Download it with `hf download "
                         f"baidu/{REAL_SNAPSHOT} --local-dir {_shown(snapshot)}`, or run `bash scripts/demo.sh "
                         "--tiny` for tiny random models.")
    return snapshot


def tiny_models() -> Path:
    """Tiny random models in the real layout, written once under ``.cache/tiny-models``."""
    tiny_dir = REPO / ".cache" / "tiny-models"
    if not (tiny_dir / "diffusers" / TINY_SNAPSHOT / "model_index.json").is_file():
        from scripts.tiny_models import write_models_folder

        print(f"generating tiny random models in {tiny_dir}")
        write_models_folder(tiny_dir)
    return tiny_dir


def choose_models(named: Path | None, tiny: bool) -> tuple[Path, str, int]:
    """The models folder, snapshot name and image size to use: the named folder's snapshot (which must be there),
    tiny models when asked, else ``./models``'s snapshot when it is there, else tiny models, said in words."""
    if tiny:
        print("tiny random models (--tiny): the whole path runs, and the image shows nothing")
        return tiny_models(), TINY_SNAPSHOT, 256
    if named is not None:
        named_models(named)
        return named, REAL_SNAPSHOT, 1024
    default = REPO / "models"
    if (default / "diffusers" / REAL_SNAPSHOT / "model_index.json").is_file():
        return default, REAL_SNAPSHOT, 1024
    print(f"no {REAL_SNAPSHOT} snapshot at {default / 'diffusers' / REAL_SNAPSHOT} and no --models folder named: "
          "running tiny random models instead (the whole path runs, and the image shows nothing). For real weights, "
          "put the snapshot there or name a models folder with --models.")
    return tiny_models(), TINY_SNAPSHOT, 256


def explain_import_failures(log: str) -> list[str]:
    """Lines on the node modules ComfyUI's log says failed to import: those that need torchaudio are expected here
    (``tests/requirements.txt`` leaves it out; ERNIE-Image uses no audio node), any other is not."""
    lines = []
    for module, cause in re.findall(r"^Cannot import (\S+) module for custom nodes: (.+)$", log, re.MULTILINE):
        name = Path(module).name
        if "torchaudio" in cause:
            lines.append(f"expected: ComfyUI's {name} did not import ({cause}): the test environment has no "
                         "torchaudio, which only ComfyUI's audio nodes need")
        else:
            lines.append(f"NOT expected: {name} did not import: {cause}")
    return lines


def run_with_timings(server: ComfyServer, graph: dict) -> tuple[str, list[tuple[str, float]]]:
    """Queue ``graph`` and time each node from ComfyUI's ``executing`` events."""
    client_id = uuid.uuid4().hex
    ws = websocket.create_connection(f"ws://127.0.0.1:{server.port}/ws?clientId={client_id}", timeout=3600)
    response = requests.post(f"{server.url}/prompt", json={"prompt": graph, "client_id": client_id}, timeout=60)
    response.raise_for_status()
    prompt_id = response.json()["prompt_id"]
    timings, current, started = [], None, time.perf_counter()
    while True:
        message = ws.recv()
        if not isinstance(message, str):
            continue
        event = json.loads(message)
        if event["type"] == "executing" and event["data"].get("prompt_id") == prompt_id:
            now = time.perf_counter()
            if current is not None:
                timings.append((current, now - started))
            current, started = event["data"]["node"], now
            if current is None:
                break
        if event["type"] == "execution_error":
            raise RuntimeError(event["data"]["exception_message"])
    ws.close()
    return prompt_id, timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path,
                        help="a ComfyUI models folder holding diffusers/ERNIE-Image-Turbo/ (default: "
                        "$ERNIE_MODELS_DIR; else ./models when it holds the snapshot, else tiny random models)")
    parser.add_argument("--tiny", action="store_true", help="tiny random models, whatever weights there are")
    parser.add_argument("--comfyui", type=Path, default=REPO / ".cache" / "comfyui")
    parser.add_argument("--prompt", help="replace the workflow's prompt")
    args = parser.parse_args()

    if args.tiny and args.models is not None:
        parser.error("--tiny runs tiny random models: name no --models folder with it")
    named = args.models or (Path(os.environ["ERNIE_MODELS_DIR"]) if os.environ.get("ERNIE_MODELS_DIR") else None)
    models_dir, snapshot, size = choose_models(named, args.tiny)
    graph = json.loads(WORKFLOW.read_text())
    graph["loader"]["inputs"]["model_name"] = snapshot
    graph["latent"]["inputs"].update(width=size, height=size)
    if args.prompt:
        graph["positive"]["inputs"]["text"] = args.prompt

    import torch  # after the checks above: a refused folder is said at once, not after torch's seconds of import

    server = ComfyServer(args.comfyui, REPO / "out" / "comfyui", REPO, models_dir, cpu=not torch.cuda.is_available())
    t0 = time.perf_counter()
    server.start()
    print(f"ComfyUI started in {time.perf_counter() - t0:.1f} s (log: {server.log_path})")
    for line in explain_import_failures(server.log()):
        print(f"  {line}")
    try:
        prompt_id, timings = run_with_timings(server, graph)
        result = server.wait(prompt_id)
    finally:
        server.stop()
    print(f"\n{snapshot} at {size}x{size}, {graph['sigmas']['inputs']['steps']} steps")
    for node, seconds in timings:
        print(f"  {graph[node]['class_type']:<24} {seconds:8.2f} s")
    print(f"  {'total':<24} {sum(s for _, s in timings):8.2f} s")
    for path in server.output_images(result):
        print(f"image: {path}")


if __name__ == "__main__":
    main()
