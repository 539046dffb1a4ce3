"""The result cache: hits skip the PE and cost milliseconds, every input that changes the text changes the key, the
file survives restarts, stays bounded, and a corrupt file is set aside and rebuilt."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sqlite3
import time

import pytest
import torch

from comfyui_ernie_image.nodes.pe import cache as cache_module
from comfyui_ernie_image.nodes.pe.cache import ResultCache, cache_key, enhance_cached
from comfyui_ernie_image.nodes.pe.local import template as template_module
from comfyui_ernie_image.nodes.pe.local.decode import PlainDecoder
from comfyui_ernie_image.nodes.pe.local.enhancer import DECODE_MODES, LocalPromptEnhancer
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


# --- the cache input: use / refresh / off -----------------------------------------------------------------------


class Asked(Recording):
    """Also counts the reads of the backend's identity (a remote backend asks its server for it)."""

    def __init__(self, backend):
        super().__init__(backend)
        self.identity_reads = 0

    @property
    def identity(self) -> str:
        self.identity_reads += 1
        return self.backend.identity


def test_refresh_enhances_again_and_replaces_the_stored_text(local_pe, tmp_path):
    pe, cache = Asked(local_pe), ResultCache(tmp_path / "pe.sqlite3")
    key = cache_key(local_pe.identity, PromptSpec("a cat"), PARAMS)
    cache.put(key, Completion("a stale text"))
    assert enhance_cached(pe, [PromptSpec("a cat")], PARAMS, cache) == [Completion("a stale text")]
    fresh, again = enhance_cached(pe, [PromptSpec("a cat"), PromptSpec("a cat")], PARAMS, cache, "refresh")
    assert fresh.text != "a stale text" and again == fresh
    assert pe.calls == [["a cat"]]  # asked again, each distinct prompt once
    assert ResultCache(tmp_path / "pe.sqlite3").get(key) == fresh  # replaced in the file
    assert enhance_cached(pe, [PromptSpec("a cat")], PARAMS, cache) == [fresh]
    assert pe.calls == [["a cat"]]


def test_off_neither_reads_nor_stores_nor_asks_for_the_identity(local_pe, tmp_path):
    pe, cache = Asked(local_pe), ResultCache(tmp_path / "pe.sqlite3")
    stale = cache_key(local_pe.identity, PromptSpec("a cat"), PARAMS)
    cache.put(stale, Completion("a stale text"))
    texts = enhance_cached(pe, [PromptSpec("a cat"), PromptSpec("a dog"), PromptSpec("a cat")], PARAMS, cache, "off")
    assert texts[0].text != "a stale text" and texts[0] == texts[2]
    assert pe.calls == [["a cat", "a dog"]] and pe.identity_reads == 0
    assert cache.get(stale) == Completion("a stale text")  # untouched
    assert cache.get(cache_key(local_pe.identity, PromptSpec("a dog"), PARAMS)) is None  # not stored


def test_an_unknown_cache_mode_is_named(local_pe):
    with pytest.raises(ValueError, match=r"cache must be one of \('use', 'refresh', 'off'\), got 'clear'"):
        enhance_cached(local_pe, [PromptSpec("a cat")], PARAMS, ResultCache(None), "clear")


# --- the local identity: every field that changes the text changes the key ---------------------------------------


def local(folder, **options) -> LocalPromptEnhancer:
    return LocalPromptEnhancer.from_path(folder, runtime=Runtime(), **options)


def key_of(pe) -> str:
    return cache_key(pe.identity, PromptSpec("a cat"), PARAMS)


def test_the_local_identity_records_the_resolved_dtype(tiny_models):
    auto = local(tiny_models["pe_folder"], dtype="auto")
    assert "|dtype=float32|" in auto.identity  # what "auto" is on the CPU, not "auto"
    assert key_of(auto) == key_of(local(tiny_models["pe_folder"], dtype="float32"))
    assert key_of(auto) != key_of(local(tiny_models["pe_folder"], dtype="bfloat16"))


def test_the_local_identity_records_the_gpu_model_not_its_index(tiny_models, monkeypatch):
    names = {0: "NVIDIA H200", 1: "NVIDIA H200", 2: "NVIDIA A100-SXM4-80GB"}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: names[torch.device(device).index])

    def on(device: str) -> str:
        return key_of(local(tiny_models["pe_folder"], device=device, dtype="bfloat16", decode="generate"))

    assert on("cuda:0") == on("cuda:1")
    assert on("cuda:0") != on("cuda:2")
    assert on("cuda:0") != key_of(local(tiny_models["pe_folder"], device="cpu", dtype="bfloat16", decode="generate"))


def test_the_local_identity_records_the_decode_path_in_use(tiny_models):
    keys = {mode: key_of(local(tiny_models["pe_folder"], decode=mode)) for mode in DECODE_MODES}
    assert keys["auto"] == keys["generate"]  # what "auto" is on the CPU
    assert len({keys["generate"], keys["static"], keys["static-compiled"], keys["static-graphs"]}) == 4
    fell_back = local(tiny_models["pe_folder"], decode="static")
    fell_back.enhance([PromptSpec("a cat")], SamplingParams(max_new_tokens=2))
    assert key_of(fell_back) == keys["static"]  # loading changes nothing
    fell_back._decoder = PlainDecoder(fell_back._model)  # what a failed fast path leaves: plain generate from then on
    assert key_of(fell_back) == keys["generate"]


def test_the_local_identity_is_the_same_before_and_after_loading(local_pe, tiny_models):
    fresh = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], runtime=Runtime())
    before = fresh.identity
    fresh.enhance([PromptSpec("a cat")], SamplingParams(max_new_tokens=2))
    assert fresh.loaded and fresh.identity == before


def _same_size_and_time(path, edit) -> None:
    """Edit a file keeping its size and modification time: only its content tells the change."""
    stat = path.stat()
    path.write_text(edit(path.read_text(encoding="utf-8")), encoding="utf-8")
    assert path.stat().st_size == stat.st_size
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_the_local_identity_records_the_chat_template_rendered_not_a_folders_unknown_one(tiny_models, tmp_path):
    """A folder's template the pack does not know is never rendered (issue 41): Baidu's is, and so it is the key's
    template; the file's own change is still seen by its size and time (``source.identity``)."""
    folder = tmp_path / "pe"
    shutil.copytree(tiny_models["pe_folder"], folder)
    before = key_of(local(folder))
    _same_size_and_time(folder / "chat_template.jinja", lambda text: text.replace("[INST]", "[ISNT]", 1))
    assert key_of(local(folder)) == before


def test_the_local_identity_records_the_template_given_to_a_single_file(tiny_models, tmp_path, monkeypatch):
    """ComfyUI's repack carries no template: the pack's copy of Baidu's is used, and it is part of the key."""
    before = key_of(local(tiny_models["pe_single_file"]))
    other = tmp_path / "chat_template.jinja"
    other.write_text(template_module.BAIDU_CHAT_TEMPLATE.read_text(encoding="utf-8") + " ", encoding="utf-8")
    monkeypatch.setattr(template_module, "BAIDU_CHAT_TEMPLATE", other)
    assert key_of(local(tiny_models["pe_single_file"])) != before
