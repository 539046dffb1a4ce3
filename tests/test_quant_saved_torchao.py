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
from comfyui_ernie_image.nodes.quant import quantize
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
        "is not an fp8"),
    "an extra tensor": (lambda path: rewrite(path, lambda t, m: t.update({"extra": torch.zeros(2)})), "other tensors"),
    "a weight missing": (lambda path: rewrite(path, lambda t, m: t.pop(_qdata(t))), "is not an fp8"),
    "another type named": (
        lambda path: rewrite(path, lambda t, m: m.update({next(iter(json.loads(m["tensor_names"]))):
                                                          json.dumps({"_type": "os.system"})})), "described as"),
}


@pytest.mark.parametrize("damage", DAMAGES, ids=list(DAMAGES))
def test_a_damaged_saved_dit_is_never_used_and_is_made_again(load, caplog, damage):
    spoil, reason = DAMAGES[damage]
    first = load()
    spoil(checkpoint(load))
    with caplog.at_level(logging.WARNING):
        again = load()  # reads the bf16 DiT and quantizes again
    assert reason in caplog.text and "quantizing again" in caplog.text
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
