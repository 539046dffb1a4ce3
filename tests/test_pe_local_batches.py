"""A list of prompts on the local PE (issue 14): batches sized by the memory the host reports, with the peak measured;
the same texts as one by one; a progress bar that counts prompts; nothing lost to a failure, a Cancel or running out of
memory. On the tiny PE, on the CPU."""

from __future__ import annotations

import logging
import weakref

import comfy.model_management as mm
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from comfyui_ernie_image.nodes.pe.cache import ResultCache, enhance_cached
from comfyui_ernie_image.nodes.pe.comfy_runtime import ComfyRuntime
from comfyui_ernie_image.nodes.pe.local.batching import CPU_ROWS, MEMORY_SHARE, row_bytes
from comfyui_ernie_image.nodes.pe.local.enhancer import LocalPromptEnhancer
from comfyui_ernie_image.nodes.pe.protocol import GenerationStopped, PromptSpec, SamplingParams
from comfyui_ernie_image.nodes.pe.runtime import Runtime

PARAMS = SamplingParams(temperature=0.6, top_p=0.8, max_new_tokens=24, seed=5)
SPECS = [PromptSpec(f"prompt {i}: " + "a red cat " * (i % 7), 848 if i % 2 else 1024, 1024) for i in range(100)]


class Budget(Runtime):
    """Plain torch on the CPU that reports ``free`` bytes free, records its progress bars and can be told to stop."""

    def __init__(self, free: int | None):
        self.free, self.bars, self.stop_when = free, [], lambda: False

    def free_memory(self, device: torch.device) -> int | None:
        return self.free

    def progress(self, total: int):
        values: list[float] = []
        self.bars.append((total, values))
        return values.append

    def should_stop(self) -> bool:
        return self.stop_when()


class LiveTensorBytes(TorchDispatchMode):
    """The bytes of the tensors that torch ops create and that are still alive, and their peak: memory measured as
    torch allocates it (the CPU allocator keeps no statistics)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                pointer, size = storage.data_ptr(), storage.nbytes()
                if size and pointer not in self._sizes:  # a view of a counted tensor is not counted again
                    self._sizes[pointer] = size
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(tensor, self._free, pointer)
        return out

    def _free(self, pointer: int) -> None:
        self.live -= self._sizes.pop(pointer, 0)


@pytest.fixture(scope="module")
def one_by_one(tiny_models) -> list[str]:
    pe = LocalPromptEnhancer.from_path(tiny_models["pe_folder"], runtime=Runtime())
    return [pe.enhance([spec], PARAMS)[0].text for spec in SPECS]


def handle(tiny_models, runtime: Runtime, decode: str = "generate") -> LocalPromptEnhancer:
    pe = LocalPromptEnhancer.from_path(tiny_models["pe_folder"], decode=decode, runtime=runtime)
    pe.enhance(SPECS[:1], SamplingParams(max_new_tokens=1))  # the weights, loaded before anything is measured
    return pe


def free_for(pe: LocalPromptEnhancer, rows: int, specs=SPECS) -> int:
    """Free memory that holds ``rows`` prompts of ``specs`` by the PE's own estimate."""
    length = max(map(len, pe._token_rows(specs)))
    return int(rows * row_bytes(pe._model.config, length, PARAMS.max_new_tokens, pe._model.dtype) / MEMORY_SHARE) + 1


def record_batches(pe: LocalPromptEnhancer, fail=None) -> list[int]:
    """The size of each batch generated; ``fail(size, call)`` may raise instead."""
    sizes, generate = [], pe._generate

    def recorded(request):
        if fail is not None:
            fail(request.input_ids.shape[0], len(sizes))
        sizes.append(request.input_ids.shape[0])
        return generate(request)

    pe._generate = recorded
    return sizes


def test_100_prompts_run_in_batches_that_fit_the_free_memory_with_the_same_texts(tiny_models, one_by_one):
    runtime = Budget(free=None)
    pe = handle(tiny_models, runtime)
    runtime.free = free_for(pe, rows=4)
    sizes = record_batches(pe)
    with LiveTensorBytes() as chunked:
        texts = [c.text for c in pe.enhance(SPECS, PARAMS)]
    assert texts == one_by_one
    assert sizes == [4] * 25
    assert chunked.peak <= runtime.free  # what was planned holds what was used

    with LiveTensorBytes() as whole:  # the same list as one batch, as before
        bar = Runtime().progress(len(SPECS))
        assert [c.text for c in pe._enhance_batch(pe._token_rows(SPECS), PARAMS, len(SPECS), bar, 0)] == one_by_one
    assert chunked.peak * 10 < whole.peak, (chunked.peak, whole.peak)


def test_the_progress_bar_counts_prompts_across_batches(tiny_models):
    runtime = Budget(free=None)
    pe = handle(tiny_models, runtime)
    runtime.free, runtime.bars = free_for(pe, rows=4, specs=SPECS[:10]), []
    pe.enhance(SPECS[:10], PARAMS)
    ((total, values),) = runtime.bars  # one bar for the whole list
    assert total == 10 and values == sorted(values) and values[-1] == 10
    assert {4, 7} <= set(values)  # the batches of 4, 3 and 3 end there
    assert len(set(values)) > 10  # and it moves within each batch, as tokens come


def test_without_a_memory_figure_the_cpu_takes_a_fixed_number_per_batch(tiny_models):
    pe = handle(tiny_models, Budget(free=None))
    sizes = record_batches(pe)
    pe.enhance(SPECS[:40], SamplingParams(max_new_tokens=2))
    assert sizes == [14, 13, 13] and max(sizes) <= CPU_ROWS


def test_the_fast_path_runs_every_batch_of_a_list_in_one_cache_bucket(tiny_models, one_by_one):
    runtime = Budget(free=None)
    pe = handle(tiny_models, runtime, decode="static")
    runtime.free = free_for(pe, rows=4, specs=SPECS[:10])
    sizes = record_batches(pe)
    assert [c.text for c in pe.enhance(SPECS[:10], PARAMS)] == one_by_one[:10]
    assert sizes == [4, 4, 4]  # 4, 3 and 3 prompts, padded: one static cache and one compiled shape, not two
    assert {rows for rows, _ in pe._decoder._buckets} == {1, 4}  # 1: the warm-up


def test_texts_finished_before_a_cancel_are_cached(tiny_models, one_by_one, tmp_path):
    runtime = Budget(free=None)
    pe = handle(tiny_models, runtime)
    runtime.free = free_for(pe, rows=4)
    cache = ResultCache(tmp_path / "pe.sqlite3")
    runtime.stop_when = lambda: len(cache._memory) >= 8  # the user cancels as the second batch ends
    with pytest.raises(GenerationStopped, match="stopped between two batches"):
        enhance_cached(pe, SPECS, PARAMS, cache)
    runtime.stop_when = lambda: False
    sizes = record_batches(pe)
    assert [c.text for c in enhance_cached(pe, SPECS, PARAMS, cache)] == one_by_one
    assert sum(sizes) == 92  # the first eight came from the cache


def test_texts_finished_before_a_failure_are_cached(tiny_models, one_by_one, tmp_path):
    runtime = Budget(free=None)
    pe = handle(tiny_models, runtime)
    runtime.free = free_for(pe, rows=4)
    cache = ResultCache(tmp_path / "pe.sqlite3")

    def third_fails(size: int, call: int) -> None:
        if call == 2:
            raise RuntimeError("a failure in the third batch")

    record_batches(pe, fail=third_fails)
    with pytest.raises(RuntimeError, match="a failure in the third batch"):
        enhance_cached(pe, SPECS, PARAMS, cache)
    assert len(cache._memory) == 8
    del pe._generate  # the failure is gone
    sizes = record_batches(pe)
    assert [c.text for c in enhance_cached(pe, SPECS, PARAMS, cache)] == one_by_one
    assert sum(sizes) == 92


@pytest.mark.parametrize(("decode", "batches"), [("generate", [4, 3, 3]), ("static", [4, 4, 4])])
def test_fault_injected_out_of_memory_halves_the_batch_and_loses_no_text(tiny_models, one_by_one, caplog, decode,
                                                                         batches):
    """The estimate missed something (injected: the CPU does not run out): the batch halves, the list goes on; on
    the fast path the smaller batches are padded to one bucket too."""
    runtime = Budget(free=None)
    pe = handle(tiny_models, runtime, decode)
    runtime.free = free_for(pe, rows=16, specs=SPECS[:10])  # all ten fit, by the estimate

    def too_big(size: int, call: int) -> None:
        if size > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    sizes = record_batches(pe, fail=too_big)
    with caplog.at_level(logging.WARNING):
        assert [c.text for c in pe.enhance(SPECS[:10], PARAMS)] == one_by_one[:10]
    assert sizes == batches
    assert [r.getMessage() for r in caplog.records if "ERNIE-Image PE" in r.getMessage()] == [
        "ERNIE-Image PE: out of memory with 10 prompts in a batch; going on with 8",
        "ERNIE-Image PE: out of memory with 8 prompts in a batch; going on with 4"]


def test_comfyui_reports_its_free_memory_less_its_reserve(monkeypatch):
    """ComfyUI's own figure (the driver's free memory plus torch's cached blocks), less --reserve-vram."""
    runtime, device = ComfyRuntime(), torch.device("cpu")
    assert runtime.free_memory(device) > 0  # the real figure: the CPU's available memory here
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: 10 * 2**30)
    monkeypatch.setattr(mm, "extra_reserved_memory", lambda: 2**30)
    assert runtime.free_memory(device) == 9 * 2**30
    monkeypatch.setattr(mm, "extra_reserved_memory", lambda: 11 * 2**30)
    assert runtime.free_memory(device) == 0
    assert Runtime().free_memory(device) is None  # plain torch knows no CPU figure: a fixed number per batch
