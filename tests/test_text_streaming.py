"""Issue 43: the text encoder streamed through its device a decoder layer at a time (``text/streaming.py``).

Its weights stay in host memory and each layer passes through the device just before it runs, so a GPU holds two
layers beside the DiT instead of the whole encoder. The embeddings must not change by a bit (bf16 and fp8 encoders);
the copied bytes are the layers it ran (the last one is not needed: the encoder's ``hidden_states[-2]`` is its
input) and the small tensors; afterwards every weight is its own host tensor again, also after Cancel between two
layers, and the next encode works. On the CPU the same code runs without CUDA streams (the GPU figures are the
coordinator's, measured on the H200).
"""

from __future__ import annotations

import mmap

import comfy.model_management as mm
import pytest
import torch

from comfyui_ernie_image.nodes.text.encoder import ErnieTextEncoder
from comfyui_ernie_image.nodes.text.managed import ENCODINGS_KEPT, ManagedTextEncoder
from comfyui_ernie_image.nodes.text.streaming import LayerStream

PROMPTS = ["a red cat sits on a blue mat", "", "一只 红色 的 猫"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def encoder(request, tiny_models) -> ErnieTextEncoder:
    return ErnieTextEncoder.from_single_file(tiny_models["text_encoder_file"], torch.bfloat16,
                                             fp8=request.param == "fp8")


def _weights(model: torch.nn.Module) -> dict[str, tuple[torch.device, int]]:
    """Where each weight's data is: its device and address."""
    return {name: (t.device, t.data_ptr()) for name, t in (*model.named_parameters(), *model.named_buffers())}


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.nelement() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def _calls(module: torch.nn.Module) -> list[int]:
    """A list that grows by one each time ``module`` runs."""
    calls = []
    module.register_forward_hook(lambda *args: calls.append(1))
    return calls


def test_the_streamed_embedding_is_bit_identical_and_copies_the_layers_it_runs_once(encoder):
    model = encoder.language_model
    stream = LayerStream(model, CPU)
    before = _weights(model)
    *ran, last = model.layers
    last_calls = _calls(last)
    small = _bytes(model) - _bytes(model.layers) - _bytes(model.embed_tokens)
    for prompt in PROMPTS:
        expected = encoder.encode(prompt, CPU)
        last_calls.clear()
        streamed = encoder.encode(prompt, CPU, stream)
        assert torch.equal(streamed, expected), prompt
        assert last_calls == []  # its output is not the embedding: the streamed run stops at its input
        assert stream.copied_bytes == sum(_bytes(layer) for layer in ran) + small
        assert _weights(model) == before  # every weight is its own host tensor again: nothing left on the device
    print(f"{len(ran)} of {len(model.layers)} layers copied, {stream.copied_bytes} B per encode; "
          f"{stream.device_bytes()} B on the device at most")
    assert stream.device_bytes() == 2 * _bytes(last) + small


def test_cancel_between_two_layers_stops_there_and_the_next_encode_works(encoder):
    model = encoder.language_model
    stream = LayerStream(model, CPU)
    before, expected = _weights(model), encoder.encode(PROMPTS[0], CPU)
    second_calls = _calls(model.layers[1])
    handle = model.layers[0].register_forward_hook(lambda *args: mm.interrupt_current_processing(True))
    try:
        with pytest.raises(mm.InterruptProcessingException):
            encoder.encode(PROMPTS[0], CPU, stream)
    finally:
        handle.remove()
        mm.interrupt_current_processing(False)
    assert second_calls == []  # the user pressed Cancel during layer 0: layer 1 never ran
    assert _weights(model) == before
    assert torch.equal(encoder.encode(PROMPTS[0], CPU, stream), expected)


def test_a_streamed_managed_encoder_in_comfyui_encodes_the_same_and_is_never_loaded_whole(tiny_models):
    """Inside the real core, in inference mode as ComfyUI runs nodes: the streamed encoder gives the unstreamed one's
    embeddings, and ComfyUI never holds it loaded whole; the plan switches it to whole loading and back."""
    file = tiny_models["text_encoder_file"]
    whole = ManagedTextEncoder.from_single_file(file, "default")
    streamed = ManagedTextEncoder.from_single_file(file, "default", streamed=True)

    def held(managed: ManagedTextEncoder) -> bool:
        return any(loaded.model is managed.patcher for loaded in mm.current_loaded_models)

    with torch.inference_mode():
        for prompt in PROMPTS:
            expected = whole.encode(prompt)
            assert torch.equal(streamed.encode(prompt), expected), prompt
            assert held(whole) and not held(streamed)
        streamed.encodings.clear()  # encoded again from here on (a text met again is not: below)
        streamed.set_place(streamed=False)
        assert torch.equal(streamed.encode(PROMPTS[0]), expected := whole.encode(PROMPTS[0])) and held(streamed)
        streamed.set_place(streamed=False, on_host=True)  # the CPU's place: loaded whole before, unloaded first
        assert not held(streamed) and streamed.patcher.load_device == streamed.patcher.offload_device
        streamed.encodings.clear()
        assert torch.equal(streamed.encode(PROMPTS[0]), expected)
        streamed.set_place(streamed=True)
        assert not held(streamed)
        streamed.encodings.clear()
        assert torch.equal(streamed.encode(PROMPTS[0]), expected) and not held(streamed)
    assert streamed.stream.copied_bytes > 0


def test_a_text_met_again_is_not_encoded_again(tiny_models):
    """The latest distinct texts' encodings are kept (ComfyUI's cache keeps one text per node): a workflow that
    alternates prompts pays no second encode, which matters where the plan runs the encoder on the CPU; a new form
    of the weights encodes anew."""
    te = ManagedTextEncoder.from_single_file(tiny_models["text_encoder_file"], "default")
    runs = []
    te.encoder.language_model.register_forward_hook(lambda *args: runs.append(1))
    with torch.inference_mode():
        first = te.encode(PROMPTS[0])
        te.encode(PROMPTS[2])
        assert te.encode(PROMPTS[0]) is first and len(runs) == 2
        for i in range(ENCODINGS_KEPT):
            te.encode(f"prompt {i}")
        assert len(runs) == 2 + ENCODINGS_KEPT
        assert torch.equal(te.encode(PROMPTS[0]), first) and len(runs) == 3 + ENCODINGS_KEPT  # the oldest went first
        assert len(te.encodings) == ENCODINGS_KEPT


def test_each_weight_the_stream_pins_has_host_pages_of_its_own_with_cores_pinning_limit_spent(tiny_models,
                                                                                               monkeypatch):
    """Core pins a weight by registering the host pages it lies in with CUDA (``cudaHostRegister``); a range that
    shares a page with one registered before is refused, and 0.3.75 leaves that error for the next kernel to raise
    (upstream clears it). The weights copied out of the file before pinning were heap allocations, neighbours
    sharing pages; each now has pages of its own and encodes the same. Its storage starts where it does: torch's
    ``is_pinned`` and core's guard against registering twice read a storage's first byte, which lay before the
    registered pages (the H100, session 29). (Core's pinning runs with its limit spent, ``MAX_PINNED_MEMORY`` 1 byte,
    so it registers nothing on this CPU.)"""
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", 1)
    file = tiny_models["text_encoder_file"]
    with torch.inference_mode():
        streamed = ManagedTextEncoder.from_single_file(file, "default", streamed=True)
        assert torch.equal(streamed.encode(PROMPTS[0]), ManagedTextEncoder.from_single_file(file).encode(PROMPTS[0]))
    page, weights = mmap.PAGESIZE, list(streamed.encoder.language_model.layers.parameters())
    spans = sorted((t.data_ptr() // page, (t.data_ptr() + t.nbytes - 1) // page) for t in weights)
    assert len(spans) > 2 and all(t.data_ptr() % page == 0 for t in weights)
    assert all(t.untyped_storage().data_ptr() == t.data_ptr() for t in weights)
    assert all(last < first for (_, last), (first, _) in zip(spans, spans[1:], strict=False)), spans
