"""Cache-DiT on the pack's MODEL, sampled by ComfyUI's own sampler in this process (tiny DiT: 10 blocks).

Latents are compared directly (float32, CPU): "equal" means bit-identical.
"""

from __future__ import annotations

import logging
import re

import cache_dit
import comfy.model_management
import comfy.samplers
import pytest
import torch

from comfyui_ernie_image.nodes.accel.cache import CacheRun, step_index, stored_streams
from comfyui_ernie_image.nodes.accel.cache_presets import BASE_STEPS, PRESETS, TURBO_STEPS, CacheSettings, resolve
from comfyui_ernie_image.nodes.accel.patching import CacheJob, apply_cache
from comfyui_ernie_image.nodes.dit.schedule import reference_sigmas
from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.host.model import dit_blocks
from helpers.accel import CallCounter, held_bytes, module_state, sample, text, tiny_patcher

STATIC_MEDIUM = CacheSettings(steps_mask="medium", steps_mask_cache="static")  # 8 steps: mask 11110101
FN = STATIC_MEDIUM.Fn_compute_blocks  # index of the first block that a cached step skips


@pytest.fixture(scope="module")
def plain(tiny_models):
    return tiny_patcher(tiny_models["snapshot"])


def cached(model, settings: CacheSettings, label: str = "test"):
    return apply_cache(model, CacheJob(settings, label, None))


def keep_cfg_apart(monkeypatch) -> None:
    """ComfyUI runs cond and uncond as separate model calls (what it does when memory is short)."""
    monkeypatch.setattr(comfy.samplers, "can_concat_cond", lambda a, b: a is b)


def summaries(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "Cache-DiT [" in r.getMessage()]


@pytest.mark.parametrize("cfg", [4.0, 1.0])
def test_threshold_zero_gives_the_uncached_latent_exactly(plain, cfg):
    expected = sample(plain, cfg=cfg)
    assert torch.equal(sample(cached(plain, CacheSettings(residual_diff_threshold=0.0, max_warmup_steps=0)), cfg=cfg),
                       expected)


@pytest.mark.parametrize("cfg, batched", [(1.0, True), (4.0, True), (4.0, False)], ids=["cfg1", "cfg4", "cfg4-apart"])
def test_a_static_steps_mask_computes_exactly_the_masked_steps(plain, cfg, batched, monkeypatch, caplog):
    if not batched:
        keep_cfg_apart(monkeypatch)
    calls_per_step = 2 if cfg > 1 and not batched else 1
    counter = CallCounter(plain, [0, FN - 1, FN, 9])
    caplog.set_level(logging.INFO)
    try:
        sample(cached(plain, STATIC_MEDIUM), cfg=cfg)
    finally:
        counter.close()
    computed = [1, 1, 1, 1, 0, 1, 0, 1].count(1)
    assert counter.calls == {0: 8 * calls_per_step, FN - 1: 8 * calls_per_step,
                             FN: computed * calls_per_step, 9: computed * calls_per_step}
    calls = {(1.0, True): ["cond"], (4.0, True): ["cond+uncond"], (4.0, False): ["cond", "uncond"]}[(cfg, batched)]
    (line,) = summaries(caplog)
    assert line == "ERNIE-Image Cache-DiT [test] 8 steps, F8B0 R0.08 W8 mask medium/static: " + "; ".join(
        f"{call}: 6 computed, 2 cached (steps 4,6)" for call in calls)


def test_cond_and_uncond_keep_their_own_caches(plain, monkeypatch):
    """Batched or apart, with TaylorSeer: the same steps cached from each pass's own residuals, the same result."""
    settings = CacheSettings(steps_mask="fast", steps_mask_cache="static", taylorseer_order=1)
    batched = sample(cached(plain, settings))
    keep_cfg_apart(monkeypatch)
    apart = sample(cached(plain, settings))
    assert torch.allclose(batched, apart, atol=1e-5, rtol=0)
    assert not torch.allclose(apart, sample(plain), atol=1e-3, rtol=0), "nothing was cached"


def test_a_real_threshold_caches_steps_and_stays_close(plain, caplog):
    """Tolerance: the cached latent differs from the uncached one by under 2 % of what the model changed."""
    caplog.set_level(logging.INFO)
    settings = CacheSettings(Fn_compute_blocks=4, residual_diff_threshold=0.5, max_warmup_steps=2, taylorseer_order=1)
    uncached = sample(plain, steps=20)
    result = sample(cached(plain, settings), steps=20)
    (line,) = summaries(caplog)
    computed, cached_steps = map(int, re.search(r"cond\+uncond: (\d+) computed, (\d+) cached", line).groups())
    assert computed + cached_steps == 20 and cached_steps >= 3 and computed >= 3, line
    assert "residual diff mean" in line
    start = torch.randn(uncached.shape, generator=torch.manual_seed(1))  # sample()'s noise
    drift = float((result - uncached).norm() / (uncached - start).norm())
    assert 0 < drift < 0.02


@pytest.mark.parametrize("order, bn", [(0, 0), (1, 0), (1, 2), (2, 3)])
def test_the_memory_estimate_counts_what_cache_dit_keeps(plain, order, bn, monkeypatch):
    """ComfyUI loads the cached MODEL for a memory estimate that includes, on top of the DiT's own, exactly the
    stores that cache-dit then holds (the most any step held, CFG batched: one context of batch 2); afterwards the
    DiT's estimate is its own again."""
    requested, held = [], []
    load = comfy.model_management.load_models_gpu
    activate = CacheRun.activate

    def load_spy(models, memory_required=0, **kwargs):
        requested.append(memory_required)
        return load(models, memory_required=memory_required, **kwargs)

    def activate_spy(run, call, step):
        held.append(held_bytes(run._contexts))
        return activate(run, call, step)

    monkeypatch.setattr(comfy.model_management, "load_models_gpu", load_spy)
    monkeypatch.setattr(CacheRun, "activate", activate_spy)
    settings = CacheSettings(Fn_compute_blocks=4, Bn_compute_blocks=bn, residual_diff_threshold=0.5,
                             max_warmup_steps=2, taylorseer_order=order)
    sample(plain, steps=20)
    sample(cached(plain, settings), steps=20)
    width, tokens = 64, 8 * 8 + 7  # the tiny DiT's stream: 8x8 latent patches and the longer (7-token) prompt
    stores = stored_streams(settings) * 2 * tokens * width * 4  # float32
    assert requested[1] - requested[0] == stores
    assert max(held) == stores
    assert "memory_required" not in vars(plain.model)


def test_runs_leave_no_trace_after_success_error_and_interrupt(plain):
    before = module_state(plain)
    model = cached(plain, STATIC_MEDIUM)
    sample(model)
    assert module_state(plain) == before

    def fail_at_step_3(step, *args):
        if step == 3:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        sample(model, callback=fail_at_step_3)
    assert module_state(plain) == before

    def interrupt_at_step_3(step, *args):
        if step == 3:
            comfy.model_management.interrupt_current_processing(True)

    with pytest.raises(comfy.model_management.InterruptProcessingException):
        sample(model, callback=interrupt_at_step_3)
    assert module_state(plain) == before
    assert torch.equal(sample(model), sample(cached(plain, STATIC_MEDIUM))), "the interrupted run left a stale cache"


def test_a_second_run_is_a_fresh_run(plain):
    """Run A, then B with another prompt, size, step count and CFG through the same cached MODEL: B is what a
    fresh cached MODEL gives."""
    settings = CacheSettings(steps_mask="medium", steps_mask_cache="static", taylorseer_order=1)
    model = cached(plain, settings)
    sample(model, steps=10, cfg=4.0, prompt=text(9, 1), size=(8, 8))
    b = dict(steps=8, cfg=1.0, prompt=text(4, 2), size=(6, 10), seed=3)
    assert torch.equal(sample(model, **b), sample(cached(plain, settings), **b))


def test_a_later_cache_node_in_a_chain_replaces_an_earlier_one(plain):
    first = cached(plain, CacheSettings(steps_mask="ultra", steps_mask_cache="static"))
    assert torch.equal(sample(cached(first, STATIC_MEDIUM)), sample(cached(plain, STATIC_MEDIUM)))


def test_step_index_follows_the_sigmas_not_the_calls():
    sigmas = reference_sigmas(8)
    assert [step_index(sigmas, float(s)) for s in sigmas[:-1]] == list(range(8))
    assert step_index(sigmas, float(sigmas[2] + sigmas[3]) / 2) == 2  # a second-order sampler's extra call
    assert step_index(sigmas, 2.0) == 0


def test_a_step_count_without_a_mask_computes_every_step(plain, caplog):
    caplog.set_level(logging.INFO)
    sample(cached(plain, STATIC_MEDIUM), steps=5)
    (line,) = summaries(caplog)
    assert "no 'medium' steps mask for 5 steps (cache-dit has them for 4, 6, 8+)" in line
    assert "5 computed, 0 cached" in line


def test_presets_say_what_their_masks_do():
    for name, preset in PRESETS.items():
        policy = preset.settings.steps_mask
        for steps, documented in ((BASE_STEPS, preset.base_cached), (TURBO_STEPS, preset.turbo_cached)):
            assert cache_dit.steps_mask(total_steps=steps, mask_policy=policy).count(0) == documented, name
    assert PRESETS["ultra"].ceiling(BASE_STEPS, PRESETS["ultra"].base_cached) > 3.0
    assert resolve("custom", Fn_compute_blocks=3, steps_mask="slow") == CacheSettings(Fn_compute_blocks=3,
                                                                                     steps_mask="slow")


def test_custom_fields_map_one_to_one_onto_cache_dit(plain):
    settings = CacheSettings(Fn_compute_blocks=3, Bn_compute_blocks=2, residual_diff_threshold=0.3,
                             max_warmup_steps=5, max_cached_steps=7, max_continuous_cached_steps=2,
                             taylorseer_order=2, steps_mask="fast", steps_mask_cache="static")
    holder, name = dit_blocks(plain)
    cache_config, calibrator = CacheRun(holder, name, settings, steps=8).configs()
    for field in ("Fn_compute_blocks", "Bn_compute_blocks", "residual_diff_threshold", "max_warmup_steps",
                  "max_cached_steps", "max_continuous_cached_steps"):
        assert getattr(cache_config, field) == getattr(settings, field), field
    assert cache_config.steps_computation_mask == cache_dit.steps_mask(total_steps=8, mask_policy="fast")
    assert cache_config.steps_computation_policy == "static"
    assert calibrator.taylorseer_order == 2


def test_errors_name_the_problem(plain):
    with pytest.raises(ErnieImageError, match=r"Fn_compute_blocks \+ Bn_compute_blocks \(8 \+ 2\) must be fewer "
                                              r"than the model's 10 blocks"):
        cached(plain, CacheSettings(Bn_compute_blocks=2))

    class NotErnie:
        model = torch.nn.Module()

    with pytest.raises(ErnieImageError, match="is not an ERNIE-Image DiT: its diffusion model has no 'layers'"):
        apply_cache(NotErnie(), CacheJob(CacheSettings(), "x", None))


def test_a_second_order_sampler_is_masked_by_sigma(plain):
    """Heun calls the model twice per step (at sigma i, then at sigma i+1): the mask follows the sigmas."""
    counter = CallCounter(plain, [0, FN])
    try:
        result = sample(cached(plain, CacheSettings(steps_mask="medium", steps_mask_cache="static",
                                                    taylorseer_order=1)), cfg=1.0, sampler="heun")
    finally:
        counter.close()
    # calls per step index: 1 (step 0), then 2 each (steps 1-7); steps 4 and 6 are cached
    assert counter.calls == {0: 15, FN: 15 - 2 - 2}
    assert torch.isfinite(result).all()
