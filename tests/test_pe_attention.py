"""The PE fast path's grouped decode attention (``nodes/pe/local/attention.py``) against transformers' ``sdpa``, on a
tiny Ministral 3 with grouped-query attention (4 query heads share 2 KV heads, as the PE's 32 share 8): the same logits
for a left-padded batch on a static cache, in float32 and bfloat16; the same tokens from the fast path, eager or
compiled; and the model's own attention left as it was for plain ``generate``."""

from __future__ import annotations

import copy
import logging
import re

import pytest
import torch
from transformers import Ministral3Config, Ministral3ForCausalLM, StaticCache

from comfyui_ernie_image.nodes.pe.local import attention, decode
from comfyui_ernie_image.nodes.pe.protocol import SamplingParams
from helpers.prompts import left_padded

LAYERS, CACHE_SLOTS, DECODE_STEPS = 2, 32, 8
PROMPT_LENGTHS = (5, 9, 12)  # left-padded to 12: two rows start with padding


@pytest.fixture(scope="module")
def gqa_model() -> Ministral3ForCausalLM:
    """Random weights with a wide init, so attention is peaked: a mask or head mix-up changes the logits."""
    torch.manual_seed(0)
    config = Ministral3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.3,
        tie_word_embeddings=False,
    )
    model = Ministral3ForCausalLM(config).eval()
    assert model.config._attn_implementation == "sdpa"
    return model


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded(1, PROMPT_LENGTHS, vocab=256)


FORCED = torch.randint(3, 256, (DECODE_STEPS, len(PROMPT_LENGTHS)), generator=torch.Generator().manual_seed(2))


def static_cache_logits(model, implementation: str, input_ids: torch.Tensor, mask: torch.Tensor,
                        forced: torch.Tensor = FORCED) -> torch.Tensor:
    """Logits ``[1 + steps, B, V]`` of a prefill and the decode steps of ``forced`` tokens ``[steps, B]``, laid out
    as ``StaticDecoder`` does: one mask over all cache slots, positions counted from each row's first real token."""
    rows, width = input_ids.shape
    cache_mask = torch.ones(rows, CACHE_SLOTS, dtype=mask.dtype)
    cache_mask[:, :width] = mask
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = StaticCache(config=model.config, max_cache_len=CACHE_SLOTS)
    cache_arg = decode.StaticDecoder(model, "eager")._cache_arg
    logits = []
    with torch.inference_mode(), attention.using(model, implementation):
        out = model(input_ids=input_ids, attention_mask=cache_mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1, **{cache_arg: cache})
        logits.append(out.logits[:, -1].float())
        position = positions[:, -1:] + 1
        for token in forced:
            out = model(input_ids=token[:, None], attention_mask=cache_mask, position_ids=position, use_cache=True,
                        **{cache_arg: cache})
            logits.append(out.logits[:, -1].float())
            position = position + 1
    return torch.stack(logits)


@pytest.fixture
def grouped_calls(monkeypatch) -> list[tuple[int, ...]]:
    """The query shapes the grouped decode attention ran on (proof that the decode steps took it)."""
    calls, original = [], attention.grouped_query_attention

    def spy(query, *args):
        calls.append(tuple(query.shape))
        return original(query, *args)

    monkeypatch.setattr(attention, "grouped_query_attention", spy)
    return calls


def test_grouped_decode_gives_sdpas_logits_on_a_padded_static_cache_in_float32(gqa_model, grouped_calls):
    attention.register()
    input_ids, mask = padded_batch()
    reference = static_cache_logits(gqa_model, "sdpa", input_ids, mask)
    assert grouped_calls == []
    grouped = static_cache_logits(gqa_model, attention.NAME, input_ids, mask)
    assert grouped_calls == [(3, 4, 1, 16)] * (DECODE_STEPS * LAYERS)  # every decode step of every layer, no prefill
    assert torch.equal(grouped[0], reference[0])  # the prompt goes through sdpa itself
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-4)
    assert reference[1:].abs().max() > 5  # peaked attention: a wrong mask or head order would show
    # Padding is masked: each padded row gives the logits it gives alone.
    for row, length in enumerate(PROMPT_LENGTHS[:2]):
        alone = static_cache_logits(gqa_model, attention.NAME, input_ids[row:row + 1, -length:],
                                    mask[row:row + 1, -length:], FORCED[:, row:row + 1])
        torch.testing.assert_close(alone[:, 0], grouped[:, row], rtol=1e-5, atol=1e-4)
    assert gqa_model.config._attn_implementation == "sdpa"  # switched back after each block


def test_grouped_decode_is_as_close_to_float32_as_sdpa_in_bfloat16(gqa_model, grouped_calls):
    """bf16 has no bitwise reference: both attentions are compared with the float32 model. The grouped scores are
    rounded to bf16 by the matmul (as transformers' eager attention does), SDPA keeps them in fp32; the logits
    stay within the error bf16 itself makes."""
    attention.register()
    input_ids, mask = padded_batch()
    exact = static_cache_logits(gqa_model, "sdpa", input_ids, mask)
    half = copy.deepcopy(gqa_model).to(torch.bfloat16)
    sdpa = static_cache_logits(half, "sdpa", input_ids, mask)
    grouped = static_cache_logits(half, attention.NAME, input_ids, mask)
    assert len(grouped_calls) == DECODE_STEPS * LAYERS
    sdpa_error, grouped_error = (sdpa - exact).abs().max(), (grouped - exact).abs().max()
    assert grouped_error <= 2 * sdpa_error, (grouped_error, sdpa_error)
    assert (grouped - sdpa).abs().max() <= 0.05 * exact.abs().max()


def test_grouped_attention_reads_each_kv_head_for_its_own_query_heads():
    """Direct check of the head mapping and both mask forms against an explicit repeat of K/V."""
    generator = torch.Generator().manual_seed(3)
    shapes = [(2, 6, 1, 8), (2, 3, 10, 8), (2, 3, 10, 8)]  # 6 query heads read 3 KV heads
    query, key, value = (torch.randn(shape, generator=generator) for shape in shapes)
    keep = torch.rand(2, 1, 1, 10, generator=generator) > 0.3
    keep[..., 0] = True
    repeated_key, repeated_value = key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(query, repeated_key, repeated_value, attn_mask=keep)
    expected = expected.transpose(1, 2)
    for mask in (keep, torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)):
        got = attention.grouped_query_attention(query, key, value, mask, 8**-0.5)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(attention.grouped_query_attention(query, key, value, keep.expand(2, 6, 1, 10), 8**-0.5),
                               expected, rtol=1e-5, atol=1e-5)  # a per-head mask


def fast_path_tokens(model, params: SamplingParams, **options) -> torch.Tensor:
    input_ids, mask = padded_batch()
    return decode.StaticDecoder(model, **options).generate(
        decode.DecodeRequest(input_ids, mask, params, [2], 0, lambda: False, lambda done: None), ignore_eos=True)


SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=20, seed=4)


def test_the_fast_path_gives_the_same_tokens_with_either_attention(gqa_model, grouped_calls):
    before = fast_path_tokens(gqa_model, SAMPLED, step="eager", attention="sdpa")
    assert grouped_calls == []
    after = fast_path_tokens(gqa_model, SAMPLED, step="eager")
    assert len(grouped_calls) == (SAMPLED.max_new_tokens - 1) * LAYERS
    assert torch.equal(after, before) and len(set(after[0].tolist())) > 5
    assert gqa_model.config._attn_implementation == "sdpa"  # plain generate keeps the model's own attention


def test_the_compiled_grouped_step_matches_eager_sdpa(gqa_model, caplog):
    """On the CPU (inductor, no CUDA graphs): the compiled step with the grouped attention traces whole and gives
    the tokens of the eager step with sdpa. The log says how long the first step of the shape waited for the
    compiler, and a second request of the same shape compiles nothing and says nothing."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    def compile_lines(options: dict) -> tuple[torch.Tensor, list[str]]:
        with caplog.at_level(logging.INFO):
            caplog.clear()
            tokens = fast_path_tokens(gqa_model, SAMPLED, **options)
        return tokens, [m for m in caplog.messages if m.startswith("ERNIE-Image PE: compiled the decode step")]

    torch._dynamo.reset()  # an earlier test's graph of this shape would be reused
    counters.clear()
    compiled, said = compile_lines({"step": "compiled"})
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
    assert len(said) == 1 and re.fullmatch(r"ERNIE-Image PE: compiled the decode step for 4 row\(s\) and 256 "
                                           r"cache slots in \d+\.\d s", said[0]), said
    assert torch.equal(compiled, fast_path_tokens(gqa_model, SAMPLED, step="eager", attention="sdpa"))
    again, said = compile_lines({"step": "compiled"})
    assert said == [] and torch.equal(again, compiled)


def test_cache_lengths_waste_under_a_quarter_in_few_sizes():
    assert [decode._cache_length(n) for n in (1, 256, 257, 384, 1152, 2048, 2049, 2198, 4096, 4097)] == [
        256, 256, 512, 512, 1280, 2048, 2560, 2560, 4096, 5120]
    assert all(n <= decode._cache_length(n) < n + 256 for n in range(1, 1025))
    assert all(n <= decode._cache_length(n) < 1.25 * n for n in range(1025, 9000))
    assert len({decode._cache_length(n) for n in range(1, 4097)}) == 12  # 256…2048 by 256, 2560…4096 by 512
    assert decode.StaticDecoder.shape(3, 128, 1024) == (4, 1280)


def test_a_buckets_mask_is_refilled_in_place_for_each_request(gqa_model):
    """A bucket keeps one mask tensor (a CUDA graph reads it where it was captured): a later request with other
    padding in the same bucket refills it whole, and gives the tokens a fresh decoder gives."""
    input_ids, mask = padded_batch()
    shorter_ids, shorter_mask = input_ids[:, 8:].clone(), mask[:, 8:].clone()  # 4 wide, unpadded: the first ran
    assert shorter_mask.all() and not mask[0, 4:7].any()  # with row 0 padded past the shorter prompt's width

    def generate(decoder, ids, attention_mask):
        return decoder.generate(decode.DecodeRequest(ids, attention_mask, SAMPLED, [2], 0, lambda: False,
                                                     lambda done: None), ignore_eos=True)

    reused = decode.StaticDecoder(gqa_model, "eager")
    generate(reused, input_ids, mask)
    bucket = next(iter(reused._buckets.values()))
    held = bucket.mask
    again = generate(reused, shorter_ids, shorter_mask)
    assert next(iter(reused._buckets.values())).mask is held and len(reused._buckets) == 1
    assert torch.equal(again, generate(decode.StaticDecoder(gqa_model, "eager"), shorter_ids, shorter_mask))
    assert held.all()  # nothing of the first request's padding is left


def test_a_decoder_keeps_the_two_most_recent_shapes_and_a_third_drops_the_oldest(gqa_model):
    """ComfyUI does not see a bucket's KV cache: a decoder keeps two shapes (two PE settings in one workflow), a third
    frees the least recently used one before its own cache is made, and a shape it kept is reused as it was."""
    input_ids, mask = padded_batch()
    decoder = decode.StaticDecoder(gqa_model, "eager")

    def generate(rows: int, new_tokens: int) -> tuple[int, int]:
        params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=new_tokens, seed=3)
        decoder.generate(decode.DecodeRequest(input_ids[:rows], mask[:rows], params, [2], 0, lambda: False,
                                              lambda done: None), ignore_eos=True)
        return decoder.shape(rows, input_ids.shape[1], new_tokens)

    first, second = generate(3, 4), generate(1, 4)
    kept = decoder._buckets[first]
    assert generate(3, 4) == first and decoder._buckets[first] is kept  # reused: now the most recent
    third = generate(3, 300)  # a longer cache
    assert list(decoder._buckets) == [first, third]  # the second, least recently used, was dropped
    assert second not in decoder._buckets and decoder._buckets[first] is kept
