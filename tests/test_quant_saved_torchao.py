"""A torchao-quantized DiT is saved at its first load and read back at the next one, without the bf16 DiT and
without quantizing: the same weights and the same image. A saved file that is damaged, stale or from another layout
is never used: it is checked before any weight is read, removed, and the DiT quantized again.

cache-dit quantizes a whole DiT only on CUDA; here the loader's quantize step is cache-dit's per-layer path (its
torchao configuration table and torchao's ``quantize_``, as LoRA'd layers are made again), with
``float8_weight_only`` (a Float8Tensor, as ``fp8_per_row``'s; FP8 matmul needs FP8 tensor cores)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_ernie_image.nodes.dit.build import dit_skeleton, load_dit
from comfyui_ernie_image.nodes.dit.model import make_model_patcher
from comfyui_ernie_image.nodes.dit.weights import tensor_locations
from comfyui_ernie_image.nodes.quant import quantize, torchao_file
from comfyui_ernie_image.nodes.quant.requantize import Requantizer
from comfyui_ernie_image.nodes.quant.saved import RECORD, SavedDiTs
from helpers.accel import sample

DTYPE = torch.bfloat16
FP8, FP8_TYPE = "fp8_weight_only", "float8_weight_only"  # the pack's name, and cache-dit's


@pytest.fixture
def load(tiny_models, tmp_path, monkeypatch):
    """``load(method, read=True)``: the loader's quantized DiT of the tiny snapshot, saved under ``tmp_path``;
    ``read=False``: reading the bf16 DiT fails the test (the saved DiT must be used)."""
    source = tiny_models["snapshot"]
    monkeypatch.setattr(quantize, "require", lambda *args: None)
    monkeypatch.setattr(quantize, "probe", lambda device: None)

    def per_layer(transformer, quant_type, on, per_block=False):
        requantizer = Requantizer(source, quant_type, DTYPE, tensor_locations)
        for name, module in transformer.named_modules():
            if isinstance(module, torch.nn.Linear) and name.startswith("layers."):
                module.weight = requantizer.quantized(module.weight)

    monkeypatch.setattr(quantize, "quantize_torchao", per_layer)

    def bf16_dit():
        return load_dit(source, DTYPE, DTYPE)  # as the loaders ask for a method that quantizes (asked_dtypes)

    def not_read():
        raise AssertionError("the bf16 DiT was read although a saved quantized DiT was there")

    def loaded(method: str = FP8, read: bool = True, cache_root=tmp_path / "ernie_quantized"):
        return quantize.load_quantized_dit(bf16_dit if read else not_read, method, source=source,
                                           locate=tensor_locations, skeleton=lambda: dit_skeleton(source, DTYPE),
                                           dtype=DTYPE, device=torch.device("cpu"), free_memory=lambda device: 0,
                                           cache_root=cache_root)

    loaded.source, loaded.root = source, tmp_path / "ernie_quantized"
    return loaded


def checkpoint(load, quant_type: str = FP8_TYPE):
    return SavedDiTs(load.root).entry(load.source, quant_type) / f"{quant_type}.safetensors"


def weights(dit) -> dict[str, torch.Tensor]:
    """Every weight as plain tensors: a torchao weight's data and scale apart."""
    out = {}
    for name, tensor in dit.state_dict().items():
        if hasattr(tensor, "qdata"):
            out[name + ".qdata"], out[name + ".scale"] = tensor.qdata, tensor.scale
        else:
            out[name] = tensor
    return out


def test_the_second_load_reads_the_saved_dit_the_same_weights_and_image(load, caplog):
    with caplog.at_level(logging.INFO):
        first = load()
    assert "saved the quantized DiT as" in caplog.text and checkpoint(load).is_file()
    with caplog.at_level(logging.INFO):
        again = load(read=False)
    assert "read the DiT quantized to float8_weight_only at an earlier load" in caplog.text
    a, b = weights(first), weights(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8) if a[k].dtype.itemsize == 1 else a[k],
                                                    b[k].view(torch.uint8) if b[k].dtype.itemsize == 1 else b[k])
                                        for k in a)
    assert type(again.layers[0].self_attention.to_q.weight) is type(first.layers[0].self_attention.to_q.weight)
    assert again.requantizer == first.requantizer  # LoRAs are made again from the source, as on the first load
    assert again._is_quantized and again.precision == first.precision
    assert torch.equal(sample(make_model_patcher(first, whole=True)), sample(make_model_patcher(again, whole=True)))


def test_int8_weight_only_is_not_saved(load):
    """torchao's INT8 weight-only tensor is not one its safetensors layout rebuilds: quantized at every load."""
    load("int8_weight_only")
    assert not load.root.exists() or not any(load.root.iterdir())


def test_a_folder_that_cannot_be_written_costs_only_the_save(load, tmp_path, caplog):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING):
        dit = load(cache_root=blocked)
    assert "the quantized DiT is not saved" in caplog.text and "the next load quantizes it again" in caplog.text
    assert hasattr(dit.layers[0].self_attention.to_q.weight, "qdata")


def rewrite(path, change) -> None:
    """The saved file with ``change(tensors, metadata)`` applied, its record's size kept true (so that only the
    file's content is wrong, as after a hostile edit)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(path))
    change(tensors, metadata)
    save_file(tensors, str(path), metadata)
    record = path.parent / RECORD
    record.write_text(json.dumps({**json.loads(record.read_text()), "checkpoint_bytes": path.stat().st_size}))


def _scale(tensors):
    return next(k for k in tensors if k.endswith("_weight_scale"))


def _qdata(tensors):
    return next(k for k in tensors if k.endswith("_weight_qdata"))


DAMAGES = {
    "truncated": (lambda path: path.write_bytes(path.read_bytes()[:-100]), "its size changed"),
    "a scale that is not finite": (
        lambda path: rewrite(path, lambda t, m: t[_scale(t)].fill_(float("inf"))), "values that are not finite"),
    "a weight of another shape": (
        lambda path: rewrite(path, lambda t, m: t.update({_qdata(t): t[_qdata(t)][:, :4].contiguous()})),
        "is not an e4m3"),
    "an extra tensor": (lambda path: rewrite(path, lambda t, m: t.update({"extra": torch.zeros(2)})), "other tensors"),
    "a weight missing": (lambda path: rewrite(path, lambda t, m: t.pop(_qdata(t))), "is not an e4m3"),
    "another type named": (
        lambda path: rewrite(path, lambda t, m: m.update({next(iter(json.loads(m["tensor_names"]))):
                                                          json.dumps({"_type": "os.system"})})), "described as"),
    # Issue 41, finding 8: each of these loaded silently (black or garbage images), the last into NaN output.
    "negated scales": (lambda path: rewrite(path, lambda t, m: t[_scale(t)].neg_()),
                       "; a scale must be a finite positive number from 1.18e-38"),
    "zero scales": (lambda path: rewrite(path, lambda t, m: t[_scale(t)].zero_()), "is 0; a scale must be"),
    "scales of 3e38": (lambda path: rewrite(path, lambda t, m: t[_scale(t)].fill_(3e38)),
                       "is 3e+38; a scale must be a finite positive number from 1.18e-38 (smaller ones are subnormal) "
                       "to 7.57e+35 (float8_e4m3fn's largest value 448 times it must stay within bfloat16)"),
    "a scale per value": (
        lambda path: rewrite(path, lambda t, m: t.update({_scale(t): t[_scale(t)].expand(-1, 64).contiguous()})),
        "is not an e4m3 [128, 64] with one fp32 scale per row (it is F8_E4M3 [128, 64], its scale F32 [128, 64])"),
    "weights relabelled as e5m2": (
        lambda path: rewrite(path, lambda t, m: t.update({_qdata(t): t[_qdata(t)].view(torch.float8_e5m2)})),
        "with one fp32 scale per row (it is F8_E5M2 [128, 64]"),
    "a list of names nested 100 000 deep": (
        lambda path: rewrite(path, lambda t, m: m.update({"tensor_names": "[" * 100_000 + "]" * 100_000})),
        "its tensors are not the DiT's"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_saved_dit_is_never_used_and_is_made_again(load, caplog, damage):
    spoil, reason = DAMAGES[damage]
    first = load()
    spoil(checkpoint(load))
    with caplog.at_level(logging.WARNING):
        again = load()  # reads the bf16 DiT and quantizes again
    assert reason in caplog.text and "quantizing again" in caplog.text
    assert f"the saved quantized DiT {checkpoint(load).parent}" in caplog.text  # the entry, named
    assert torch.equal(sample(make_model_patcher(first, whole=True)), sample(make_model_patcher(again, whole=True)))
    load(read=False)  # and saved it again, whole


def test_a_dit_saved_for_another_compute_dtype_is_made_again(load, caplog):
    load()
    record = checkpoint(load).parent / RECORD
    saved = json.loads(record.read_text())
    record.write_text(json.dumps({**saved, "versions": {**saved["versions"], "dtype": "float32"}}))
    with caplog.at_level(logging.WARNING):
        load()
    assert "cannot be used (it was made for float8_weight_only with" in caplog.text


def test_a_link_in_place_of_the_saved_dit_is_not_followed(load, caplog, tmp_path):
    """A symbolic link planted in place of the saved folder made every load quantize again (its removal and the
    rename onto it failed, silently): the link alone is removed, in words, and the DiT saved there for the next
    load."""
    load()
    entry = checkpoint(load).parent
    elsewhere = tmp_path / "elsewhere"
    entry.rename(elsewhere)
    entry.symlink_to(elsewhere, target_is_directory=True)
    with caplog.at_level(logging.WARNING):
        load()
    assert f"the saved quantized DiT {entry} cannot be used (it is a symbolic link, which the pack does not follow " \
           f"in {load.root}); quantizing again" in caplog.text
    assert entry.is_dir() and not entry.is_symlink() and (elsewhere / RECORD).is_file()  # what it pointed to stays
    load(read=False)


@pytest.fixture
def interrupt_at(monkeypatch):
    """``interrupt_at(module, name, n)``: the user presses Cancel (ComfyUI's interrupt) during the ``n``-th call of
    ``module.name``; returns the list of calls made, each noting whether Cancel had been pressed before it. Later
    calls (the next prompt's) run as they are."""
    import comfy.model_management as mm

    def install(module, name: str, n: int) -> list[bool]:
        calls, original = [], getattr(module, name)

        def counted(*args, **kwargs):
            calls.append(len(calls) >= n)
            if len(calls) == n:
                mm.interrupt_current_processing(True)
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
        return calls

    yield install
    mm.interrupt_current_processing(False)


def test_cancel_while_the_saved_dit_is_read_stops_within_one_tensor_and_keeps_it(load, interrupt_at):
    import comfy.model_management as mm

    load()
    calls = interrupt_at(torchao_file, "read_safetensors", 5)
    with pytest.raises(mm.InterruptProcessingException):
        load(read=False)
    assert len(calls) == 5 and sum(calls) == 0  # not one tensor more was read after Cancel
    load(read=False)  # the entry is kept (Cancel is no damage) and the next prompt reads it


def test_cancel_while_the_quantized_dit_is_saved_leaves_no_entry(load, interrupt_at):
    import comfy.model_management as mm

    calls = interrupt_at(torchao_file, "write", 1)  # Cancel as the save starts
    written = interrupt_at(torchao_file, "save_file", 10**6)
    with pytest.raises(mm.InterruptProcessingException):
        load()
    assert len(calls) == 1 and written == []  # stopped before its first tensor
    assert list(load.root.iterdir()) == []  # no entry, no .partial folder
    load()
    load(read=False)  # the next prompt quantizes and saves it whole


def test_cancel_while_quantizing_block_by_block_stops_before_the_next_block(tiny_models, monkeypatch):
    """The block-by-block quantize (a card that holds one block) asks for Cancel before each block. cache-dit's
    torchao path refuses the CPU, so a stand-in for its ``quantize`` counts the blocks and the user presses Cancel
    during the third."""
    import cache_dit
    import comfy.model_management as mm

    quantized = []

    def stand_in_quantize(block, config):
        quantized.append(mm.processing_interrupted())
        if len(quantized) == 3:
            mm.interrupt_current_processing(True)
        return block

    monkeypatch.setattr(cache_dit, "quantize", stand_in_quantize)
    dit = load_dit(tiny_models["snapshot"], DTYPE, DTYPE)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            quantize.quantize_torchao(dit, FP8_TYPE, torch.device("cpu"), per_block=True)
    finally:
        mm.interrupt_current_processing(False)
    assert len(quantized) == 3 and not any(quantized) and len(dit.layers) > 3
