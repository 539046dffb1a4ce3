"""JSON from strangers is parsed only within ``MAX_DEPTH`` levels (``bounded_json``): deeper JSON is refused before
Python's parser recurses into it, so neither the parser nor a finalizer the garbage collector runs meanwhile reaches
the recursion limit (an unraisable RecursionError in the remote PE's test of a 100,000-deep answer, CI 2026-12-06)."""

from __future__ import annotations

import inspect
import json
import sys

import pytest

from comfyui_ernie_image.nodes import bounded_json
from comfyui_ernie_image.nodes.bounded_json import MAX_DEPTH, NestedTooDeeply


@pytest.mark.parametrize("text, expected", [
    ("3", 0),
    ('"[[{"', 0),  # brackets inside a string
    (r'["\"[[", {"a\\": [1]}]', 3),  # an escaped quote, then an escaped backslash before a closing quote
    ('{"choices": [{"message": {"content": "[x]"}}]}', 4),
])
def test_the_depth_counts_arrays_and_objects_outside_strings(text, expected):
    assert bounded_json.depth(text) == expected
    assert bounded_json.depth(text.encode()) == expected


def test_json_as_deep_as_the_bound_parses_as_json_does_and_one_level_more_is_refused():
    deepest = "[" * MAX_DEPTH + '"]"' + "]" * MAX_DEPTH
    assert bounded_json.loads(deepest) == json.loads(deepest)
    with pytest.raises(NestedTooDeeply, match="JSON nested too deeply"):
        bounded_json.loads(b"[" + deepest.encode() + b"]")


def test_a_deep_nesting_is_refused_without_recursing():
    """100,000 nested arrays (200 KB) are refused with a recursion limit that leaves the parser only a few hundred
    frames: nothing recurses per level."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 200)
    try:
        with pytest.raises(NestedTooDeeply):
            bounded_json.loads("[" * 100_000 + "]" * 100_000)
        assert bounded_json.loads('{"a": [[1]]}') == {"a": [[1]]}
    finally:
        sys.setrecursionlimit(limit)


def test_what_is_not_json_is_still_a_value_error():
    for text in ("]]]", '"[[[', "{", b"\xff"):
        with pytest.raises(ValueError):
            bounded_json.loads(text)
