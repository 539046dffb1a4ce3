"""Servers for the remote PE tests: a real ``transformers serve`` on a tiny PE, and a fault-injecting HTTP server for
the failures a real server does not produce on demand (5xx, 429, hangs, malformed or empty answers)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from comfy_headless import free_port, wait_until_serving


@dataclass
class Reply:
    """One scripted answer: a status, a body (dict → JSON, str/bytes as is, or a function of the request's JSON
    body returning a dict), headers, and a delay before it. ``cut``: only the first ``cut`` bytes of the body are
    sent (the headers announce all of it), then, after ``stall`` seconds, the connection closes, as when a server
    crashes or hangs mid-answer."""

    status: int = 200
    body: dict | str | bytes | Callable[[dict], dict] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    cut: int | None = None
    stall: float = 0.0


def chat_body(content: str | None, finish_reason: str = "stop") -> dict:
    """A well-formed chat-completions answer."""
    message = {"role": "assistant", "content": content}
    return {"object": "chat.completion", "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}]}


def chat_reply(content: str | None, finish_reason: str = "stop", delay: float = 0.0) -> Reply:
    return Reply(body=chat_body(content, finish_reason), delay=delay)


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: dict | None
    at: float


class FaultServer:
    """Answers requests from a script, in order (then ``default``), and records what it received."""

    def __init__(self, default: Reply | None = None):
        self.default = default or chat_reply("a default answer")
        self.script: list[Reply] = []
        self.received: list[Received] = []
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                request = json.loads(self.rfile.read(length)) if length else None
                with server._lock:
                    server.received.append(Received(self.command, self.path, dict(self.headers), request,
                                                    time.monotonic()))
                    reply = server.script.pop(0) if server.script else server.default
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                time.sleep(reply.delay)
                with server._lock:
                    server.in_flight -= 1
                body = reply.body(request) if callable(reply.body) else reply.body
                if isinstance(body, dict):
                    body = json.dumps(body).encode()
                elif isinstance(body, str):
                    body = body.encode()
                try:
                    self.send_response(reply.status)
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body[:reply.cut])
                    self.wfile.flush()
                    time.sleep(reply.stall)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout tests)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self._httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._httpd.server_port}"
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@contextmanager
def transformers_serve(model_folder: Path, workdir: Path) -> Iterator[str]:
    """``transformers serve`` (a real OpenAI-compatible server) on a copy of a tiny PE folder, offline, on a free
    port. The copy samples (``do_sample``), so temperature, top_p and seed matter. Yields the base URL."""
    folder = workdir / model_folder.name
    shutil.copytree(model_folder, folder)
    config_file = folder / "generation_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "do_sample": True}))
    port = free_port()
    log = open(workdir / "transformers_serve.log", "w")
    command = [str(Path(sys.executable).parent / "transformers"), "serve", str(folder), "--host", "127.0.0.1",
               "--port", str(port)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(process, f"{url}/v1/models", 120, (workdir / "transformers_serve.log").read_text)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
