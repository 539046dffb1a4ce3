"""Regional compile of the pack's MODEL on the CPU (inductor with the machine's C++ compiler), in this process.

Kept small: every test samples at batch 1 (CFG 1), so one compiled block graph serves the whole module.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch._inductor.config
from torch._dynamo.utils import counters

from comfyui_ernie_image.nodes.accel.cache_presets import CacheSettings
from comfyui_ernie_image.nodes.accel.compile import compile_problem, compiles_by_default, fp8_cast_problem
from comfyui_ernie_image.nodes.accel.patching import (
    COMPILE_KEY,
    SAMPLER_SAMPLE,
    CacheJob,
    apply_cache,
    apply_compile,
    compile_by_default,
)
from comfyui_ernie_image.nodes.errors import ErnieImageError
from helpers.accel import module_state, sample, text, tiny_patcher

TURBO = dict(cfg=1.0, steps=4)


@pytest.fixture(scope="module")
def plain(tiny_models):
    torch._dynamo.reset()
    return tiny_patcher(tiny_models["snapshot"])


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_compiled_blocks_match_eager_and_new_prompts_do_not_recompile(plain):
    before = module_state(plain)
    compiled = apply_compile(plain, "default")
    first = dict(prompt=text(7, 1), size=(8, 8))
    graphs_before = graphs()
    assert torch.allclose(sample(compiled, **first, **TURBO), sample(plain, **first, **TURBO), atol=1e-4)
    assert module_state(plain) == before, "the compiled blocks stayed installed after the run"
    compiled_graphs = graphs()
    assert len(plain.model.diffusion_model.layers) > 1
    assert compiled_graphs - graphs_before == 1, "each block compiled its own graph"

    other = dict(prompt=text(12, 2), size=(6, 10))  # another text length and image size: another sequence length
    assert torch.allclose(sample(compiled, **other, **TURBO), sample(plain, **other, **TURBO), atol=1e-4)
    assert graphs() == compiled_graphs, "a new prompt length recompiled the blocks"
    assert module_state(plain) == before


@pytest.mark.parametrize("order", ["compile-then-cache", "cache-then-compile"])
def test_compile_works_before_or_after_the_cache_node(plain, order):
    job = CacheJob(CacheSettings(steps_mask="medium", steps_mask_cache="static"), "test", None)
    cached_only = sample(apply_cache(plain, job), **TURBO)
    if order == "compile-then-cache":
        both = apply_cache(apply_compile(plain, "default"), job)
    else:
        both = apply_compile(apply_cache(plain, job), "default")
    assert torch.allclose(sample(both, **TURBO), cached_only, atol=1e-4)
    assert not torch.allclose(cached_only, sample(plain, **TURBO), atol=1e-3), "nothing was cached"


def test_a_missing_cpu_compiler_is_named(plain, monkeypatch):
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("ernie-test-no-such-compiler",))
    with pytest.raises(ErnieImageError, match="torch.compile cannot run on the CPU here: it needs a C\\+\\+ compiler "
                                              "and none was found"):
        apply_compile(plain, "default")


def test_missing_triton_is_named(monkeypatch):
    import torch.utils._triton

    monkeypatch.setattr(torch.utils._triton, "has_triton_package", lambda: False)
    problem = compile_problem(torch.device("cuda"))
    assert "torch.compile needs Triton on CUDA GPUs and it is not installed (on Windows: pip install " \
           "triton-windows)" in problem
    assert compile_problem(torch.device("cpu")) is None


def test_missing_c_compiler_for_triton_is_named_and_the_default_stays_eager(monkeypatch):
    import torch.utils._triton

    from comfyui_ernie_image.nodes.accel import compile as compile_module

    monkeypatch.setattr(torch.utils._triton, "has_triton_package", lambda: True)
    monkeypatch.setattr(compile_module.sys, "platform", "linux")
    monkeypatch.setattr(compile_module.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert "torch.compile needs a C compiler for Triton and none was found" in compile_problem(torch.device("cuda"))
    assert not compiles_by_default(torch.device("cuda", 0), capability=(9, 0))
    monkeypatch.setenv("CC", "cc")
    assert compile_problem(torch.device("cuda")) is None


def test_default_compile_rule(monkeypatch):
    import torch.utils._triton

    cuda = torch.device("cuda", 0)
    assert not compiles_by_default(torch.device("cpu"))  # the CPU stays eager, compiler or not
    monkeypatch.setattr(torch.utils._triton, "has_triton_package", lambda: True)
    assert compiles_by_default(cuda, capability=(8, 0)) and compiles_by_default(cuda, capability=(9, 0))
    assert compiles_by_default(cuda, capability=(12, 0))
    assert not compiles_by_default(cuda, capability=(7, 5))  # Turing: no bf16 tensor cores
    monkeypatch.setattr(torch.utils._triton, "has_triton_package", lambda: False)
    assert not compiles_by_default(cuda, capability=(9, 0))  # no Triton: eager, no error


def test_the_loaders_model_is_eager_on_the_cpu(plain):
    assert compile_by_default(plain.clone()).model_options.get("transformer_options", {}).get(COMPILE_KEY) is None


def test_off_mode_undoes_compilation(plain, monkeypatch):
    compiled = apply_compile(plain, "default")
    off = apply_compile(compiled, "off")
    assert off.model_options["transformer_options"].get(COMPILE_KEY) is None
    assert not off.get_wrappers(SAMPLER_SAMPLE, COMPILE_KEY)
    assert compiled.model_options["transformer_options"][COMPILE_KEY] == "default", "the input was changed"
    # off needs no compiler at all
    monkeypatch.setattr(torch._inductor.config.cpp, "cxx", ("ernie-test-no-such-compiler",))
    unique = graphs()
    prompt = dict(prompt=text(5, 3), size=(8, 8))
    assert torch.equal(sample(off, **prompt, **TURBO), sample(plain, **prompt, **TURBO))
    assert graphs() == unique


def test_past_the_recompile_limit_the_blocks_run_eager_and_the_log_says_so_once(plain, monkeypatch, caplog):
    """A limit of 1 stands in for a process that met more variants than RECOMPILE_LIMIT: batch 1 compiles, batched
    CFG (another batch size, a text mask) runs eager, still correct, and one line says so. dynamo's process-wide
    settings are as they were after the runs."""
    import logging

    from comfyui_ernie_image.nodes.accel import compile as regional

    torch._dynamo.reset()
    regional._say_eager_fallback.cache_clear()
    monkeypatch.setattr(regional, "RECOMPILE_LIMIT", 1)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    compiled = apply_compile(plain, "default")
    settings = (torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit)
    with caplog.at_level(logging.WARNING, logger=regional.__name__):
        sample(compiled, **TURBO)
        for _ in range(2):
            assert torch.allclose(sample(compiled, steps=2, cfg=4.0), sample(plain, steps=2, cfg=4.0), atol=1e-4)
    assert [r.getMessage() for r in caplog.records] == [
        "ERNIE-Image: the DiT's blocks were compiled for 1 variants (models, dtypes, batch sizes, text masks) in this "
        "process, dynamo's limit: others run eager, slower. Restart ComfyUI to compile afresh."]
    assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.fail_on_recompile_limit_hit) == settings
    torch._dynamo.reset()


def test_a_lora_under_cache_and_compile_is_correct_and_a_new_strength_does_not_recompile(plain):
    """LoRA patches replace the weights when ComfyUI loads the model; the compiled blocks take weights as inputs,
    so another strength reuses the graph."""
    from comfyui_ernie_image.nodes.lora.patching import apply_lora
    from helpers.lora import LAYERS, deltas, lora_file

    lora = lora_file("peft", deltas(LAYERS, seed=1))
    job = CacheJob(CacheSettings(steps_mask="medium", steps_mask_cache="static"), "test", None)
    plain_result, graph_counts = sample(plain, **TURBO), []
    for strength in (1.0, 0.5):
        patched, _ = apply_lora(plain, lora, strength, "style")
        eager = sample(apply_cache(patched, job), **TURBO)
        fast = sample(apply_compile(apply_cache(patched, job), "default"), **TURBO)
        assert torch.allclose(fast, eager, atol=1e-4)
        assert not torch.allclose(eager, plain_result, atol=1e-2)  # the LoRA is in the result
        graph_counts.append(graphs())
    assert graph_counts[1] == graph_counts[0], "a new LoRA strength recompiled the blocks"
    assert torch.equal(sample(plain, **TURBO), plain_result)  # no patch left in the shared module


@pytest.mark.parametrize("storage", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_stored_blocks_compile_only_where_triton_converts_fp8(tiny_models, storage):
    """RTX 30 and A100 (sm80/86): Triton cannot build a compiled fp8 -> bf16 cast, so blocks stored in fp8 stay
    eager there, with the reason; sm89+ compiles them; bf16 blocks compile everywhere from sm80."""
    from comfyui_ernie_image.nodes.dit.build import load_dit

    cuda = torch.device("cuda", 0)  # the capability is given: nothing runs on it
    fp8 = load_dit(tiny_models["snapshot"], torch.bfloat16, storage).layers
    bf16 = load_dit(tiny_models["snapshot"], torch.bfloat16).layers
    for capability in ((8, 0), (8, 6)):
        problem = fp8_cast_problem(fp8, cuda, capability)
        assert problem is not None and f"sm{capability[0]}{capability[1]}" in problem and "eager" in problem
        assert fp8_cast_problem(bf16, cuda, capability) is None
    assert fp8_cast_problem(fp8, cuda, (8, 9)) is None and fp8_cast_problem(fp8, cuda, (12, 0)) is None
    assert fp8_cast_problem(fp8, torch.device("cpu")) is None  # the limit is Triton's (CUDA), not the CPU backend's
