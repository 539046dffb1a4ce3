"""JSON from a stranger (a server's answer, a model file's header or config, a file another process can write),
parsed only when it nests no deeper than the pack's JSON ever does (engine).

Python's parser recurses once per nested array or object, so a few hundred kilobytes of brackets reach the
recursion limit inside it: a RecursionError, and on the way down any finalizer that the garbage collector happens
to run at that depth fails too (an unraisable RecursionError, reported by whatever code owned the object). So the
depth is counted first, in one pass over the brackets outside strings, and deeper JSON is refused before the parser
sees it.
"""

from __future__ import annotations

import json
import re
from itertools import accumulate

MAX_DEPTH = 64  # the pack's JSON nests a few levels (an OpenAI answer, a header, a quantization configuration)
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)  # a string, escaped quotes and brackets in it
_NOT_BRACKETS = re.compile(rb"[^\[\]{}]+")
_OPENING = frozenset(b"[{")


class NestedTooDeeply(ValueError):
    """JSON nested deeper than ``MAX_DEPTH``."""


def depth(text: str | bytes) -> int:
    """How deep ``text``'s arrays and objects nest (0 for a scalar), brackets inside strings not counted."""
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    brackets = _NOT_BRACKETS.sub(b"", _STRINGS.sub(b"", data))
    return max(accumulate(1 if byte in _OPENING else -1 for byte in brackets), default=0)


def loads(text: str | bytes) -> object:
    """``json.loads(text)``; ``NestedTooDeeply`` past ``MAX_DEPTH`` levels, ``ValueError`` for anything not JSON."""
    if depth(text) > MAX_DEPTH:
        raise NestedTooDeeply("JSON nested too deeply")
    return json.loads(text)
