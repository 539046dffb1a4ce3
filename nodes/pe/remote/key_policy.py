"""Which API key a workflow may use, and where it may go.

Workflows travel inside every PNG the pack saves and users open strangers' workflows, so a workflow must not be able
to send a secret of the user's environment to a host of its author's choosing. Two rules, both decided outside the
workflow:

1. ``api_key_env`` may name only a variable made for this node: ``ERNIE_PE_API_KEY`` or ``ERNIE_PE_API_KEY_<NAME>``
   (capitals, digits, ``_``). ``AWS_SECRET_ACCESS_KEY``, ``OPENAI_API_KEY``, ``HF_TOKEN`` are refused.
2. The key is bound to the server the user set it for: ``<variable>_URL`` holds that server's address, and the key
   is sent only when ``base_url`` has the same origin (scheme, host, port) and, when that address has a path, an API
   root at that path or under it (a key bound to ``https://gateway/team-a`` does not go to ``/team-b/v1`` of the same
   gateway). Without ``<variable>_URL`` the key is not sent.

What a refusal says is the same whether the variable is unset, has no ``_URL`` or is bound to another server, and it
never names the bound server: a stranger's workflow must not learn from an error what the user's environment holds.
Two more things follow: only a server named in the environment (an address in an ``ERNIE_PE_API_KEY…_URL``
variable, with or without its key) may put its own words into an error (``trusted_server``), and the key's identity
(a short hash, never the key) is part of the result cache's key (``credential_id``), so that a workflow without the
key cannot read texts a keyed run paid for.

The yardsticks: OpenAI's client takes ``OPENAI_API_KEY`` and ``OPENAI_BASE_URL`` both from the environment; ComfyUI's
own API nodes send the user's comfy.org key only to ``--comfy-api-base``, a command-line setting. Plain Python.
"""

from __future__ import annotations

import hashlib
import os
import re

from ..protocol import EnhancerError
from .url import ApiRoot, parse_api_root

PREFIX = "ERNIE_PE_API_KEY"
URL_SUFFIX = "_URL"
_PERMITTED = re.compile(rf"{PREFIX}(?:_[A-Z0-9]+)*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RULE = (f"api_key_env may name only {PREFIX} or {PREFIX}_<NAME> (capitals, digits and _), and the key is sent only "
         f"to the server whose address is in the variable of the same name ending in {URL_SUFFIX}")


def check_key_name(name: str) -> str:
    """``api_key_env`` checked against rule 1 (when the handle is made, before any request); "" for no key."""
    name = name.strip()
    if not name:
        return ""
    if not _ENV_NAME.fullmatch(name):
        raise EnhancerError(
            "api_key_env takes the NAME of an environment variable that holds the key (letters, digits and _), "
            "not the key itself: remove the key from the workflow and set it in the environment"
        )
    if not _PERMITTED.fullmatch(name) or name.endswith(URL_SUFFIX):
        # The value goes into ComfyUI's error and history: named only when it reads as a variable name, not a key.
        shown = name if re.fullmatch(r"[A-Z][A-Z0-9_]{0,63}", name) else "this value"
        raise EnhancerError(
            f"api_key_env {shown} is refused: {_RULE}. Workflows are shared, and any other variable could hold "
            f"another service's secret. Fix: set {PREFIX}_<NAME>=<your key> and {PREFIX}_<NAME>{URL_SUFFIX}=<your "
            f"server's address> in the environment ComfyUI starts from, and write {PREFIX}_<NAME> in api_key_env"
        )
    return name


def _not_sent(name: str) -> EnhancerError:
    """The one refusal for a key that is unset, unbound or bound elsewhere: it names only what the workflow gave."""
    return EnhancerError(
        f"the key in {name} (api_key_env) was not sent: {_RULE} (under that address's path, when it has one); both "
        f"must be set in the environment ComfyUI starts from, outside the workflow, so that a shared workflow cannot "
        f"send your key elsewhere. Fix: set {name} to the key and {name}{URL_SUFFIX} to the address of the server it "
        "belongs to, there, and use that server's base_url; or clear api_key_env when the server needs no key"
    )


def bound_key(name: str, root: ApiRoot) -> str | None:
    """The key to send to ``root``, read from the environment now (never stored); None when ``name`` is empty.
    Raises, and nothing is sent, when the key is missing or bound to another server (rule 2), with the same words
    for both (``_not_sent``); only a malformed ``<name>_URL`` of a set key is named as such."""
    if not name:
        return None
    key = os.environ.get(name)
    bound_to = os.environ.get(name + URL_SUFFIX, "").strip()
    if not key or not bound_to:
        raise _not_sent(name)
    # A bare address stands for its whole origin; an address with a path, for that path and what lies under it.
    allowed = parse_api_root(bound_to, what=name + URL_SUFFIX, bare_path="")
    if not allowed.covers(root):
        raise _not_sent(name)
    return key


def credential_id(name: str) -> str:
    """What tells one credential from another in the result cache: the first 12 hex digits of sha256 over the
    variable's name and the key, read now ("" without a key). Never the key; two keys give two ids."""
    key = os.environ.get(name) if name else None
    return hashlib.sha256(f"{name}\0{key}".encode()).hexdigest()[:12] if key else ""


def trusted_server(root: ApiRoot) -> bool:
    """Whether the server at ``root`` may put its own words (error messages, headers) into an error text: one the
    user named in the environment, by its address in an ``ERNIE_PE_API_KEY…_URL`` variable (with the key beside it,
    or alone for a server that needs none), read now. Any other host, this machine's included, is one a workflow
    chose (maybe a service on the user's network or on another port of this machine, whose answers must not be read
    back into ComfyUI): of its answers only the status is told."""
    for name, value in os.environ.items():
        if name.endswith(URL_SUFFIX) and _PERMITTED.fullmatch(name.removesuffix(URL_SUFFIX)):
            try:
                if parse_api_root(value, what=name, bare_path="").covers(root):
                    return True
            except EnhancerError:
                continue  # a malformed address names no server (a key bound by it is refused in words)
    return False
