"""The PE fast path's step captured in CUDA graphs (``decode.StaticDecoder(model, "graphs")``, what ``auto`` takes on
CUDA), on a GPU: the same tokens as the eager step, request after request, under torch's own allocator and under
cudaMallocAsync (ComfyUI's default, where the compiled step's graphs do not run); captured again when the weights
move. A tiny Ministral 3 with grouped-query attention; needs CUDA (the GPU check runs this file)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from transformers import Ministral3Config, Ministral3ForCausalLM

from comfyui_ernie_image.nodes.pe.local import decode
from comfyui_ernie_image.nodes.pe.protocol import SamplingParams
from conftest import REPO
from helpers.prompts import left_padded

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=40, seed=4)
CAPTURED = "ERNIE-Image PE: captured the decode step"


@pytest.fixture(scope="module")
def model() -> Ministral3ForCausalLM:
    torch.manual_seed(0)
    config = Ministral3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.3,
        tie_word_embeddings=False,
    )
    return Ministral3ForCausalLM(config).eval().to("cuda", torch.bfloat16)


def prompts(seed: int, lengths: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of ``lengths`` on the GPU."""
    input_ids, mask = left_padded(seed, lengths, vocab=512)
    return input_ids.cuda(), mask.cuda()


def tokens(decoder: decode.StaticDecoder, seed: int, lengths: tuple[int, ...]) -> torch.Tensor:
    input_ids, mask = prompts(seed, lengths)
    request = decode.DecodeRequest(input_ids, mask, SAMPLED, [2], 0, lambda: False, lambda done: None)
    return decoder.generate(request, ignore_eos=True)


def test_the_graphed_step_gives_the_eager_steps_tokens_request_after_request(model, caplog):
    """Three requests in one bucket (other prompts, other padding) and one in another: the tokens of the eager step
    each time (the same kernels, replayed), captured once per bucket."""
    graphed = decode.StaticDecoder(model, "graphs")
    requests = [(1, (5, 9, 12)), (2, (12, 3, 7)), (3, (8, 8, 8)), (4, (30,))]
    with caplog.at_level(logging.INFO):
        for seed, lengths in requests:
            expected = tokens(decode.StaticDecoder(model, "eager"), seed, lengths)
            assert torch.equal(tokens(graphed, seed, lengths), expected), (seed, lengths)
            assert len(set(expected[0].tolist())) > 10  # sampled text, not one token over and over
    captured = [m for m in caplog.messages if m.startswith(CAPTURED)]
    assert len(captured) == 2 and len(graphed._buckets) == 2
    print(f"allocator {torch.cuda.get_allocator_backend()}: {captured}")


def test_moved_weights_are_captured_again(model, caplog):
    """ComfyUI may unload the PE and load it back elsewhere between prompts: a graph replayed on the old addresses
    would read freed memory. The weights' old copies are kept alive and zeroed, so a stale graph gives other tokens."""
    graphed = decode.StaticDecoder(model, "graphs")
    before = tokens(graphed, 1, (5, 9))
    old = [tensor.data for tensor in model.parameters()]
    model.to("cpu").to("cuda")
    for tensor in old:
        tensor.zero_()
    with caplog.at_level(logging.INFO):
        after = tokens(graphed, 1, (5, 9))
    assert torch.equal(after, before) and torch.equal(after, tokens(decode.StaticDecoder(model, "eager"), 1, (5, 9)))
    assert len([m for m in caplog.messages if m.startswith(CAPTURED)]) == 1


def test_the_graphed_step_runs_under_cudamallocasync_comfyuis_default_allocator():
    """The first test again in a process of its own under ``backend:cudaMallocAsync`` (an allocator is chosen once
    per process)."""
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").startswith("backend:cudaMallocAsync"):
        pytest.skip("this process runs under cudaMallocAsync already: the tests above ran under it")
    finished = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", __file__, "-k",
         "request_after_request"],
        cwd=REPO / "tests", env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
        capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "allocator cudaMallocAsync:" in finished.stdout and "1 passed" in finished.stdout
