"""One HTTP request, bounded: one deadline for connecting, sending and the whole answer; a cap on the answer's size;
a stop request honoured within a fraction of a second, even in the middle of an answer; no redirect followed.

Per-read timeouts (what ``requests`` offers) let a server that trickles bytes hold a call forever, and a blocking
read cannot see a Cancel. Here the socket is the engine's own: a watchdog thread shuts it down at the deadline or at a
stop request, which ends any blocking connect, handshake or read at once. The answer is read in pieces and refused as
soon as it passes the cap, never held whole. Plain Python (stdlib ``http.client``), no ComfyUI.
"""

from __future__ import annotations

import errno
import http.client
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from .protocol import GenerationStopped

MAX_ANSWER_BYTES = 8 * 1024 * 1024  # a prompt enhancer's answer is a few KiB; a model listing rarely 100 KiB
_PIECE_BYTES = 64 * 1024
_WATCH_S = 0.05  # how often the watchdog looks at the stop request and the clock


class HttpFailure(Exception):
    """The request did not get a whole answer; the message names the URL and the reason. ``retryable``: a transient
    failure (connection, time), worth another attempt."""

    def __init__(self, message: str, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Mapping[str, str]
    body: bytes


def exchange(
    method: str,
    url: str,
    headers: Mapping[str, str],
    body: bytes | None,
    timeout_s: float,
    connect_s: float,
    should_stop: Callable[[], bool],
    max_bytes: int = MAX_ANSWER_BYTES,
) -> Answer:
    """Send one request and read its whole answer within ``timeout_s`` (connecting within ``connect_s`` of it).

    Raises ``GenerationStopped`` when ``should_stop()`` turns true, ``HttpFailure`` for everything else that keeps a
    whole answer from arriving. Any status is an answer: redirects are returned, not followed."""
    watch = _Watchdog(time.monotonic() + timeout_s, should_stop)
    phase, connection = "connect", None
    try:
        with watch:
            sock = _connect(url, min(connect_s, timeout_s), watch)
            phase = "send"
            connection = _connection(url, sock, watch)
            connection.request(method, urlsplit(url).path or "/", body=body,
                               headers={**headers, "Connection": "close"})
            response = connection.getresponse()
            phase = "body"
            return Answer(response.status, response.headers, _read_capped(response, max_bytes, url, watch))
    except (OSError, http.client.HTTPException) as error:
        if watch.reason == "stopped":
            raise GenerationStopped("the request was interrupted") from None
        raise _failure(url, phase, error, watch.reason, timeout_s, connect_s) from None
    finally:
        if connection is not None:
            connection.close()


def _failure(url: str, phase: str, error: Exception, reason: str | None, timeout_s: float,
             connect_s: float) -> HttpFailure:
    """What went wrong, in the user's words, from the phase the request was in and the error it ended with."""
    if isinstance(error, _ConnectTimeout):
        return HttpFailure(f"no connection to {url} within {min(connect_s, timeout_s):g} s")
    if reason == "deadline" or isinstance(error, TimeoutError):
        if phase == "body":
            return HttpFailure(f"{url} did not finish its answer within timeout_s={timeout_s:g} s (the limit covers "
                               "connecting and the whole answer)")
        return HttpFailure(f"no answer from {url} within timeout_s={timeout_s:g} s")
    if phase == "body":
        return HttpFailure(f"{url} dropped the connection mid-answer")
    if isinstance(error, ssl.SSLError):
        return HttpFailure(f"cannot reach {url} (TLS: {error.reason or error})")
    if isinstance(error, socket.gaierror):
        return HttpFailure(f"cannot reach {url} (host not found)")
    refused = isinstance(error, ConnectionRefusedError)
    return HttpFailure(f"cannot reach {url} ({'connection refused' if refused else 'connection failed'})")


class _ConnectTimeout(OSError):
    pass


class _Watchdog:
    """A thread that shuts the request's socket down at the deadline or when a stop is requested; ``reason`` says
    which (None while neither happened)."""

    def __init__(self, deadline: float, should_stop: Callable[[], bool]):
        self.deadline, self.should_stop = deadline, should_stop
        self.reason: str | None = None
        self._socket: socket.socket | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()

    def __enter__(self) -> _Watchdog:
        threading.Thread(target=self._watch, name="ernie-pe-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        with self._lock:
            if self._socket is not None:
                self._socket.close()

    def guard(self, sock: socket.socket) -> None:
        with self._lock:
            self._socket = sock

    def check(self) -> str | None:
        """Why the request must end now, if it must."""
        if self.reason is None:
            if self.should_stop():
                self.reason = "stopped"
            elif time.monotonic() >= self.deadline:
                self.reason = "deadline"
        return self.reason

    def left(self) -> float:
        return max(self.deadline - time.monotonic(), 0.001)

    def _watch(self) -> None:
        while not self._done.wait(_WATCH_S):
            if self.check():
                with self._lock:
                    if self._socket is not None:
                        try:  # the plain socket's shutdown, also under TLS: it ends a blocked read in any thread
                            socket.socket.shutdown(self._socket, socket.SHUT_RDWR)
                        except OSError:
                            pass  # not connected yet: the connect loop sees the reason
                return


def _connect(url: str, connect_s: float, watch: _Watchdog) -> socket.socket:
    """A connected TCP socket, by a non-blocking connect polled against the stop request and both time limits."""
    parts = urlsplit(url)
    limit = time.monotonic() + connect_s
    error: OSError = ConnectionError("no address")
    for family, kind, proto, _, address in socket.getaddrinfo(parts.hostname, parts.port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        watch.guard(sock)
        sock.setblocking(False)
        code = sock.connect_ex(address)
        while code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EALREADY, getattr(errno, "WSAEWOULDBLOCK", -1)):
            if watch.check():
                raise TimeoutError("deadline") if watch.reason == "deadline" else ConnectionAbortedError("stopped")
            if time.monotonic() >= limit:
                raise _ConnectTimeout("connect timeout")
            _, writable, failed = select.select([], [sock], [sock], _WATCH_S)
            if writable or failed:
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code == 0:
            sock.settimeout(watch.left())  # a backstop: the watchdog ends blocked calls first
            return sock
        error = OSError(code, os.strerror(code))
        if code == errno.ECONNREFUSED:
            error = ConnectionRefusedError(code, os.strerror(code))
        sock.close()
    raise error


def _connection(url: str, sock: socket.socket, watch: _Watchdog) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    if parts.scheme == "https":
        sock = _tls_context().wrap_socket(sock, server_hostname=parts.hostname)
        watch.guard(sock)
        connection = http.client.HTTPSConnection(parts.hostname, parts.port)
    else:
        connection = http.client.HTTPConnection(parts.hostname, parts.port)
    connection.sock = sock
    return connection


def _tls_context() -> ssl.SSLContext:
    """The system's certificate authorities, plus certifi's (what ``requests`` used) and ``REQUESTS_CA_BUNDLE``."""
    context = ssl.create_default_context()
    try:
        import certifi

        context.load_verify_locations(certifi.where())
    except (ImportError, OSError):
        pass
    bundle = os.environ.get("REQUESTS_CA_BUNDLE")
    if bundle:
        context.load_verify_locations(bundle)
    return context


def _read_capped(response: http.client.HTTPResponse, max_bytes: int, url: str, watch: _Watchdog) -> bytes:
    """The whole body, read in pieces; refused as soon as it is known to pass ``max_bytes``."""
    too_large = HttpFailure(f"{url} sent an answer larger than {max_bytes / 2**20:g} MiB, refused (a prompt enhancer "
                            "answers in a few KiB): check that base_url is the enhancer's server", retryable=False)
    announced = response.getheader("Content-Length", "")
    if announced.isdigit() and int(announced) > max_bytes:
        raise too_large
    body = bytearray()
    while piece := response.read1(_PIECE_BYTES):
        if len(body) + len(piece) > max_bytes:
            raise too_large
        body += piece
    if response.length:  # read1 ends quietly where the connection did, short of the announced length
        raise http.client.IncompleteRead(bytes(body), response.length)
    if watch.reason and response.length is None and not response.chunked:
        raise ConnectionAbortedError(watch.reason)  # an answer that ends with the connection, cut by the watchdog
    return bytes(body)
