"""A remote PE's address. ``base_url`` is an API root, as the OpenAI client's ``base_url``: a scheme, a host, a port and
an optional path prefix (``/v1``, ``/llm/lmapi/v3``), and nothing else.

A shared workflow chooses ``base_url`` and the user's ComfyUI sends to it, so what it may hold is narrow: no query or
fragment (an API root has none; they would make any URL on the user's network reachable), no ``user:password@`` (a
credential in a saved workflow), no link-local address (a cloud's metadata service; ``bounded_http`` refuses one a
name resolves to as well). Plain Python, no ComfyUI.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..protocol import EnhancerError

_DEFAULT_PORTS = {"http": 80, "https": 443}
_DEFAULT_ROOT = "/v1"  # vLLM, SGLang and transformers serve answer under /v1: a bare host means its /v1
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9_-]*[A-Za-z0-9])?)*\.?")
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9._~-]+")
_ENDPOINTS = ("/chat/completions", "/completions", "/models")


@dataclass(frozen=True)
class ApiRoot:
    """An API root: requests go to ``<origin><path>/<endpoint>``."""

    scheme: str
    host: str  # lower case; an IPv6 address without brackets
    port: int
    path: str  # "/v1", "/llm/lmapi/v3": no trailing slash

    @property
    def origin(self) -> str:
        """Scheme, host and port, the default port left out: what a key is bound to (the web's security boundary)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        port = "" if self.port == _DEFAULT_PORTS[self.scheme] else f":{self.port}"
        return f"{self.scheme}://{host}{port}"

    def covers(self, other: ApiRoot) -> bool:
        """Whether ``other`` is this root or lies under it: the same origin, and ``other``'s path is this path or
        goes on below it part by part (``/v1`` covers ``/v1/x``, not ``/v10``). An empty path covers the origin."""
        return self.origin == other.origin and (other.path == self.path or other.path.startswith(self.path + "/"))

    def url(self, endpoint: str) -> str:
        """The URL of an endpoint under this root, e.g. ``url("chat/completions")``."""
        return f"{self.origin}{self.path}/{endpoint}"

    def __str__(self) -> str:
        return f"{self.origin}{self.path}"


def parse_api_root(base_url: str, what: str = "base_url", bare_path: str = _DEFAULT_ROOT) -> ApiRoot:
    """``base_url`` checked and split; ``what`` names the setting in errors. A bare host is its ``/v1`` (or
    ``bare_path``: "" for an address that stands for the whole origin, as a key's bound address does)."""
    text = base_url.strip().rstrip("/")
    example = "e.g. http://127.0.0.1:8000 or https://host/v1"
    if not re.match(r"https?://", text, re.IGNORECASE):
        raise EnhancerError(f"{what} must start with http:// or https://, got {text!r}")
    if any(char.isspace() or not char.isprintable() for char in text):
        raise _invalid(what, text, "a space or control character")
    try:
        parts = urlsplit(text)
    except ValueError as error:  # brackets of an IPv6 address that do not close
        raise _invalid(what, text, str(error)) from None
    if "?" in text or "#" in text:
        raise EnhancerError(f"{what} must not carry a query or fragment ('?…' or '#…'): it is an API root, the "
                            f"server's address and an optional path prefix only, {example}")
    if "@" in parts.netloc:
        raise EnhancerError(f"{what} must not carry a user name or password ('…@'): workflows are saved and shared; "
                            "give a key through api_key_env instead")
    host, port = _host_and_port(parts, text, what)
    return ApiRoot(parts.scheme.lower(), host, port, _root_path(parts.path, what) or bare_path)


def _invalid(what: str, text: str, reason: str) -> EnhancerError:
    return EnhancerError(f"{what} {text!r} is not a valid URL ({reason}): write the server's host and a port from 1 "
                         "to 65535, e.g. http://127.0.0.1:8000")


def _host_and_port(parts, text: str, what: str) -> tuple[str, int]:
    def invalid(reason: str) -> EnhancerError:
        return _invalid(what, text, reason)

    try:
        port = parts.port
    except ValueError as error:
        raise invalid(str(error)) from None
    host = parts.hostname or ""
    if not host:
        raise invalid("no host")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise invalid(f"{host!r} is not an IPv6 address") from None
    elif not _HOST.fullmatch(host):
        raise invalid(f"{host!r} is not a host name")
    if port == 0:
        raise invalid("port 0")
    if is_link_local(host):
        raise EnhancerError(link_local_refusal(f"{what}'s host is", host))
    return host.lower(), port or _DEFAULT_PORTS[parts.scheme.lower()]


def _root_path(path: str, what: str) -> str:
    segments = [segment for segment in path.split("/") if segment]
    if any(not _PATH_SEGMENT.fullmatch(s) or s in (".", "..") for s in segments) or "//" in path:
        raise EnhancerError(f"{what}'s path {path!r} is not an API prefix: only letters, digits and . _ ~ - between "
                            "slashes, such as /v1 or /llm/lmapi/v3")
    root = "/" + "/".join(segments) if segments else ""
    for endpoint in _ENDPOINTS:
        if root.endswith(endpoint):
            raise EnhancerError(f"{what} ends with {endpoint}: give the API root, the part before it "
                                f"({root.removesuffix(endpoint) or '/v1'})")
    return root


def is_link_local(address: str) -> bool:
    """Whether ``address`` (an IP address; a name is not one) is link-local: 169.254.0.0/16 or fe80::/10, also
    IPv4-mapped. Cloud metadata services answer there (169.254.169.254 hands out the machine's credentials)."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False
    mapped = getattr(parsed, "ipv4_mapped", None)
    return (mapped or parsed).is_link_local


def link_local_refusal(lead: str, address: str) -> str:
    """The words for a link-local address; ``lead`` says how it came ("base_url's host is", "pe.lan resolves to")."""
    return (f"{lead} the link-local address {address} (169.254.0.0/16, fe80::/10), where cloud metadata services "
            "answer and never a prompt enhancer: nothing is sent there; give the enhancer server's address")
