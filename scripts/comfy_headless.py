"""A real headless ComfyUI server in a subprocess, with the pack installed as a custom node.

Used by the tests and by the main job (``run_workflow.py``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_serving(process: subprocess.Popen, url: str, timeout: float, log: Callable[[], str]) -> None:
    """Wait until ``url`` answers 200, failing early (with the process's ``log()``) when the process exits."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:3]} exited at start:\n{log()}")
        try:
            if requests.get(url, timeout=2).ok:
                return
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer within {timeout:.0f} s:\n{log()}")
        time.sleep(0.3)


@dataclass
class PromptResult:
    """What the server recorded for one prompt: its status, outputs and any execution error."""

    prompt_id: str
    status: str
    outputs: dict
    messages: list = field(default_factory=list)

    @property
    def error(self) -> dict | None:
        for kind, data in self.messages:
            if kind == "execution_error":
                return data
        return None


class ComfyServer:
    """Starts ComfyUI's ``main.py`` on a free port with its own base directory; talks to it over HTTP.

    ``pack_dir`` is installed as ``custom_nodes/<pack_name>`` (a link); ``ui`` serves the real frontend
    (the ``comfyui-frontend-package``), otherwise a placeholder page; ``python`` is the interpreter that runs
    ComfyUI (another environment's, e.g. a fresh install's), by default this one; ``env`` is added to its
    environment and ``extra_args`` to its command line.
    """

    def __init__(self, comfy_dir: Path, base_dir: Path, pack_dir: Path, models_dir: Path, cpu: bool = True,
                 ui: bool = False, pack_name: str = "comfyui-ernie-image", python: str | Path = sys.executable,
                 env: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()):
        self.comfy_dir = comfy_dir
        self.base_dir = base_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = base_dir / "server.log"
        custom_nodes_dir = base_dir / "custom_nodes"
        custom_nodes_dir.mkdir(parents=True, exist_ok=True)
        link = custom_nodes_dir / pack_name
        if not link.exists():
            link.symlink_to(pack_dir, target_is_directory=True)
        frontend_args = []
        if not ui:
            frontend = base_dir / "frontend"
            frontend.mkdir(parents=True, exist_ok=True)
            (frontend / "index.html").write_text("<html>headless</html>")
            frontend_args = ["--front-end-root", str(frontend)]
        paths = base_dir / "paths.yaml"
        model_folders = "\n".join(
            f"  {name}: {models_dir / name}"
            for name in ("diffusers", "diffusion_models", "text_encoders", "vae", "checkpoints", "loras")
        )
        paths.write_text(f"ernie:\n  base_path: {base_dir}\n  custom_nodes: {custom_nodes_dir}\n{model_folders}\n")
        self.args = [
            str(python), "main.py", *(["--cpu"] if cpu else []), "--listen", "127.0.0.1", "--port", str(self.port),
            "--disable-auto-launch", "--disable-api-nodes", "--verbose", "DEBUG", *frontend_args,
            "--base-directory", str(base_dir), "--extra-model-paths-config", str(paths), *extra_args,
        ]
        self.env = env or {}
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> None:
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}  # the log is read while the server runs
        self.process = subprocess.Popen(self.args, cwd=self.comfy_dir, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env)
        wait_until_serving(self.process, f"{self.url}/object_info/ErnieImageLoader", timeout, self.log)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
            self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def object_info(self) -> dict:
        return requests.get(f"{self.url}/object_info", timeout=30).json()

    def submit(self, prompt: dict) -> requests.Response:
        """POST /prompt; a 400 carries ComfyUI's validation errors (``node_errors``)."""
        return requests.post(f"{self.url}/prompt", json={"prompt": prompt, "client_id": uuid.uuid4().hex}, timeout=30)

    def wait(self, prompt_id: str, timeout: float = 300.0) -> PromptResult:
        deadline = time.time() + timeout
        while time.time() < deadline:
            history = requests.get(f"{self.url}/history/{prompt_id}", timeout=30).json()
            if prompt_id in history:
                entry = history[prompt_id]
                status = entry.get("status", {})
                return PromptResult(prompt_id, status.get("status_str", "?"), entry.get("outputs", {}),
                                    status.get("messages", []))
            time.sleep(0.2)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout}s:\n{self.log()[-4000:]}")

    def run(self, prompt: dict, timeout: float = 300.0) -> PromptResult:
        response = self.submit(prompt)
        assert response.status_code == 200, json.dumps(response.json(), indent=1)
        return self.wait(response.json()["prompt_id"], timeout)

    def queue_remaining(self) -> int:
        return requests.get(f"{self.url}/prompt", timeout=30).json()["exec_info"]["queue_remaining"]

    def interrupt(self) -> None:
        requests.post(f"{self.url}/interrupt", timeout=30)

    def wait_for_log(self, text: str, start: int, timeout: float = 60.0) -> str:
        """The log from offset ``start`` once ``text`` appears in it (the server writes it asynchronously)."""
        deadline = time.monotonic() + timeout
        while text not in self.log()[start:]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"'{text}' did not appear in the server log within {timeout:.0f} s")
            time.sleep(0.1)
        return self.log()[start:]

    def run_logged(self, prompt: dict) -> tuple[PromptResult, str]:
        """Run ``prompt`` and return its result with what the server logged for it."""
        start = len(self.log())
        result = self.run(prompt)
        return result, self.wait_for_log("Prompt executed", start)

    def free(self, unloads: str, timeout: float = 60.0) -> None:
        """``POST /free`` (unload models, free memory), then wait until the worker logs ``Unloading <unloads>``:
        it acts on the request between prompts, and only at DEBUG level does it say what it unloaded.

        Posted again every few seconds until then: core's prompt worker reads the flags, collects garbage, then waits
        on the queue for up to 1000 s, and a request that comes between only sets them, its wake-up lost (main.py's
        ``prompt_worker`` and ``PromptQueue.get``, 0.3.75 and upstream main.py @02018c7eb588; seen on a busy CPU)."""
        start, deadline = len(self.log()), time.monotonic() + timeout
        while True:
            requests.post(f"{self.url}/free", json={"unload_models": True, "free_memory": True}, timeout=30)
            try:
                self.wait_for_log(f"Unloading {unloads}", start, timeout=min(5.0, deadline - time.monotonic()))
                return
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise

    def output_images(self, result: PromptResult) -> list[Path]:
        paths = []
        for node_output in result.outputs.values():
            for image in node_output.get("images", []):
                paths.append(self.base_dir / "output" / image.get("subfolder", "") / image["filename"])
        return paths
