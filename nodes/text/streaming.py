"""A decoder language model run on a device one layer at a time while its weights stay in host RAM (engine).

The text encoder is streamed where it does not fit on the GPU beside the DiT: its decoder layers stay in host memory
(pinned by the host where allowed) and each is copied to the device just before it runs and dropped right after, so
the device holds two layers (the one computing, the next arriving) and the activations. The embedding table (0.8 GB:
a fifth of Ministral 3 with fp8 layers) never moves: its rows are looked up where it lives and only they go to the
device. The other tensors (the final norm, the rotary frequencies) are small and move once per run.

A tensor passes through the device by swapping its ``.data`` to a device copy and back to its own host tensor: nothing
is copied back, no second host copy is made, and the model is left as it was (after Cancel or an error too).

The run is transformers' own forward of the model (its mask, positions and rotary embedding), with hooks on the
layers. It stops before the last layer: the encoder's ``hidden_states[-2]`` is that layer's input (transformers
records the first layer's input, each layer's output, and puts the normed last output in place of the last one), so
the last layer is neither copied nor run, nor is the norm run; the result is bit-identical (test_text_streaming.py).

On a CUDA device the next layer is copied on a side stream while the current one computes: the compute stream waits
on an event for its own layer only; a device copy is marked used by the compute stream (``record_stream``) before it
is dropped, so its memory is not reused before the layer ran; before copying layer i + 1 the host waits for layer
i - 1 to finish, so no more than two layers are on the device however far ahead the host runs. The copies'
sources are the model's own host tensors, alive for the whole run. On other devices the same code runs without
streams or events.
"""

from __future__ import annotations

import contextlib

import torch

from ..cancel import check_cancel
from ..errors import ErnieImageError

ATTENTION_SCORE_BYTES = 4  # float32 scores where the attention kernel materialises them
WORKING_MARGIN = 2  # activations are estimated, not measured: twice the estimate


class _Reached(Exception):
    """Raised by the hook on the last layer to end the run there, carrying that layer's input."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__("the last decoder layer was reached")
        self.hidden = hidden


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.nelement() * t.element_size() for t in tensors)


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


class _OnDevice:
    """A group of tensors whose ``.data`` is a device copy until ``release``; ``ready``: the event their copies
    complete at (CUDA), which the compute stream waits on."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device, copy_stream):
        self.tensors = tensors
        self.hosts = [t.data for t in tensors]
        self.ready = None
        with torch.cuda.stream(copy_stream) if copy_stream is not None else contextlib.nullcontext():
            copies = [torch.empty_like(host, device=device).copy_(host, non_blocking=copy_stream is not None
                                                                   and host.is_pinned())
                      for host in self.hosts]
            if copy_stream is not None:
                self.ready = torch.cuda.Event()
                self.ready.record(copy_stream)
        for tensor, copy in zip(tensors, copies, strict=True):
            tensor.data = copy

    def release(self, compute_stream) -> None:
        """Give each tensor its host data back; the device copies go once the compute stream is past them."""
        for tensor, host in zip(self.tensors, self.hosts, strict=True):
            if compute_stream is not None:
                tensor.data.record_stream(compute_stream)
            tensor.data = host
        self.tensors, self.hosts = [], []


class LayerStream:
    """Runs ``model`` (a transformers decoder model: ``embed_tokens``, ``layers`` and small rest, such as
    ``Ministral3Model``) on ``device`` a decoder layer at a time; its weights stay where they are.

    ``copied_bytes``: the weight bytes the last run copied to the device (the layers it ran and the small tensors)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.model = model
        self.device = torch.device(device)
        self.copied_bytes = 0
        self._copy_stream = None

    def _small_tensors(self) -> list[torch.Tensor]:
        streamed = {id(t) for t in (*_tensors(self.model.layers), *_tensors(self.model.embed_tokens))}
        return [t for t in _tensors(self.model) if id(t) not in streamed]

    def layer_bytes(self) -> list[int]:
        """Each decoder layer's weight bytes, in order."""
        return [_bytes(_tensors(layer)) for layer in self.model.layers]

    def device_bytes(self) -> int:
        """The most weight bytes on the device at once during a run: the two largest layers (one computing, the next
        arriving) and the small tensors."""
        return sum(sorted(self.layer_bytes())[-2:]) + _bytes(self._small_tensors())

    def working_bytes(self, tokens: int) -> int:
        """An upper estimate of the activations a run of ``tokens`` tokens holds on the device at once: one layer's
        hidden states, projections and MLP, attention scores where the kernel materialises them, and the keys and
        values transformers' cache keeps for every layer."""
        config = self.model.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        per_token = (4 * config.hidden_size + 2 * (heads + kv_heads) * head_dim + 3 * config.intermediate_size
                     + 2 * kv_heads * head_dim * len(self.model.layers))
        element = self.model.norm.weight.element_size()  # the compute dtype's (a GGUF table is bytes)
        return WORKING_MARGIN * (tokens * per_token * element + heads * tokens * tokens * ATTENTION_SCORE_BYTES)

    @torch.no_grad()
    def hidden_before_last_layer(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[B, T, D]`` on the device: the last decoder layer's input, which is transformers'
        ``hidden_states[-2]``. ``check_cancel()`` runs before each layer."""
        cuda = self.device.type == "cuda"
        if cuda and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        copy_stream = self._copy_stream if cuda else None
        compute_stream = torch.cuda.current_stream(self.device) if cuda else None
        layers = list(self.model.layers)
        on_device: dict[int, _OnDevice] = {}
        finished: dict[int, torch.cuda.Event] = {}

        def bring(index: int) -> None:
            on_device[index] = _OnDevice(_tensors(layers[index]), self.device, copy_stream)
            self.copied_bytes += _bytes(on_device[index].hosts)

        def before(index: int, module, args, kwargs):
            if index == len(layers) - 1:
                raise _Reached(args[0] if args else kwargs["hidden_states"])
            check_cancel()
            if on_device[index].ready is not None:
                compute_stream.wait_event(on_device[index].ready)

        def after(index: int, module, args, output):
            # The layer's kernels are queued: copy the next layer while they run (from pageable memory too, whose
            # copies hold the host until they are done).
            if cuda:
                finished[index] = torch.cuda.Event()
                finished[index].record(compute_stream)
            on_device.pop(index).release(compute_stream)
            if index + 1 < len(layers) - 1:
                if index - 1 in finished:  # the layer before is done: its memory is free for the next one
                    finished.pop(index - 1).synchronize()
                bring(index + 1)

        hooks = []
        small = _OnDevice(self._small_tensors(), self.device, None)  # on the compute stream: nothing to wait for
        self.copied_bytes = _bytes(small.hosts)
        try:
            for index, layer in enumerate(layers):
                hooks.append(layer.register_forward_pre_hook(
                    lambda *a, index=index: before(index, *a), with_kwargs=True))
                hooks.append(layer.register_forward_hook(lambda *a, index=index: after(index, *a)))
            table = self.model.embed_tokens
            rows = table(input_ids.to(table.weight.device)).to(self.device)
            if len(layers) > 1:
                bring(0)
            try:
                self.model(inputs_embeds=rows)  # as the encoder calls it unstreamed, for the same mask and cache
            except _Reached as reached:
                return reached.hidden
            raise ErnieImageError(f"The language model ran fewer decoder layers than it holds ({len(layers)}): its "
                                  "config's num_hidden_layers is smaller. The model cannot be streamed; load the "
                                  "text encoder file again.")
        finally:
            for hook in hooks:
                hook.remove()
            for group in (*on_device.values(), small):
                group.release(compute_stream)
