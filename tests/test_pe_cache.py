"""The result cache: hits skip the PE and cost milliseconds, every input that changes the text changes the key, the
file survives restarts, stays bounded, and a corrupt file is set aside and rebuilt."""

from __future__ import annotations

import dataclasses
import logging
import sqlite3
import time

import pytest

from comfyui_ernie_image.nodes.pe import cache as cache_module
from comfyui_ernie_image.nodes.pe.cache import ResultCache, cache_key, enhance_cached
from comfyui_ernie_image.nodes.pe.local import LocalPromptEnhancer
from comfyui_ernie_image.nodes.pe.protocol import Completion, EnhancerError, PromptSpec, SamplingParams
from comfyui_ernie_image.nodes.pe.runtime import Runtime

PARAMS = SamplingParams(temperature=0.6, top_p=0.8, max_new_tokens=16, seed=1)


class Recording:
    """A real backend, recording which prompts reached it."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    @property
    def identity(self) -> str:
        return self.backend.identity

    def enhance(self, specs, params, on_result=None):
        self.calls.append([s.prompt for s in specs])
        return self.backend.enhance(specs, params, on_result)


@pytest.fixture(scope="module")
def local_pe(tiny_models):
    return LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], runtime=Runtime())


def test_a_hit_skips_the_pe_and_takes_milliseconds(local_pe, tmp_path):
    pe, cache = Recording(local_pe), ResultCache(tmp_path / "pe.sqlite3")
    specs = [PromptSpec("a cat"), PromptSpec("a dog"), PromptSpec("a cat")]
    first = enhance_cached(pe, specs, PARAMS, cache)
    assert pe.calls == [["a cat", "a dog"]]  # each distinct prompt once
    assert first[0] == first[2]
    started = time.perf_counter()
    assert enhance_cached(pe, specs, PARAMS, cache) == first
    assert time.perf_counter() - started < 0.05
    assert pe.calls == [["a cat", "a dog"]]

    restarted = Recording(local_pe)  # a new process: the same file
    assert enhance_cached(restarted, specs, PARAMS, ResultCache(tmp_path / "pe.sqlite3")) == first
    assert restarted.calls == []


def test_a_cut_text_warns_each_time_it_is_returned_a_hit_too(local_pe, tmp_path, caplog):
    pe, cache = Recording(local_pe), ResultCache(tmp_path / "pe.sqlite3")
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            (completion,) = enhance_cached(pe, [PromptSpec("a cat")], SamplingParams(max_new_tokens=3), cache)
        assert completion.truncated
        assert "the enhanced prompt was cut at max_new_tokens=3; raise it for the full text" in caplog.text
    assert pe.calls == [["a cat"]]  # the second time was a hit


@pytest.mark.parametrize(
    "change",
    [
        {"spec": PromptSpec("a cat ")},
        {"spec": PromptSpec("a cat", width=1264)},
        {"spec": PromptSpec("a cat", height=848)},
        {"params": dataclasses.replace(PARAMS, temperature=0.7)},
        {"params": dataclasses.replace(PARAMS, top_p=0.9)},
        {"params": dataclasses.replace(PARAMS, max_new_tokens=17)},
        {"params": dataclasses.replace(PARAMS, seed=2)},
        {"identity": "remote:http://other|pe"},
    ],
)
def test_everything_the_text_depends_on_is_in_the_key(change):
    base = {"identity": "local:pe", "spec": PromptSpec("a cat"), "params": PARAMS}
    assert cache_key(**{**base, **change}) != cache_key(**base)
    assert cache_key(**base) == cache_key("local:pe", PromptSpec("a cat"), dataclasses.replace(PARAMS))


def test_a_corrupt_file_is_set_aside_and_rebuilt(tmp_path, caplog):
    path = tmp_path / "pe.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    cache = ResultCache(path)
    with caplog.at_level(logging.WARNING):
        assert cache.get("k") is None
    assert "pe.sqlite3 is unreadable" in caplog.text and "starting a new one" in caplog.text
    (aside,) = tmp_path.glob("pe.sqlite3.corrupt-*")
    assert aside.read_bytes().startswith(b"this is not a database")
    cache.put("k", Completion("kept"))
    assert ResultCache(path).get("k") == Completion("kept")


def test_a_file_with_another_table_layout_is_set_aside_and_rebuilt(tmp_path):
    """A sound SQLite file whose results table has other columns (another version of the cache, say)."""
    path = tmp_path / "pe.sqlite3"
    with sqlite3.connect(path) as other:
        other.execute("CREATE TABLE results (key TEXT PRIMARY KEY, text TEXT)")
    cache = ResultCache(path)
    cache.put("k", Completion("kept"))
    assert list(tmp_path.glob("pe.sqlite3.corrupt-*"))
    assert ResultCache(path).get("k") == Completion("kept")


def test_corruption_while_open_is_survived(tmp_path):
    path = tmp_path / "pe.sqlite3"
    cache = ResultCache(path, memory_entries=1)
    cache.put("a", Completion("A"))
    path.write_bytes(b"\x00garbage" * 1000)
    cache.put("b", Completion("B"))  # evicts "a" from memory; the file is now garbage
    assert cache.get("a") is None
    assert list(tmp_path.glob("pe.sqlite3.corrupt-*"))
    cache.put("c", Completion("C", truncated=True))
    assert ResultCache(path).get("c") == Completion("C", truncated=True)


def test_a_file_locked_by_another_process_is_kept_not_set_aside(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(cache_module, "_BUSY_TIMEOUT_S", 0.1)  # the real 5 s wait for the lock, shortened
    path = tmp_path / "pe.sqlite3"
    ResultCache(path).put("earlier", Completion("an earlier result"))
    other = sqlite3.connect(path)  # another ComfyUI sharing the user directory, in the middle of a write
    other.execute("BEGIN IMMEDIATE")
    cache = ResultCache(path)
    with caplog.at_level(logging.WARNING):
        cache.put("a", Completion("A"))
        cache.put("b", Completion("B"))
    other.rollback()
    other.close()
    assert cache.get("a") == Completion("A")  # from memory
    assert not list(tmp_path.glob("pe.sqlite3.corrupt-*"))
    assert ResultCache(path).get("earlier") == Completion("an earlier result")
    assert [r.getMessage() for r in caplog.records if "is in use or not writable" in r.getMessage()] == [
        f"ERNIE-Image PE cache: {path} is in use or not writable (database is locked); results it cannot take stay "
        "in memory (said once)"]
    cache.put("c", Completion("C"))  # the lock is gone: the file takes results again
    assert ResultCache(path).get("c") == Completion("C")


def test_an_unusable_location_caches_in_memory(tmp_path, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("x")
    cache = ResultCache(blocker / "pe.sqlite3")
    with caplog.at_level(logging.WARNING):
        cache.put("k", Completion("in memory"))
    assert cache.get("k") == Completion("in memory")
    assert "caching in memory only" in caplog.text


def test_the_cache_is_bounded(tmp_path):
    path = tmp_path / "pe.sqlite3"
    cache = ResultCache(path, max_entries=5, memory_entries=2)
    for i in range(8):
        cache.put(f"k{i}", Completion(f"text {i}"))
        time.sleep(0.002)
    with sqlite3.connect(path) as db:
        keys = {row[0] for row in db.execute("SELECT key FROM results")}
    assert keys == {f"k{i}" for i in range(3, 8)}  # the least recently used went
    assert len(cache._memory) == 2


def test_an_empty_text_is_an_error_not_a_cached_result(tmp_path):
    class Silent:
        identity = "silent"

        def enhance(self, specs, params, on_result):
            completions = [Completion("") for _ in specs]
            for index, completion in enumerate(completions):
                on_result(index, completion)
            return completions

    cache = ResultCache(tmp_path / "pe.sqlite3")
    with pytest.raises(EnhancerError, match="the prompt enhancer returned no text for 'a cat'"):
        enhance_cached(Silent(), [PromptSpec("a cat")], PARAMS, cache)
    assert cache.get(cache_key("silent", PromptSpec("a cat"), PARAMS)) is None
