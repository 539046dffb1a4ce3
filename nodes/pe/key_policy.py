"""Which API key a workflow may use, and where it may go.

Workflows travel inside every PNG the pack saves and users open strangers' workflows, so a workflow must not be able
to send a secret of the user's environment to a host of its author's choosing. Two rules, both decided outside the
workflow:

1. ``api_key_env`` may name only a variable made for this node: ``ERNIE_PE_API_KEY`` or ``ERNIE_PE_API_KEY_<NAME>``
   (capitals, digits, ``_``). ``AWS_SECRET_ACCESS_KEY``, ``OPENAI_API_KEY``, ``HF_TOKEN`` are refused.
2. The key is bound to the server the user set it for: ``<variable>_URL`` holds that server's address, and the key
   is sent only when ``base_url`` has the same origin (scheme, host, port). Without ``<variable>_URL`` the key is not
   sent.

The yardsticks: OpenAI's client takes ``OPENAI_API_KEY`` and ``OPENAI_BASE_URL`` both from the environment; ComfyUI's
own API nodes send the user's comfy.org key only to ``--comfy-api-base``, a command-line setting. Plain Python.
"""

from __future__ import annotations

import os
import re

from .protocol import EnhancerError
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


def bound_key(name: str, root: ApiRoot) -> str | None:
    """The key to send to ``root``, read from the environment now (never stored); None when ``name`` is empty.
    Raises, and nothing is sent, when the key is missing or bound to another server (rule 2)."""
    if not name:
        return None
    key = os.environ.get(name)
    if not key:
        raise EnhancerError(f"the environment variable {name} (api_key_env) is not set: set it to the server's API "
                            "key in the environment ComfyUI starts from")
    bound_to = os.environ.get(name + URL_SUFFIX, "").strip()
    if not bound_to:
        raise EnhancerError(
            f"{name} is set but {name}{URL_SUFFIX} is not, so the key was not sent: {_RULE} (set outside the "
            f"workflow, so that a shared workflow cannot send your key elsewhere). Fix: set {name}{URL_SUFFIX} to the "
            "address of the server this key belongs to, in the environment ComfyUI starts from"
        )
    allowed = parse_api_root(bound_to, what=name + URL_SUFFIX).origin
    if allowed != root.origin:
        raise EnhancerError(
            f"the key in {name} is bound to {allowed} ({name}{URL_SUFFIX}) but base_url is {root.origin}, so the key "
            f"was not sent: {_RULE}. Fix: use that server's base_url, or give this server its own "
            f"{PREFIX}_<NAME> and {PREFIX}_<NAME>{URL_SUFFIX}"
        )
    return key
