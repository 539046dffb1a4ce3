"""The local PE backend: a lazy handle that loads the weights on first use and generates with transformers.

On CUDA, decoding takes the static-cache fast path with its step captured in CUDA graphs (``decode.StaticDecoder``,
``static-graphs``: no compiler, so nothing to wait for on a first prompt); elsewhere plain ``generate``
(``decode.PlainDecoder``), which also takes over, for good, from a fast path that fails alone. Where the weights
live and how generation stops are the host's business (``Runtime``): plain torch by default, ComfyUI's model
management and interrupt (``comfy_runtime``) where the nodes pass it in.

With fp8 weights (``fp8``, or a file in core's fp8 layout) the decoders are the same: they call the model's layers,
and an fp8 layer casts its weight to the compute dtype as it runs, in torch's own kernels on any CUDA GPU. Only the
compiled step (``static-compiled``, asked for by name) needs a GPU whose compiler can cast fp8 (Triton: CUDA
capability 8.9 on; pytorch/pytorch#167082).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ...host.sizes import CacheSized
from ...model_files import builds_weights
from ..protocol import Completion, GenerationStopped, PromptSpec, ResultCallback, SamplingParams
from ..runtime import Runtime
from .batching import MAX_ROWS, batch_progress, batch_rows, kv_cache_bytes, next_batch, row_bytes
from .decode import Decoder, DecodeRequest, PlainDecoder, StaticDecoder
from .fused import fuse_mlp_projections
from .weights import PESource, path_source, snapshot_source

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DECODE_MODES = ("auto", "generate", "static", "static-compiled", "static-graphs")
STATIC_STEPS = {"static": "eager", "static-compiled": "compiled", "static-graphs": "graphs"}  # StaticDecoder's step


class LocalPromptEnhancer(CacheSized):
    """A lazy handle on local PE weights: nothing is read before the first ``enhance``.

    ``device``: ``"default"`` or a torch device name; ``dtype``: ``"auto"`` (the host's choice, ``Runtime.dtype``) or
    a key of ``DTYPES``; ``decode``: one of ``DECODE_MODES`` (``"auto"``: the static-cache path in CUDA graphs on
    CUDA, plain ``generate`` elsewhere); ``runtime``: the host (plain torch when None); ``fp8``: the decoder layers'
    linears held in fp8 (half their memory; the LM head and embeddings stay in ``dtype``, which they all compute in);
    ``follows_plan``: its device and, where ``form_follows_plan``, ``fp8`` were the memory plan's (``auto``) and follow
    later plans (``follow``).
    """

    def __init__(
        self,
        source: PESource,
        device: str = "default",
        dtype: str = "auto",
        decode: str = "auto",
        runtime: Runtime | None = None,
        fp8: bool = False,
        follows_plan: bool = False,
        form_follows_plan: bool = False,
    ):
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
        self.source, self.device_name, self.dtype_name, self.decode, self.fp8 = source, device, dtype, decode, fp8
        self.follows_plan, self.form_follows_plan = follows_plan, form_follows_plan
        self.runtime = runtime or Runtime()
        self._model = self._tokenizer = self._load = None
        self._decoder: Decoder | None = None  # set with the model

    @classmethod
    def from_snapshot(cls, snapshot_dir: Path, **options) -> LocalPromptEnhancer | None:
        """The PE of an ERNIE-Image snapshot (``pe/`` + ``pe_tokenizer/``), or None when the snapshot has none."""
        source = snapshot_source(Path(snapshot_dir))
        return None if source is None else cls(source, **options)

    @classmethod
    def from_path(cls, path: Path, **options) -> LocalPromptEnhancer:
        """A PE from a snapshot folder, a Hugging Face folder or ComfyUI's single file."""
        return cls(path_source(Path(path)), **options)

    @property
    def identity(self) -> str:
        """Everything that changes the text: the weight and tokenizer files, the chat template rendered, and the
        dtype, device and decode path as this handle resolves "auto" and "default" (the same before and after
        loading); fp8 weights when asked for (a file stored in fp8 is named by its own identity)."""
        device = self.runtime.device(self.device_name)
        dtype = str(self._dtype(device)).removeprefix("torch.")
        weights = "|weights=fp8_e4m3fn" if self.fp8 else ""  # absent for default: texts cached before it stay valid
        template = hashlib.sha256(self.source.chat_template().encode()).hexdigest()[:16]
        return (f"local:{self.source.identity()}|template={template}|dtype={dtype}{weights}"
                f"|device={_device_label(device)}|decode={self._decode_path(device)}")

    def _dtype(self, device: torch.device) -> torch.dtype:
        return DTYPES.get(self.dtype_name) or self.runtime.dtype(device)

    def _decode_path(self, device: torch.device) -> str:
        """The decode path: once loaded, the one in use (a failed fast path falls back to generate for good)."""
        return _resolve_decode(self.decode, device) if self._model is None else self._decoder.name

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def cache_tensors(self) -> list[torch.Tensor]:
        """The weights, once loaded (the executor's cache sizes the handle by them)."""
        return [] if self._model is None else [*self._model.parameters(), *self._model.buffers()]

    def __repr__(self) -> str:
        fp8 = ", fp8" if self.fp8 else ""
        return f"LocalPromptEnhancer({self.source.weights}, device={self.device_name}, dtype={self.dtype_name}{fp8})"

    @builds_weights  # the enhance node runs in inference mode; the fused gate/up weights are made here too
    def _ensure_loaded(self) -> None:
        if self._model is not None:
            return
        device = self.runtime.device(self.device_name)
        model, tokenizer = self.source.load(self._dtype(device), self.fp8)
        fuse_mlp_projections(model)  # one product for gate and up: decode steps stream the weights faster
        mode = _resolve_decode(self.decode, device)
        self._decoder = PlainDecoder(model) if mode == "generate" else StaticDecoder(model, STATIC_STEPS[mode])
        self._load = self.runtime.manage(model, device, on_unload=self._release_caches)
        self._model, self._tokenizer, self._device = model, tokenizer, device

    def follow(self, device: str, fp8: bool) -> None:
        """Run on ``device`` (``default`` or ``cpu``) with the decoder layers in fp8 or not from the next enhance on,
        where the handle follows the plan (``follows_plan``; the form too where ``form_follows_plan``): the graph's plan
        may change after its loader ran, which ComfyUI does not run again while its inputs stay. Weights loaded for
        another device or form are dropped and read again when next needed."""
        fp8 = fp8 if self.form_follows_plan else self.fp8
        if not self.follows_plan or (device, fp8) == (self.device_name, self.fp8):
            return
        if self._model is not None:
            self.runtime.release(self._model)
            self._release_caches()
            self._model = self._tokenizer = self._load = self._decoder = None
        logging.info("ERNIE-Image PE: the memory plan runs the prompt enhancer on %s%s now",
                     "the CPU" if device == "cpu" else "the GPU", " in fp8" if fp8 else "")
        self.device_name, self.fp8 = device, fp8

    def _release_caches(self) -> None:
        self._decoder.release()

    def enhance(
        self, specs: Sequence[PromptSpec], params: SamplingParams, on_result: ResultCallback | None = None
    ) -> list[Completion]:
        """Enhance all prompts, in batches that fit the device (``batching``); ``on_result`` gets each batch's texts
        as soon as it is done, so that a later failure or a Cancel loses none of them. The host's progress bar
        counts prompts. Raises the host's interrupt when stopped."""
        if not specs:
            return []
        self._ensure_loaded()
        prompts = self._token_rows(specs)  # tokenized once: the plan and every batch use them
        rows = self._plan_rows(max(map(len, prompts)), len(specs), params)
        bar = self.runtime.progress(len(specs))
        completions: list[Completion] = []
        try:
            while len(completions) < len(specs):
                if self.runtime.should_stop():
                    raise GenerationStopped("stopped between two batches")
                done = len(completions)
                batch = prompts[done:done + next_batch(done, len(specs), rows)]
                pad = self._decoder.bucketed and rows < len(specs)  # every batch in one shape bucket
                try:
                    texts = self._enhance_batch(batch, params, rows if pad else len(batch), bar, done)
                except torch.OutOfMemoryError:
                    if rows == 1:
                        raise
                    rows = self._halve(rows)
                    continue
                for index, completion in enumerate(texts, start=done):
                    if on_result is not None:
                        on_result(index, completion)
                completions += texts
                bar(len(completions))
        except GenerationStopped:
            self.runtime.on_stopped()
            raise
        return completions

    def _plan_rows(self, length: int, count: int, params: SamplingParams) -> int:
        """Prompts per batch for ``count`` prompts of at most ``length`` tokens (the longest sizes every batch):
        model management first makes room for a whole batch where it can (unloading other models), then the host
        measures what is free beside the loaded weights."""
        per_row = row_bytes(self._model.config, length, params.max_new_tokens, self._model.dtype)
        self._load(per_row * min(count, MAX_ROWS))
        return batch_rows(self.runtime.free_memory(self._device), per_row, count, self._device)

    def _halve(self, rows: int) -> int:
        """After running out of memory (the estimate missed something): the power of two below ``rows`` (about
        half), the fast path's caches dropped so that the smaller batch has room."""
        self._release_caches()
        smaller = 1 << ((rows - 1).bit_length() - 1)
        logging.warning("ERNIE-Image PE: out of memory with %d prompts in a batch; going on with %d", rows, smaller)
        return smaller

    def _enhance_batch(self, prompts: list[list[int]], params: SamplingParams, rows: int,
                       bar: Callable[[float], None], done: int) -> list[Completion]:
        """One batch of tokenized prompts, padded to ``rows`` with copies of its first (their texts are dropped)."""
        input_ids, attention_mask = self._left_pad([*prompts, *[prompts[0]] * (rows - len(prompts))])
        self._load(kv_cache_bytes(self._model.config, *input_ids.shape, params.max_new_tokens, self._model.dtype))
        request = DecodeRequest(
            input_ids.to(self._device), attention_mask.to(self._device), params, self._eos_ids(), self._pad_id(),
            self.runtime.should_stop, batch_progress(bar, done, len(prompts), params.max_new_tokens),
        )
        tokens = self._generate(request)
        return [self._completion(row, params) for row in tokens[:len(prompts)].cpu().tolist()]

    def _generate(self, request: DecodeRequest) -> torch.Tensor:
        try:
            return self._decoder.generate(request)
        except (GenerationStopped, torch.OutOfMemoryError, *self.runtime.interrupts):
            raise  # a stop, or too long a batch for the memory: the decoder itself is sound
        except Exception as error:
            if self.decode != "auto" or isinstance(self._decoder, PlainDecoder):
                raise
            # Plain generate tells whose failure it was. Failing too, the cause lies elsewhere (the weights, the
            # device: broken weights once failed both) and its error is raised with the fast path kept; working,
            # the fast path's own (a compiler or graph failure) and plain generate takes over for good.
            plain = PlainDecoder(self._model)
            tokens = plain.generate(request)
            logging.warning("ERNIE-Image PE: fast decoding failed (%s) where plain generate works; using plain "
                            "generate from now on", error)
            self._decoder = plain
            return tokens

    def _token_rows(self, specs: Sequence[PromptSpec]) -> list[list[int]]:
        """Each prompt chat-templated (no generation prompt) into token ids."""
        return [
            list(self._tokenizer.apply_chat_template(
                spec.messages(), add_generation_prompt=False, tokenize=True, return_dict=True
            )["input_ids"])
            for spec in specs
        ]

    def _left_pad(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rows left-padded into one batch: ids and attention mask."""
        length = max(map(len, rows))
        input_ids = torch.tensor([[self._pad_id()] * (length - len(r)) + list(r) for r in rows])
        attention_mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows])
        return input_ids, attention_mask

    def _eos_ids(self) -> list[int]:
        ids = {self._tokenizer.eos_token_id}
        for value in (self._model.config.eos_token_id, self._model.generation_config.eos_token_id):
            ids.update(value if isinstance(value, list) else [value])
        return sorted(i for i in ids if i is not None)

    def _pad_id(self) -> int:
        for value in (self._tokenizer.pad_token_id, self._model.config.pad_token_id):
            if value is not None:
                return value
        return self._eos_ids()[0]

    def _completion(self, tokens: list[int], params: SamplingParams) -> Completion:
        eos = set(self._eos_ids())
        end = next((i for i, t in enumerate(tokens) if t in eos), None)
        text = self._tokenizer.decode(tokens[:end], skip_special_tokens=True).strip()
        return Completion(text, truncated=end is None and len(tokens) >= params.max_new_tokens)


def _resolve_decode(mode: str, device: torch.device) -> str:
    """``auto``: the static-cache path in CUDA graphs on CUDA, plain ``generate`` elsewhere."""
    if mode != "auto":
        return mode
    return "static-graphs" if device.type == "cuda" else "generate"


def _device_label(device: torch.device) -> str:
    """The device as far as it changes the text: its kind and, for a GPU, its model (kernels, and so the last bits
    of the logits, differ between GPU models; two cards of one model give the same text, whatever their index)."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type
