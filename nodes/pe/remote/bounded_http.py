"""One HTTP request, bounded: one deadline for connecting, sending and the whole answer; a cap on the answer's size;
a stop request honoured within a fraction of a second, even in the middle of an answer; no redirect followed.

Made with ``requests`` (a ``Session`` that trusts the environment), so that ``HTTP(S)_PROXY``, ``NO_PROXY`` and
``REQUESTS_CA_BUNDLE`` work as everywhere else. Its timeouts are per socket operation and a read timeout ends the
answer (urllib3 closes the connection), so they cannot poll: a trickling server would hold the call forever and a
blocking read would not see a Cancel. So each connection hands its socket to a watchdog thread, which shuts it down
at the deadline or at a stop request, ending a blocked wait for the headers or a read at once. The answer is read in
pieces and refused as soon as it passes the cap, never held whole. No ComfyUI.
"""

from __future__ import annotations

import functools
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import requests
import requests.utils
import urllib3
import urllib3.exceptions
from requests.adapters import HTTPAdapter

from ..protocol import GenerationStopped
from .url import is_link_local, link_local_refusal

MAX_ANSWER_BYTES = 8 * 1024 * 1024  # a prompt enhancer's answer is a few KiB; a model listing rarely 100 KiB
_PIECE_BYTES = 64 * 1024
_WATCH_S = 0.05  # how often the watchdog looks at the stop request and the clock
_current = threading.local()  # the watchdog of the request this thread is making: its connections report to it


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
    whole answer from arriving. Any status is an answer: redirects are returned, not followed. A stop request made
    while the TCP connection is being made is seen when it is made (or fails), within ``connect_s``."""
    session = requests.Session()  # trust_env: proxies, NO_PROXY and the CA bundle come from the environment
    session.auth = lambda request: request  # with auth set, no ~/.netrc: its Basic auth would replace the key
    session.mount("http://", _WatchedAdapter(max_retries=0))
    session.mount("https://", _WatchedAdapter(max_retries=0))
    # identity: the cap counts the bytes that arrive, and no compressed answer can unpack beyond it
    headers = {**headers, "Connection": "close", "Accept-Encoding": "identity"}
    settings = session.merge_environment_settings(url, {}, True, None, None)
    proxy = requests.utils.select_proxy(url, settings["proxies"])
    watch, response, phase = _Watchdog(time.monotonic() + timeout_s, should_stop, proxy is None), None, "request"
    try:
        prepared = session.prepare_request(requests.Request(method, url, headers=headers, data=body))
        with watch:
            _current.watch = watch
            # The adapter itself, not Session.send: even with allow_redirects=False, that reads a redirect's whole
            # body (uncapped) to find where it points.
            response = session.get_adapter(url).send(
                prepared, stream=True, timeout=(max(min(connect_s, timeout_s), 0.001), max(timeout_s, 0.001)),
                verify=settings["verify"], cert=settings["cert"], proxies=settings["proxies"])
            phase = "body"
            return Answer(response.status_code, response.headers, _read_capped(response, max_bytes, url, watch))
    except (requests.RequestException, urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as error:
        if watch.reason == "stopped":
            raise GenerationStopped("the request was interrupted") from None
        raise _failure(url, phase, error, watch.reason, timeout_s, min(connect_s, timeout_s), proxy) from None
    finally:
        _current.watch = None
        if response is not None:
            response.close()
        session.close()


def _failure(url: str, phase: str, error: Exception, reason: str | None, timeout_s: float, connect_s: float,
             proxy: str | None) -> HttpFailure:
    """What went wrong, in the user's words, from the phase the request was in and the error it ended with."""
    through = f" through the proxy {_origin(proxy)}" if proxy else ""
    link_local = _found(error, LinkLocalAddress)
    if link_local is not None:
        return HttpFailure(f"{url} was not requested: {link_local}", retryable=False)
    if isinstance(error, requests.ConnectTimeout):
        return HttpFailure(f"no connection to {url}{through} within {connect_s:g} s")
    if reason == "deadline" or isinstance(error, requests.ReadTimeout | urllib3.exceptions.ReadTimeoutError):
        if phase == "body":
            return HttpFailure(f"{url} did not finish its answer within timeout_s={timeout_s:g} s (the limit covers "
                               "connecting and the whole answer)")
        return HttpFailure(f"no answer from {url} within timeout_s={timeout_s:g} s")
    if phase == "body":
        return HttpFailure(f"{url} dropped the connection mid-answer")
    if isinstance(error, requests.exceptions.InvalidURL | requests.exceptions.InvalidSchema):  # its text may quote
        hint = ": check HTTP_PROXY, HTTPS_PROXY and ALL_PROXY" if proxy else ""  # a proxy's password: never shown
        return HttpFailure(f"cannot reach {url}{through} ({type(error).__name__}{hint})", retryable=False)
    tls = _found(error, ssl.SSLError)
    if tls is not None:
        why = f"TLS: {tls.reason or tls}"
    elif _found(error, socket.gaierror) is not None:
        why = "host not found"
    else:
        why = "connection refused" if _found(error, ConnectionRefusedError) is not None else "connection failed"
    if isinstance(error, requests.exceptions.ProxyError):
        return HttpFailure(f"cannot reach {url} (the proxy {_origin(proxy)} from the environment: {why})")
    return HttpFailure(f"cannot reach {url}{through} ({why})")


def _origin(proxy: str | None) -> str:
    """A proxy's scheme, host and port: never the user name and password a proxy URL may carry."""
    try:
        parts = urlsplit(proxy if proxy and "://" in proxy else f"http://{proxy}")
        return f"{parts.scheme}://{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    except ValueError:
        return "(unreadable address)"


def _found(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first ``kind`` among the exceptions that ``error`` wraps (requests wraps urllib3's, which wraps the
    socket's, through arguments, ``reason`` and the exception chain)."""
    stack, seen = [error], set()
    while stack:
        item = stack.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        if isinstance(item, kind):
            return item
        seen.add(id(item))
        stack += [item.__cause__, item.__context__, getattr(item, "reason", None), *item.args]
    return None


class LinkLocalAddress(OSError):
    """The server's name led to a link-local address (a cloud metadata service): the request is not sent."""


def _refuse_link_local(name: str, port: int, peer: str | None = None) -> None:
    """Raise ``LinkLocalAddress`` when ``name`` resolves to a link-local address, or when the socket's ``peer``
    (the address connected to, after the resolution the connection made itself) is one. A name that does not resolve
    is left to the connection, which says so."""
    try:
        addresses = [peer] if peer else [info[4][0] for info in socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)]
    except (OSError, UnicodeError):
        return
    for address in addresses:
        if is_link_local(address):
            raise LinkLocalAddress(link_local_refusal(f"{name[:100]} resolves to", address))


class _Watchdog:
    """A thread that shuts the request's sockets down at the deadline or when a stop is requested; ``reason`` says
    which (None while neither happened). ``direct``: the connections go to the server itself, not to a proxy (which
    resolves the server's name itself), and so they are refused at a link-local address."""

    def __init__(self, deadline: float, should_stop: Callable[[], bool], direct: bool = True):
        self.deadline, self.should_stop, self.direct = deadline, should_stop, direct
        self.reason: str | None = None
        self._sockets: list[socket.socket] = []
        self._done = threading.Event()
        self._lock = threading.Lock()

    def __enter__(self) -> _Watchdog:
        threading.Thread(target=self._watch, name="ernie-pe-watchdog", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()

    def guard(self, sock: socket.socket) -> None:
        """Watch a newly connected socket; one connected after the request had to end is shut down at once."""
        with self._lock:
            self._sockets.append(sock)
        if self.check():
            self._shut()

    def check(self) -> str | None:
        """Why the request must end now, if it must."""
        if self.reason is None:
            if self.should_stop():
                self.reason = "stopped"
            elif time.monotonic() >= self.deadline:
                self.reason = "deadline"
        return self.reason

    def _shut(self) -> None:
        with self._lock:
            for sock in self._sockets:
                try:  # the plain socket's shutdown, also under TLS: it ends a blocked read in any thread
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except (OSError, TypeError):
                    pass  # closed, or not a plain socket (TLS inside an HTTPS proxy): the read timeout ends it

    def _watch(self) -> None:
        while not self._done.wait(_WATCH_S):
            if self.check():
                self._shut()
                return


class _Reports:
    """A urllib3 connection that, once connected, hands its socket to the watchdog of the request being made; made
    straight to the server, it is refused at a link-local address, before connecting (the name's addresses) and
    once connected (the address reached, should the name resolve otherwise the second time), before the request."""

    def connect(self) -> None:
        watch = getattr(_current, "watch", None)
        direct = watch is not None and watch.direct
        if direct:
            _refuse_link_local(self._dns_host, self.port)
        super().connect()
        if watch is not None:
            watch.guard(self.sock)
        if direct:
            try:
                _refuse_link_local(self._dns_host, self.port, peer=self.sock.getpeername()[0])
            except LinkLocalAddress:
                self.close()
                raise


@functools.cache
def _watched(pool: type) -> type:
    """A urllib3 pool class (direct, HTTP proxy or SOCKS) whose connections report their sockets to the watchdog."""
    if issubclass(pool.ConnectionCls, _Reports):
        return pool
    connection = type(pool.ConnectionCls.__name__, (_Reports, pool.ConnectionCls), {})
    return type(pool.__name__, (pool,), {"ConnectionCls": connection})


class _WatchedAdapter(HTTPAdapter):
    """requests' adapter, its connections, direct or through a proxy, reporting their sockets to the watchdog."""

    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, **kwargs)
        self._watch(self.poolmanager)

    def proxy_manager_for(self, proxy: str, **kwargs) -> urllib3.PoolManager:
        return self._watch(super().proxy_manager_for(proxy, **kwargs))

    @staticmethod
    def _watch(manager: urllib3.PoolManager) -> urllib3.PoolManager:
        manager.pool_classes_by_scheme = {scheme: _watched(pool) for scheme, pool in
                                          manager.pool_classes_by_scheme.items()}
        return manager


def _read_capped(response: requests.Response, max_bytes: int, url: str, watch: _Watchdog) -> bytes:
    """The whole body, read in pieces as it arrives (undecoded); refused as soon as it is known to pass the cap."""
    too_large = HttpFailure(f"{url} sent an answer larger than {max_bytes / 2**20:g} MiB, refused (a prompt enhancer "
                            "answers in a few KiB): check that base_url is the enhancer's server", retryable=False)
    announced = response.headers.get("Content-Length", "")
    if announced.isdigit() and int(announced) > max_bytes:
        raise too_large
    body = bytearray()
    while piece := response.raw.read(_PIECE_BYTES, decode_content=False):
        if len(body) + len(piece) > max_bytes:
            raise too_large
        body += piece
    if watch.check():  # the watchdog shut the socket: what ended may be the connection, not the answer
        raise ConnectionAbortedError(watch.reason)
    if announced.isdigit() and len(body) < int(announced):  # urllib3 1.x ends quietly where the connection did
        raise http.client.IncompleteRead(bytes(body), int(announced) - len(body))
    return bytes(body)
