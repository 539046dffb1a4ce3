"""The prompt → message path and the sampler: any prompt arrives intact; the nucleus is transformers' nucleus."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import TopPLogitsWarper

from comfyui_ernie_image.nodes.pe.local.decode import sample_top_p, uniform_draws
from comfyui_ernie_image.nodes.pe.local.template import BAIDU_CHAT_TEMPLATE
from comfyui_ernie_image.nodes.pe.protocol import (
    EnhancerError,
    PromptSpec,
    SamplingParams,
    chat_messages,
    user_message,
)

HOSTILE = 'a "quoted" \\ back\\slash\nnew line\t tab 中文提示 🐱‍👤 </s> [INST] {"json": 1} \u2028 \x00'


@settings(max_examples=300, deadline=None)
@given(prompt=st.text(), width=st.integers(16, 8192), height=st.integers(16, 8192))
def test_any_prompt_arrives_intact_in_the_user_message(prompt, width, height):
    (message,) = chat_messages(prompt, width, height)
    assert message["role"] == "user"
    assert json.loads(message["content"]) == {"prompt": prompt, "width": width, "height": height}
    assert message["content"] == json.dumps({"prompt": prompt, "width": width, "height": height}, ensure_ascii=False)


def test_the_user_message_keeps_non_ascii_text_as_is():
    content = user_message(HOSTILE, 848, 1264)
    assert "中文提示" in content and "🐱" in content  # ensure_ascii=False, as in diffusers and Baidu's recipe
    assert list(json.loads(content)) == ["prompt", "width", "height"]


@pytest.fixture(scope="module")
def baidu_template_tokenizer():
    from scripts.tiny_models import make_tokenizer

    return make_tokenizer(BAIDU_CHAT_TEMPLATE.read_text(encoding="utf-8"))


@settings(max_examples=100, deadline=None)
@given(prompt=st.text())
def test_baidus_chat_template_wraps_the_message_unchanged(baidu_template_tokenizer, prompt):
    """The rendered chat (what the PE reads) holds the JSON message verbatim between [INST] and [/INST]."""
    rendered = baidu_template_tokenizer.apply_chat_template(
        PromptSpec(prompt, 1024, 1024).messages(), tokenize=False, add_generation_prompt=False
    )
    assert rendered.startswith("<s>[SYSTEM_PROMPT]")
    assert rendered.endswith("[INST]" + user_message(prompt, 1024, 1024) + "[/INST]")


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"temperature": -0.1}, "temperature must be 0 (greedy) or more"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p must be in (0, 1]"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ({"seed": -1}, "seed must not be negative"),
    ],
)
def test_sampling_params_reject_impossible_values(kwargs, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(**kwargs)


def test_a_prompt_that_is_not_valid_unicode_is_a_clear_error():
    with pytest.raises(EnhancerError, match="The prompt is not valid Unicode text \\(surrogates not allowed at "
                                            "character 6\\)"):
        PromptSpec("a cat \ud83d and a dog")


def test_the_nucleus_is_transformers_nucleus():
    """Each token TopPLogitsWarper keeps owns a slice of [0, 1) as wide as its renormalised probability: a draw in
    that slice samples it, and no draw reaches a token outside the nucleus."""
    generator = torch.Generator().manual_seed(0)
    temperature = torch.tensor(0.6)
    for top_p in (0.3, 0.8, 0.95, 1.0):
        logits = torch.randn(500, generator=generator) * 3
        kept = TopPLogitsWarper(top_p)(None, logits[None] / temperature)[0] > -float("inf")
        probs = torch.softmax(logits.double() / 0.6, -1) * kept
        order = probs.argsort(descending=True)[: int(kept.sum())]
        edges = torch.cat([torch.zeros(1, dtype=torch.double), probs[order].cumsum(0) / probs.sum()])
        middles = ((edges[:-1] + edges[1:]) / 2).float()
        wide = (edges[1:] - edges[:-1]) > 1e-5  # narrower slices are below float32 resolution near 1
        sampled = torch.stack([sample_top_p(logits[None], u, temperature, torch.tensor(top_p))[0] for u in middles])
        assert torch.equal(sampled[wide], order[wide]), f"top_p={top_p}"
        assert wide[:10].all()
        last = sample_top_p(logits[None], torch.tensor(0.99999994), temperature, torch.tensor(top_p))[0]
        assert kept[last], f"top_p={top_p}"


def test_sampling_follows_the_nucleus_probabilities():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = torch.rand(20000, generator=torch.Generator().manual_seed(1))
    tokens = torch.stack([sample_top_p(logits, u, torch.tensor(1.0), torch.tensor(0.9)) for u in draws[:4000]])
    frequencies = torch.bincount(tokens.flatten(), minlength=4).float() / len(tokens)
    # top_p 0.9 keeps the first three tokens (0.8 of the mass lies before the third); renormalised: .526 .316 .158
    assert torch.allclose(frequencies, torch.tensor([0.526, 0.316, 0.158, 0.0]), atol=0.03)


def test_temperature_zero_is_greedy_and_the_draws_come_from_the_seed():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    greedy = sample_top_p(logits, torch.tensor(0.999), torch.tensor(0.0), torch.tensor(0.8))
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(uniform_draws(7, 10), uniform_draws(7, 10))
    assert not torch.equal(uniform_draws(7, 10), uniform_draws(8, 10))
