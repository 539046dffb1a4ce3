"""Servers for the remote PE tests: a real ``transformers serve`` on a tiny PE, and a fault-injecting HTTP server for
the failures a real server does not produce on demand (5xx, 429, hangs, malformed or empty answers)."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from scripts.comfy_headless import free_port, wait_until_serving


def reserved_port() -> int:
    """A free port that stays free until a server is started on it later in the run: below every system's range of
    ports handed out on demand (Linux from 32768, macOS and Windows from 49152), where a port taken early from that
    range (``free_port``) may be handed to another test's server first ("Address already in use" minutes later)."""
    for port in random.sample(range(20000, 32000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port between 20000 and 32000")


@dataclass
class Reply:
    """One scripted answer: a status, a body (dict → JSON, str/bytes as is, or a function of the request's JSON
    body returning a dict), headers, and a delay before it. ``cut``: only the first ``cut`` bytes of the body are
    sent (the headers announce all of it), then, after ``stall`` seconds, the connection closes, as when a server
    crashes or hangs mid-answer. ``size``: instead of ``body``, that many filler bytes, made as they are sent (never
    held whole), in pieces of ``piece`` bytes ``pace`` seconds apart (a trickle); ``announce`` False: no
    Content-Length, the answer ends when the connection closes."""

    status: int = 200
    body: dict | str | bytes | Callable[[dict], dict] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    delay: float = 0.0
    cut: int | None = None
    stall: float = 0.0
    size: int | None = None
    piece: int = 64 * 1024
    pace: float = 0.0
    announce: bool = True

    def pieces(self, request: dict | None) -> tuple[int, Iterator[bytes]]:
        """The body's length and its pieces."""
        if self.size is not None:
            count, rest = divmod(self.size, self.piece)
            filler = b"x" * self.piece
            return self.size, itertools.chain(itertools.repeat(filler, count), [filler[:rest]] if rest else [])
        body = self.body(request) if callable(self.body) else self.body
        if isinstance(body, dict):
            body = json.dumps(body).encode()
        elif isinstance(body, str):
            body = body.encode()
        return len(body), iter([body[:self.cut]])


def chat_body(content: str | None, finish_reason: str = "stop") -> dict:
    """A well-formed chat-completions answer."""
    message = {"role": "assistant", "content": content}
    return {"object": "chat.completion", "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}]}


def chat_reply(content: str | None, finish_reason: str = "stop", delay: float = 0.0) -> Reply:
    return Reply(body=chat_body(content, finish_reason), delay=delay)


def models_reply(*entries: dict) -> Reply:
    """A ``/models`` listing of these entries (default: one model, "pe", as transformers serve lists a local one)."""
    return Reply(body={"object": "list", "data": list(entries or [{"id": "pe", "object": "model", "created": 0}])})


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: dict | None
    at: float


class _Server:
    """A threaded HTTP server on 127.0.0.1 that records every request it receives, then lets ``answer`` reply.
    ``tls``: (certificate, key) files, to serve HTTPS."""

    def __init__(self, port: int | None = None, tls: tuple[Path, Path] | None = None):
        self.received: list[Received] = []
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                with server._lock:
                    server.received.append(Received(self.command, self.path, dict(self.headers),
                                                    json.loads(raw) if raw else None, time.monotonic()))
                try:
                    server.answer(self, raw)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout, cancel and size tests)

            do_GET = do_POST = _handle

            def log_message(self, *args) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port or free_port()), Handler)
        self._httpd.daemon_threads = True
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self.port = self._httpd.server_port
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    @property
    def chats(self) -> list[Received]:
        """The chat-completions requests received (not the model listings)."""
        return [r for r in self.received if r.path.endswith("/chat/completions")]

    def answer(self, handler: BaseHTTPRequestHandler, raw: bytes) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FaultServer(_Server):
    """Answers chat requests from a script, in order (then ``default``), and model listings with ``models``; records
    what it received and counts the body bytes it sent."""

    def __init__(self, default: Reply | None = None, port: int | None = None, tls: tuple[Path, Path] | None = None):
        self.default = default or chat_reply("a default answer")
        self.models = models_reply()
        self.script: list[Reply] = []
        self.in_flight = self.max_in_flight = self.bytes_sent = 0
        super().__init__(port, tls)

    def answer(self, handler: BaseHTTPRequestHandler, raw: bytes) -> None:
        with self._lock:
            if handler.path.endswith("/models"):
                reply = self.models
            else:
                reply = self.script.pop(0) if self.script else self.default
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        time.sleep(reply.delay)
        with self._lock:
            self.in_flight -= 1
        length, pieces = reply.pieces(json.loads(raw) if raw else None)
        handler.send_response(reply.status)
        for name, value in reply.headers.items():
            handler.send_header(name, value)
        if reply.announce:
            handler.send_header("Content-Length", str(length))
        handler.end_headers()
        for piece in pieces:
            handler.wfile.write(piece)
            handler.wfile.flush()
            with self._lock:
                self.bytes_sent += len(piece)
            time.sleep(reply.pace)
        time.sleep(reply.stall)


class RecordingProxy(_Server):
    """A real server behind a recorder: forwards each request to ``target`` (``prefix`` in front of the path is
    replaced by ``/v1``, as an API gateway maps its own root) and records it. Its own port is another origin."""

    def __init__(self, target: str, prefix: str = "/v1"):
        self.target, self.prefix = target, prefix
        super().__init__()

    def answer(self, handler: BaseHTTPRequestHandler, raw: bytes) -> None:
        _forward(handler, raw, self.target, "/v1" + handler.path.removeprefix(self.prefix))


class ForwardProxy(_Server):
    """An HTTP proxy, as ``HTTP_PROXY`` names one: it takes requests for an absolute URI (``POST
    http://127.0.0.1:8000/v1/chat/completions``), records them and forwards them to that URI, on 127.0.0.1 only."""

    def answer(self, handler: BaseHTTPRequestHandler, raw: bytes) -> None:
        target = urlsplit(handler.path)
        if target.scheme != "http" or target.hostname != "127.0.0.1":
            handler.send_error(403, "this test proxy forwards only to http://127.0.0.1")
            return
        _forward(handler, raw, f"http://127.0.0.1:{target.port}", target.path)


def _forward(handler: BaseHTTPRequestHandler, raw: bytes, target: str, path: str) -> None:
    """Send the request to ``target`` at ``path`` and its answer back."""
    headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("host", "connection", "proxy-connection")}
    upstream = http.client.HTTPConnection(urlsplit(target).hostname, urlsplit(target).port, timeout=120)
    try:
        upstream.request(handler.command, path, body=raw or None, headers=headers)
        response = upstream.getresponse()
        body = response.read()
    finally:
        upstream.close()
    handler.send_response(response.status)
    handler.send_header("Content-Type", response.getheader("Content-Type", "application/json"))
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


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


def remote(url: str, **options):
    """A remote PE on ``url`` with the plain-torch runtime, as the tests use it."""
    from comfyui_ernie_image.nodes.pe.remote.enhancer import RemotePromptEnhancer
    from comfyui_ernie_image.nodes.pe.runtime import Runtime

    return RemotePromptEnhancer(url, runtime=Runtime(), **options)


def key_not_sent(name: str) -> str:
    """The pack's one refusal for a key in ``name`` that is unset, unbound or bound to another server (issue 24),
    written out here so that a change of its words is seen."""
    return (
        f"the key in {name} (api_key_env) was not sent: api_key_env may name only ERNIE_PE_API_KEY or "
        "ERNIE_PE_API_KEY_<NAME> (capitals, digits and _), and the key is sent only to the server whose address is in "
        "the variable of the same name ending in _URL (under that address's path, when it has one); both must be set "
        "in the environment ComfyUI starts from, outside the workflow, so that a shared workflow cannot send your key "
        f"elsewhere. Fix: set {name} to the key and {name}_URL to the address of the server it belongs to, there, and "
        "use that server's base_url; or clear api_key_env when the server needs no key")


def name_in_environment(monkeypatch, url: str, name: str = "ERNIE_PE_API_KEY_TESTS") -> None:
    """Name the server at ``url`` in the environment, as a user names theirs (``<name>_URL``, no key): only such a
    server's own words are quoted in errors (issue 41)."""
    monkeypatch.setenv(f"{name}_URL", url)
