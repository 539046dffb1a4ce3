"""The local PE on a tiny real Ministral 3 model, in every layout users keep it: lazy loading, batch, seeds, the
fast decode path, interrupt, ComfyUI model management, and errors that say what to do."""

from __future__ import annotations

import logging
import re
import time

import comfy.model_management as mm
import comfy.utils
import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.host.memory import text_model_dtype
from comfyui_ernie_image.nodes.host.patchers import ManagedModule, WholeModelPatcher
from comfyui_ernie_image.nodes.pe.comfy_runtime import ComfyRuntime
from comfyui_ernie_image.nodes.pe.local.decode import PlainDecoder, StaticDecoder
from comfyui_ernie_image.nodes.pe.local.enhancer import LocalPromptEnhancer
from comfyui_ernie_image.nodes.pe.protocol import EnhancerError, PromptSpec, SamplingParams
from comfyui_ernie_image.nodes.pe.runtime import Runtime
from helpers.files import snapshot_with_truncated_file

PROMPTS = [
    PromptSpec("a cat", 1024, 1024),
    PromptSpec('a "red" dog\\ on a mat\nunder the 天空 🐶', 848, 1264),
    PromptSpec("一只黑白相间的中华田园犬", 1264, 848),
]
SAMPLED = SamplingParams(temperature=0.6, top_p=0.8, max_new_tokens=24, seed=5)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
WORDS = re.compile(r"[a-z]+( [a-z]+)*")  # the tiny PE writes lowercase words


@pytest.fixture(scope="module")
def snapshot_pe(tiny_models) -> LocalPromptEnhancer:
    return LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], runtime=Runtime())


def texts(enhancer, specs, params) -> list[str]:
    return [c.text for c in enhancer.enhance(specs, params)]


def test_the_snapshot_handle_is_lazy_and_absent_without_pe(tiny_models, tmp_path):
    handle = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"])
    assert handle is not None and not handle.loaded
    assert handle.identity.startswith("local:") and not handle.loaded  # the cache key needs no weights
    (tmp_path / "model_index.json").write_text("{}")
    assert LocalPromptEnhancer.from_snapshot(tmp_path) is None


def test_all_layouts_write_words_and_the_folders_agree(tiny_models, snapshot_pe):
    folder = LocalPromptEnhancer.from_path(tiny_models["pe_folder"], runtime=Runtime())
    single = LocalPromptEnhancer.from_path(tiny_models["pe_single_file"], runtime=Runtime())
    from_snapshot = texts(snapshot_pe, PROMPTS, GREEDY)
    assert all(WORDS.fullmatch(t) for t in from_snapshot), from_snapshot
    assert texts(folder, PROMPTS, GREEDY) == from_snapshot  # same weights, same tokenizer and template
    single_texts = texts(single, PROMPTS, GREEDY)
    assert all(WORDS.fullmatch(t) for t in single_texts), single_texts


def test_the_single_file_holds_the_snapshot_weights_and_uses_baidus_template(tiny_models, snapshot_pe):
    single = LocalPromptEnhancer.from_path(tiny_models["pe_single_file"], runtime=Runtime())
    single.enhance(PROMPTS[:1], GREEDY)
    snapshot_pe.enhance(PROMPTS[:1], GREEDY)
    reference = snapshot_pe._model.state_dict()
    assert all(torch.equal(value, reference[key]) for key, value in single._model.state_dict().items())
    rendered = single._tokenizer.apply_chat_template(PROMPTS[1].messages(), tokenize=False)
    assert rendered.startswith("<s>[SYSTEM_PROMPT]你是一个专业的文生图 Prompt 增强助手")
    assert rendered.endswith("[INST]" + PROMPTS[1].messages()[0]["content"] + "[/INST]")


def test_a_batch_gives_each_prompt_its_own_text_and_seeds_repeat(snapshot_pe):
    batch = texts(snapshot_pe, PROMPTS, SAMPLED)
    assert batch == [texts(snapshot_pe, [spec], SAMPLED)[0] for spec in PROMPTS]
    assert texts(snapshot_pe, PROMPTS, SAMPLED) == batch
    others = [texts(snapshot_pe, PROMPTS, SamplingParams(0.6, 0.8, 24, seed)) for seed in (6, 7, 8)]
    assert any(other != batch for other in others)
    assert len(set(batch)) == len(batch)  # prompt-dependent


def test_the_static_cache_path_gives_the_same_tokens_as_generate(tiny_models):
    plain = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], decode="generate", runtime=Runtime())
    fast = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], decode="static", runtime=Runtime())
    for params in (SAMPLED, GREEDY, SamplingParams(1.0, 1.0, 40, 11)):
        assert fast.enhance(PROMPTS, params) == plain.enhance(PROMPTS, params)


def test_the_compiled_decode_step_traces_whole_and_matches_eager(tiny_models):
    """On the CPU (inductor without CUDA graphs): the compiled step gives the eager tokens, traces without a graph
    break, and new sampling values or seeds reuse it."""
    from torch._dynamo.utils import counters

    compiled = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], decode="static-compiled", runtime=Runtime())
    eager = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], decode="static", runtime=Runtime())
    counters.clear()
    assert compiled.enhance(PROMPTS, SAMPLED) == eager.enhance(PROMPTS, SAMPLED)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1 and not counters["graph_break"]
    other = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=24, seed=9)
    assert compiled.enhance(PROMPTS, other) == eager.enhance(PROMPTS, other)
    assert counters["stats"]["unique_graphs"] == graphs
    # A run in another shape bucket (one prompt, a longer cache), then the first bucket again: each its own graph.
    longer = SamplingParams(temperature=0.6, top_p=0.8, max_new_tokens=300, seed=4)
    assert compiled.enhance(PROMPTS[:1], longer) == eager.enhance(PROMPTS[:1], longer)
    assert compiled.enhance(PROMPTS, SAMPLED) == eager.enhance(PROMPTS, SAMPLED)


def test_the_compiled_decode_step_compiles_more_buckets_than_dynamos_default_limit(tiny_models):
    """dynamo compiles one function for at most 8 shapes by default, then runs it eager, silently: nine (batch, cache
    length) buckets here, one decode step each, must all compile."""
    from torch._dynamo.utils import counters

    pe = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], decode="static-compiled", runtime=Runtime())
    one_step = SamplingParams(temperature=0.0, max_new_tokens=2)
    counters.clear()
    buckets = set()
    for rows in (1, 2, 4):
        for words in (1, 100, 200):  # cache lengths 512, 768 and 1024 (Baidu's system prompt: 382 tokens here)
            specs = [PromptSpec("a cat " * words)] * rows
            pe.enhance(specs, one_step)
            buckets.add(StaticDecoder.shape(rows, max(map(len, pe._token_rows(specs))), one_step.max_new_tokens))
    assert len(buckets) == 9
    assert counters["frames"]["ok"] == counters["frames"]["total"]  # none fell back to eager
    assert torch._dynamo.config.recompile_limit == 8  # raised while decoding only, not for the other nodes


def test_truncation_is_reported_and_an_eos_ends_the_text(snapshot_pe):
    assert all(c.truncated for c in snapshot_pe.enhance(PROMPTS, SamplingParams(max_new_tokens=3)))
    finished = [c for seed in range(40) for c in snapshot_pe.enhance(PROMPTS, SamplingParams(1.0, 1.0, 48, seed))
                if not c.truncated]
    assert finished and all(c.text for c in finished)


def test_an_interrupt_raised_by_comfyui_progress_hook_keeps_the_fast_path(tiny_models, caplog):
    """ComfyUI's progress hook (main.py) raises the interrupt itself when the flag is up at a progress update: that
    is a Cancel, not a failure of the fast decoder, which must stay in use."""
    comfy.utils.set_progress_bar_global_hook(lambda *args, **kwargs: mm.throw_exception_if_processing_interrupted())
    pe = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], decode="static", runtime=ComfyRuntime())
    texts(pe, PROMPTS[:1], GREEDY)
    pe.decode = "auto"  # what "auto" is on CUDA with a compiler: the fast decoder, plain generate as its fallback
    mm.interrupt_current_processing(True)  # Cancel lands after the last stop check, before the progress update
    pe.runtime.should_stop = lambda: False
    try:
        with pytest.raises(mm.InterruptProcessingException), caplog.at_level(logging.WARNING):
            pe.enhance(PROMPTS[:1], GREEDY)
    finally:
        comfy.utils.set_progress_bar_global_hook(None)
        mm.interrupt_current_processing(False)
    assert isinstance(pe._decoder, StaticDecoder) and not caplog.records


def test_fault_injected_out_of_memory_is_raised_and_keeps_the_fast_path(tiny_models):
    """Out of GPU memory (a long batch on a small card; injected: the CPU cannot run out) is the user's to see and
    ComfyUI's to handle, not a reason to decode slowly from then on."""
    pe = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], decode="static", runtime=Runtime())
    first = texts(pe, PROMPTS[:1], GREEDY)
    pe.decode = "auto"  # what "auto" is on CUDA with a compiler: the fast decoder, plain generate as its fallback
    decoder = pe._decoder

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    pe._decoder.generate = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        pe.enhance(PROMPTS[:1], GREEDY)
    assert pe._decoder is decoder
    del decoder.generate  # the memory is back
    assert texts(pe, PROMPTS[:1], GREEDY) == first


class InterruptingRuntime(ComfyRuntime):
    """ComfyUI's runtime that presses ComfyUI's interrupt as soon as the progress bar moves (it counts prompts, and
    generation moves it by fractions as tokens come), and counts the stop checks after."""

    def __init__(self):
        super().__init__()
        self.checks_after_interrupt = 0

    def progress(self, total: int):
        def update(done: float) -> None:
            if 0 < done < total:
                mm.interrupt_current_processing(True)

        return update

    def should_stop(self) -> bool:
        stop = super().should_stop()
        self.checks_after_interrupt += stop
        return stop


@pytest.mark.parametrize("decode", ["generate", "static"])
def test_comfy_interrupt_stops_generation_at_the_next_token(tiny_models, decode):
    runtime = InterruptingRuntime()
    pe = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], decode=decode, runtime=runtime)
    started = time.monotonic()
    try:
        with pytest.raises(mm.InterruptProcessingException):
            pe.enhance(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=4000))
    finally:
        mm.interrupt_current_processing(False)
    assert time.monotonic() - started < 10
    assert runtime.checks_after_interrupt == 1  # the first check after the flag went up stopped it
    assert not mm.processing_interrupted()  # consumed: the next prompt runs
    runtime.progress = Runtime().progress
    assert texts(pe, PROMPTS[:1], GREEDY)


def _managed_pe_models(pe: LocalPromptEnhancer) -> list:
    return [m for m in mm.current_loaded_models
            if isinstance(m.model.model, ManagedModule) and m.model.model.module is pe._model]


def test_the_weights_are_a_comfyui_model_that_unload_all_frees(tiny_models):
    pe = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], runtime=ComfyRuntime())
    first = texts(pe, PROMPTS[:1], GREEDY)
    assert len(_managed_pe_models(pe)) == 1
    assert isinstance(_managed_pe_models(pe)[0].model, WholeModelPatcher)  # never loaded in part (--novram)
    mm.unload_all_models()  # what POST /free does
    assert _managed_pe_models(pe) == []
    assert texts(pe, PROMPTS[:1], GREEDY) == first  # loads again on demand
    assert len(_managed_pe_models(pe)) == 1


def test_the_kv_caches_stay_from_prompt_to_prompt_and_go_when_comfyui_unloads_the_pe(tiny_models):
    """Core detaches every model it is asked to load, loaded already or not, its weights left in place
    (``load_models_gpu``); only an unload that moves them (``/free``, or room for other models) drops the decoder's
    KV caches and, on CUDA, the CUDA graphs that read them. Before, every prompt dropped them: on the GPU each
    prompt captured its graph again (the GPU check's log, 2026-12-05)."""
    pe = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], runtime=ComfyRuntime(), decode="static")
    first = texts(pe, PROMPTS[:1], GREEDY)
    (bucket,) = pe._decoder._buckets.values()
    assert texts(pe, PROMPTS[:1], GREEDY) == first
    assert list(pe._decoder._buckets.values()) == [bucket]  # the same cache and mask, reset in place
    mm.unload_all_models()  # what POST /free does
    assert pe._decoder._buckets == {}
    assert texts(pe, PROMPTS[:1], GREEDY) == first


def test_a_truncated_pe_config_is_named(tiny_models, tmp_path):
    snapshot = snapshot_with_truncated_file(tiny_models["snapshot"], tmp_path, "pe/config.json", keep_bytes=20)
    with pytest.raises(ErnieImageError, match=r"pe/config\.json .*damaged or incomplete.*download it again"):
        LocalPromptEnhancer.from_snapshot(snapshot).enhance(PROMPTS[:1], GREEDY)


def test_layout_errors_say_what_is_wrong_and_what_to_do(tiny_models, tmp_path):
    with pytest.raises(EnhancerError, match="is not a prompt-enhancer folder: expected an ERNIE-Image snapshot"):
        LocalPromptEnhancer.from_path(tmp_path)
    (tmp_path / "pe.ckpt").write_bytes(b"x")
    with pytest.raises(EnhancerError, match=r"pe.ckpt: only .safetensors and .gguf prompt-enhancer files"):
        LocalPromptEnhancer.from_path(tmp_path / "pe.ckpt")

    no_tokenizer = tmp_path / "no-tokenizer.safetensors"
    state = load_file(tiny_models["pe_single_file"])
    save_file({k: v for k, v in state.items() if k != "tekken_model"}, no_tokenizer)
    with pytest.raises(EnhancerError, match="no-tokenizer.safetensors carries no tokenizer .*use the ERNIE-Image"):
        LocalPromptEnhancer.from_path(no_tokenizer).enhance(PROMPTS[:1], GREEDY)

    quantized = tmp_path / "fp8.safetensors"
    save_file({k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v for k, v in state.items()}, quantized)
    with pytest.raises(EnhancerError, match="fp8.safetensors holds quantized weights; load the bf16/fp16"):
        LocalPromptEnhancer.from_path(quantized).enhance(PROMPTS[:1], GREEDY)

    text_encoder = tiny_models["snapshot"] / "text_encoder"
    with pytest.raises(EnhancerError, match="holds a 'mistral3' model; the ERNIE-Image prompt enhancer is 'minis"):
        LocalPromptEnhancer.from_path(text_encoder).enhance(PROMPTS[:1], GREEDY)

    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        LocalPromptEnhancer.from_path(tiny_models["pe_folder"], dtype="int8")


def fail_the_model(pe, message: str):
    """Every forward of the PE's language model fails (injected: e.g. weights broken by a bad device move)."""

    def broken(*args, **kwargs):
        raise RuntimeError(message)

    pe._model.lm_head.forward = broken


def test_fault_injected_failure_of_the_model_keeps_the_fast_path(tiny_models, caplog):
    """A failure that plain generate meets too (here the model's own) is not the fast decoder's: raised as it is,
    and fast decoding stays on once the cause is gone."""
    pe = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], decode="static", runtime=Runtime())
    first = texts(pe, PROMPTS[:1], GREEDY)
    pe.decode = "auto"  # what "auto" is on CUDA with a compiler: the fast decoder, plain generate as its fallback
    decoder = pe._decoder
    fail_the_model(pe, "Inference tensors do not track version counter.")
    with pytest.raises(RuntimeError, match="Inference tensors"), caplog.at_level(logging.WARNING):
        pe.enhance(PROMPTS[:1], GREEDY)
    assert pe._decoder is decoder and not caplog.records
    del pe._model.lm_head.forward
    assert texts(pe, PROMPTS[:1], GREEDY) == first


def test_fault_injected_failure_of_the_fast_decoder_alone_falls_back_to_generate(tiny_models, caplog):
    pe = LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], decode="static", runtime=Runtime())
    first = texts(pe, PROMPTS[:1], GREEDY)
    pe.decode = "auto"

    def compiler_failure(*args):
        raise RuntimeError("inductor: failed to compile the decode step")

    pe._decoder.generate = compiler_failure
    with caplog.at_level(logging.WARNING):
        assert texts(pe, PROMPTS[:1], GREEDY) == first
    assert isinstance(pe._decoder, PlainDecoder)
    assert [r.getMessage() for r in caplog.records] == [
        "ERNIE-Image PE: fast decoding failed (inductor: failed to compile the decode step) where plain generate "
        "works; using plain generate from now on"]


def test_cuda_graphs_are_not_used_under_comfyuis_cudamallocasync_allocator(monkeypatch):
    """The compiled decode step's CUDA graphs fail at the first step under cudaMallocAsync (ComfyUI's default
    allocator; seen on the H200), which then dropped fast decoding for plain generate."""
    from comfyui_ernie_image.nodes.pe.local.decode import cuda_graphs_allowed

    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert not cuda_graphs_allowed(torch.device("cuda", 0)) and cuda_graphs_allowed(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    assert cuda_graphs_allowed(torch.device("cuda", 0))


@pytest.mark.parametrize("bf16", [True, False])
def test_auto_takes_the_text_encoders_dtype_on_every_gpu(tiny_models, monkeypatch, bf16):
    """One rule for both Ministral models (``host.memory.text_model_dtype``): bf16 where ComfyUI computes in it,
    float32 on GPUs before Ampere (where the PE once took fp16 and the text encoder float32), from ComfyUI's host and
    from plain torch alike. No weights are read: the dtype is settled from the device alone."""
    gpu = torch.device("cuda:0")
    monkeypatch.setattr(mm, "should_use_bf16", lambda device=None, *args, **kwargs: bf16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0) if bf16 else (7, 5))
    expected = torch.bfloat16 if bf16 else torch.float32
    assert text_model_dtype(gpu) == expected
    for runtime in (ComfyRuntime(), Runtime()):
        assert LocalPromptEnhancer.from_snapshot(tiny_models["snapshot"], runtime=runtime)._dtype(gpu) == expected
