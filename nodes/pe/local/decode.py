"""Token generation for the local PE: seeded top-p sampling and two decoders, plain ``generate`` (``PlainDecoder``) and
the static-cache fast path (``StaticDecoder``), which take the same request (``DecodeRequest``).

Both paths draw the same uniform numbers from the seed and sample with the same function, so a seed gives the same
text on either path (up to floating point), and a prompt's text does not depend on the other prompts of its batch.

The fast path keeps a static KV cache per (batch, length) bucket and runs each decode step, sampling included, as one
unit: on CUDA the eager step captured in a CUDA graph per bucket (``"graphs"``, what ``auto`` takes: one launch per
token, no compiler to wait for, under ComfyUI's cudaMallocAsync allocator too), or the step compiled
(``"compiled"``: ``torch.compile(mode="reduce-overhead")``, minutes of compiling on a first run), or eager
(``"eager"``, tests and the CPU). Python only launches steps and looks at the GPU every ``_SYNC_EVERY`` tokens. Its
decode steps attend with ``attention.NAME``: grouped by KV head, K/V read in place (transformers' ``sdpa`` repeats
them per query head when compiled). Plain torch and transformers, no ComfyUI.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import GenerationConfig, LogitsProcessor, StaticCache, StoppingCriteria, StoppingCriteriaList

from ...compile_clock import CompileClock
from ..protocol import GenerationStopped, SamplingParams
from . import attention as grouped_attention

_SYNC_EVERY = 16  # decode steps between looks at the GPU (EOS, progress)
# The shape buckets the compiled step's recompile limit covers: batches of up to 64 prompts, prompt and answer up to
# 16384 tokens (the node's longest max_new_tokens, 8192, after a prompt as long).
_COVERED_ROWS, _COVERED_TOKENS = 64, 16384
# Shape buckets a decoder keeps between requests (the most recent ones): ComfyUI does not see their KV caches (at
# true size 104 KiB a row and slot in bf16: 0.27 GB for the 2560 slots of a 2048-token answer, four times that for
# four rows) and they stay until the PE is unloaded. Two cover a workflow with two PE settings; a third shape drops
# the oldest, whose capture takes 0.1 s again if it comes back. The compiled step keeps them all (a new cache for a
# shape it compiled could compile it again).
_KEPT_BUCKETS = 2


@dataclass(frozen=True)
class DecodeRequest:
    """One batch to decode: left-padded prompts ``input_ids``/``attention_mask [B, S]`` on the model's device, the
    sampling, the stop tokens, the pad id, and the host's callbacks: ``should_stop()``, looked at between steps, and
    ``progress(tokens)``, told how many new tokens each row has so far."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    params: SamplingParams
    eos_ids: list[int]
    pad_id: int
    should_stop: Callable[[], bool]
    progress: Callable[[int], None]


class Decoder(Protocol):
    """Turns a ``DecodeRequest`` into new tokens ``[B, T]``, pad after EOS; raises ``GenerationStopped`` when
    ``should_stop`` says so. ``name``: the decode path, as the result cache's identity records it; ``bucketed``:
    batches run in shape buckets, so that every batch of a list is best padded to one."""

    name: str
    bucketed: bool

    def generate(self, request: DecodeRequest) -> torch.Tensor: ...

    def release(self) -> None:
        """Drop what the decoder keeps on the device (when the weights leave it)."""


def uniform_draws(seed: int, steps: int) -> torch.Tensor:
    """One uniform number per decode step, the same on every device and for every row of a batch."""
    return torch.rand(steps, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def sample_top_p(logits: torch.Tensor, u: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus sampling by inverse CDF: ``logits [B, V]``, ``u`` in [0, 1) → token ids ``[B]``; greedy at 0 degrees.

    The nucleus is the set kept by transformers' ``TopPLogitsWarper``: the most likely tokens whose preceding mass is
    below ``top_p``. Tensor parameters, so new values do not recompile.
    """
    logits = logits.float()
    probs = torch.softmax(logits / temperature.clamp_min(1e-5), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    kept = mass_before < top_p
    kept[:, 0] = True
    nucleus = sorted_probs * kept
    cdf = nucleus.cumsum(dim=-1)
    threshold = u * cdf[:, -1:]
    choice = (cdf < threshold).sum(dim=-1, keepdim=True).clamp(max=kept.sum(dim=-1, keepdim=True) - 1)
    sampled = order.gather(-1, choice).squeeze(-1)
    return torch.where(temperature > 0, sampled, logits.argmax(dim=-1))


def _sampling_tensors(params: SamplingParams, device: torch.device) -> tuple[torch.Tensor, ...]:
    u = uniform_draws(params.seed, params.max_new_tokens).to(device)
    temperature = torch.tensor(params.temperature, dtype=torch.float32, device=device)
    top_p = torch.tensor(params.top_p, dtype=torch.float32, device=device)
    return u, temperature, top_p


class _SeededSampler(LogitsProcessor):
    """Makes ``generate``'s greedy step pick the token ``sample_top_p`` chose (everything else scores -inf)."""

    def __init__(self, params: SamplingParams, prompt_length: int, device: torch.device):
        self.u, self.temperature, self.top_p = _sampling_tensors(params, device)
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_length
        chosen = sample_top_p(scores, self.u[step], self.temperature, self.top_p)
        picked = torch.full_like(scores, -float("inf"))
        return picked.scatter_(1, chosen[:, None], 0.0)


class _StopCheck(StoppingCriteria):
    """Reports progress and ends ``generate`` when the host asks to stop."""

    def __init__(self, should_stop: Callable[[], bool], progress: Callable[[int], None], prompt_length: int):
        self.should_stop, self.progress, self.prompt_length = should_stop, progress, prompt_length
        self.stopped = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        self.progress(input_ids.shape[1] - self.prompt_length)
        self.stopped = self.stopped or self.should_stop()
        return torch.full((input_ids.shape[0],), self.stopped, dtype=torch.bool, device=input_ids.device)


class PlainDecoder:
    """transformers' ``generate`` with the seeded sampler: runs wherever the model runs (the fast path's fallback)."""

    name = "generate"
    bucketed = False

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def release(self) -> None:
        """Nothing to drop: ``generate`` makes its cache per call."""

    @torch.inference_mode()
    def generate(self, request: DecodeRequest) -> torch.Tensor:
        params = request.params
        config = GenerationConfig(
            do_sample=False, max_new_tokens=params.max_new_tokens, eos_token_id=request.eos_ids,
            pad_token_id=request.pad_id,
        )
        prompt_length = request.input_ids.shape[1]
        stop = _StopCheck(request.should_stop, request.progress, prompt_length)
        output = self.model.generate(
            input_ids=request.input_ids,
            attention_mask=request.attention_mask,
            generation_config=config,
            logits_processor=[_SeededSampler(params, prompt_length, request.input_ids.device)],
            stopping_criteria=StoppingCriteriaList([stop]),
        )
        if stop.stopped:
            raise GenerationStopped("generation was interrupted")
        return output[:, prompt_length:]


def _decode_step(model, cache_kwargs, token, position, mask, u, temperature, top_p) -> torch.Tensor:
    """One token for every row: the forward pass on the static cache, then sampling, all on the device."""
    logits = model(
        input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None], use_cache=True, **cache_kwargs
    ).logits[:, -1]
    return sample_top_p(logits, u, temperature, top_p)


def cuda_graphs_allowed(device: torch.device) -> bool:
    """Whether the compiled step may replay CUDA graphs on ``device``: not under the cudaMallocAsync allocator
    (ComfyUI's default), where the first step fails ("cudaMallocAsync does not yet support checkPoolLiveAllocations",
    torch 2.11 on the H200)."""
    return device.type != "cuda" or torch.cuda.get_allocator_backend() != "cudaMallocAsync"


@functools.cache
def _compiled_decode_step(cuda_graphs: bool) -> Callable:
    """The decode step compiled once per process: with CUDA graphs per shape bucket (re-recorded if weights move)
    where ``cuda_graphs``, else inductor's kernels alone."""
    logging.info("ERNIE-Image PE: the decode step compiles on first use of each shape bucket (once per process: "
                 "minutes with an empty inductor cache; the log then says how long)%s",
                 "" if cuda_graphs else "; without CUDA graphs, which the cudaMallocAsync allocator does not support "
                 "(ComfyUI's --disable-cuda-malloc allows them)")
    return torch.compile(_decode_step, mode="reduce-overhead" if cuda_graphs else None, dynamic=False)


def _recompile_limit() -> contextlib.AbstractContextManager:
    """dynamo's recompile limit while the compiled step runs, and only then (no process-wide limit stays raised for
    other nodes): each bucket recompiles the one step function, and past the limit (8 by default) every new bucket
    would run uncompiled, silently, so it has to cover the buckets."""
    limit = max(torch._dynamo.config.recompile_limit, _bucket_count(_COVERED_ROWS, _COVERED_TOKENS))
    return torch._dynamo.config.patch(recompile_limit=limit)


def _bucket(n: int, minimum: int) -> int:
    """The next power of two: few distinct shapes, so few compilations."""
    size = minimum
    while size < n:
        size *= 2
    return size


def _cache_length(n: int) -> int:
    """Static cache slots for ``n`` tokens: multiples of 256 up to 2048, then quarter steps of each doubling (2560,
    3072, 3584, 4096, 5120, ...).

    Every decode step reads the K/V of every slot (masked or not), so empty slots cost bandwidth and memory: powers
    of two leave up to half of them empty (1152 tokens → 2048 slots; the node's default 2048 new tokens plus a prompt
    → 4096), these steps under a quarter beyond 1024 tokens (→ 1280; → 2560) and under 256 slots below. Each size is
    a compilation and a CUDA graph: four sizes per doubling keep them few, and a workload with a fixed
    ``max_new_tokens`` meets one or two.
    """
    step = max(256, _bucket(n, 256) // 8)
    return -(-n // step) * step


def _bucket_count(rows: int, tokens: int) -> int:
    """How many (batch, cache length) buckets batches of up to ``rows`` prompts of up to ``tokens`` tokens fall in."""
    return len({_bucket(n, 1) for n in range(1, rows + 1)}) * len({_cache_length(n) for n in range(1, tokens + 1)})


def _in_own_attention(method: Callable) -> Callable:
    """Runs a ``StaticDecoder`` method with the model switched to the decoder's attention, and back after."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with grouped_attention.using(self.model, self.attention):
            return method(self, *args, **kwargs)

    return run


STEPS = ("eager", "compiled", "graphs")  # how ``StaticDecoder`` runs a decode step


@dataclass
class _Bucket:
    """What one (batch, cache length) shape keeps between requests: the KV cache, the mask over its slots (filled
    in place per request, so that a CUDA graph reads it where it was captured) and, on the ``graphs`` path, the
    captured step."""

    cache: StaticCache
    mask: torch.Tensor
    graph: _GraphedStep | None = None


class _GraphedStep:
    """The eager decode step of one bucket captured in a CUDA graph and replayed for every later token.

    Why: an eager step launches a few hundred small kernels from Python, and the compiled step's own CUDA graphs do
    not run under ComfyUI's default allocator (``cuda_graphs_allowed``) and cost minutes of compiling on a first run.
    A captured eager step needs no compiler (fp8 casts on any CUDA GPU) and replays under either allocator. The
    step's inputs are copied into the graph's own tensors before each replay; the KV cache, the mask and the weights
    are read where they were at capture (``StaticDecoder`` drops the graphs when the weights move)."""

    def __init__(self, model: torch.nn.Module, cache_kwargs: dict, mask: torch.Tensor, stream: torch.cuda.Stream,
                 *inputs: torch.Tensor):
        self.inputs = [tensor.clone() for tensor in inputs]  # token, position, u, temperature, top_p
        # Made outside the capture: under cudaMallocAsync, freeing a tensor the capture allocated warns later.
        self.output = torch.empty_like(inputs[0])
        self.graph = torch.cuda.CUDAGraph()
        token, position, *sampling = self.inputs
        with torch.cuda.graph(self.graph, stream=stream):
            self.output.copy_(_decode_step(model, cache_kwargs, token, position, mask, *sampling))

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        for static, value in zip(self.inputs, inputs, strict=True):
            static.copy_(value)
        self.graph.replay()
        return self.output


def _weights_at(model: torch.nn.Module) -> tuple[int, ...]:
    """Where the model's weights are: a captured graph reads them there, and ComfyUI may move them between prompts."""
    return tuple(tensor.data_ptr() for tensor in (*model.parameters(), *model.buffers()))


class StaticDecoder:
    """The fast path: a static KV cache per shape bucket and a decode step run as ``step`` says (one of ``STEPS``:
    captured in CUDA graphs, compiled, or eager).

    ``attention``: the ``attn_implementation`` the model runs under while this decoder generates (the default:
    grouped decode attention; ``"sdpa"`` or None: the model's own, for comparisons). Only this decoder's calls
    switch it; plain ``generate`` keeps the model's own.
    """

    bucketed = True

    def __init__(self, model: torch.nn.Module, step: str, attention: str | None = grouped_attention.NAME):
        if step not in STEPS:
            raise ValueError(f"step must be one of {STEPS}, got {step!r}")
        self.model = model
        self.step = step
        self.attention = attention
        if attention == grouped_attention.NAME:
            grouped_attention.register()
        params = inspect.signature(type(model).forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"  # transformers >= 5.24 renamed it
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        self._captured_with: tuple[int, ...] = ()  # where the weights were when the graphs were captured
        self._stream: torch.cuda.Stream | None = None  # the graphs' warm-up and capture stream

    @property
    def name(self) -> str:
        return {"eager": "static", "compiled": "static-compiled", "graphs": "static-graphs"}[self.step]

    @staticmethod
    def shape(batch: int, prompt_length: int, max_new_tokens: int) -> tuple[int, int]:
        """The (batch, cache length) bucket a request runs in."""
        return _bucket(batch, 1), _cache_length(prompt_length + max_new_tokens)

    def release(self) -> None:
        """Drop the KV caches and the graphs that read them (when the weights leave the device)."""
        self._buckets.clear()

    def _bucket(self, rows: int, length: int, device: torch.device) -> _Bucket:
        """The bucket of this shape, reset, and the most recent from now on; a new one first drops the oldest past
        ``_KEPT_BUCKETS`` (freed before the new cache is made)."""
        bucket = self._buckets.pop((rows, length), None)
        if bucket is None:
            while self.step != "compiled" and len(self._buckets) >= _KEPT_BUCKETS:
                del self._buckets[next(iter(self._buckets))]
            bucket = _Bucket(StaticCache(config=self.model.config, max_cache_len=length),
                             torch.ones(rows, length, dtype=torch.long, device=device))
        else:
            bucket.cache.reset()
        self._buckets[(rows, length)] = bucket
        return bucket

    def _graphed_step(self, bucket: _Bucket, cache_kwargs: dict, *inputs: torch.Tensor) -> torch.Tensor:
        """One step on the ``graphs`` path. A bucket's first step runs eager on a side stream (warming up what a
        capture must not initialise) and its result is used; the step is then captured, and replayed from then on."""
        if bucket.graph is not None:
            return bucket.graph(*inputs)
        device = inputs[0].device
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        started = time.perf_counter()
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            token = _decode_step(self.model, cache_kwargs, inputs[0], inputs[1], bucket.mask, *inputs[2:])
        torch.cuda.current_stream(device).wait_stream(self._stream)
        bucket.graph = _GraphedStep(self.model, cache_kwargs, bucket.mask, self._stream, *inputs)
        rows, length = bucket.mask.shape
        logging.info("ERNIE-Image PE: captured the decode step for %d row(s) and %d cache slots in a CUDA graph in "
                     "%.1f s", rows, length, time.perf_counter() - started)
        return token

    @_in_own_attention
    @torch.inference_mode()
    def generate(self, request: DecodeRequest, ignore_eos: bool = False) -> torch.Tensor:
        """New tokens ``[B, T]`` (a row goes on after its EOS until all rows have one: cut at the first EOS);
        ``ignore_eos`` runs all ``max_new_tokens`` (benchmarks)."""
        input_ids, attention_mask, params = request.input_ids, request.attention_mask, request.params
        batch, prompt_length = input_ids.shape
        rows, length = self.shape(batch, prompt_length, params.max_new_tokens)
        device = input_ids.device
        # Spare rows of the batch bucket repeat the first prompt; their tokens are dropped.
        spare = rows - batch
        input_ids = torch.cat([input_ids, input_ids[:1].expand(spare, -1)])
        attention_mask = torch.cat([attention_mask, attention_mask[:1].expand(spare, -1)])
        if self.step == "graphs" and self._captured_with != (weights := _weights_at(self.model)):
            self._buckets.clear()  # captured graphs read the weights where they were; a cache is cheap to make again
            self._captured_with = weights
        bucket = self._bucket(rows, length, device)
        # One mask for the whole run: prompt padding is 0, every later slot 1 (causality hides the future).
        mask = bucket.mask
        mask.fill_(1)
        mask[:, :prompt_length] = attention_mask
        positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        cache_kwargs = {self._cache_arg: bucket.cache}
        u, temperature, top_p = _sampling_tensors(params, device)
        eos = torch.tensor(request.eos_ids, device=device)

        logits = self.model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
            **cache_kwargs,
        ).logits[:, -1]
        token = sample_top_p(logits, u[0], temperature, top_p)
        tokens = torch.full((rows, params.max_new_tokens), request.pad_id, dtype=torch.long, device=device)
        tokens[:, 0] = token
        finished = torch.isin(token, eos)
        position = positions[:, -1] + 1
        compiled = self.step == "compiled"
        compiled_graphs = compiled and cuda_graphs_allowed(device)  # torch.compile's own, not the "graphs" step's
        step_fn = _compiled_decode_step(compiled_graphs) if compiled else _decode_step
        steps = 1
        with _recompile_limit() if compiled else contextlib.nullcontext():
            while steps < params.max_new_tokens:
                if request.should_stop():
                    raise GenerationStopped("generation was interrupted")
                if steps % _SYNC_EVERY == 0:
                    request.progress(steps)
                    if not ignore_eos and bool(finished[:batch].all()):
                        break
                if compiled_graphs:
                    torch.compiler.cudagraph_mark_step_begin()
                with CompileClock() as clock:  # the first step of a new shape waits for the compiler
                    if self.step == "graphs":
                        token = self._graphed_step(bucket, cache_kwargs, token, position, u[steps], temperature,
                                                   top_p)
                    else:
                        token = step_fn(self.model, cache_kwargs, token, position, mask, u[steps], temperature, top_p)
                    token = token.clone()
                if clock.new_graphs:
                    logging.info("ERNIE-Image PE: compiled the decode step for %d row(s) and %d cache slots in %.1f s",
                                 rows, length, clock.seconds)
                tokens[:, steps] = token
                finished |= torch.isin(token, eos)
                position += 1
                steps += 1
        request.progress(steps)
        return tokens[:batch, :steps]
