"""The saved quantized DiTs' folder on its own, as SVDQuant uses it (``quant_config.json`` beside each checkpoint):
entries are found again, and stale, damaged or half-written ones are never used. Then the real cache-dit round trip
through it (quantize + serialize_to, then cache_dit.load) on the CPU."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_ernie_image.nodes.dit.build import load_dit
from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.quant.quantize import load_or_build_svdq
from comfyui_ernie_image.nodes.quant.saved import QUANT_CONFIG, RECORD, SavedDiTs, source_identity

METHOD = "svdq_int4_r32_dq"
VERSIONS = {"cache_dit": "1.5.3"}


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "models" / "ernie-image-turbo.safetensors"
    path.parent.mkdir()
    save_file({"w": torch.ones(4, 4)}, str(path))
    return path


@pytest.fixture
def cache(tmp_path):
    return SavedDiTs(tmp_path / "ernie_quantized", beside=(QUANT_CONFIG,))


def write_like_cache_dit(folder, method=METHOD) -> None:
    """The two files cache-dit's ``serialize_to`` leaves in a folder."""
    save_file({"layers.0.qweight": torch.zeros(8, 8, dtype=torch.int8)}, str(folder / f"{method}.safetensors"))
    (folder / "quant_config.json").write_text(json.dumps({"quant_type": method}))


def build(cache, source, versions=VERSIONS):
    with cache.build(source, METHOD, versions) as folder:
        write_like_cache_dit(folder)
    return cache.entry(source, METHOD)


def test_a_built_entry_is_found_again(cache, source):
    assert cache.lookup(source, METHOD, VERSIONS) is None
    assert cache.problem(source, METHOD, VERSIONS) == "there is no saved copy"
    entry = build(cache, source)
    assert entry.parent == cache.root and entry.name.startswith("ernie-image-turbo-") and entry.name.endswith(METHOD)
    assert cache.lookup(source, METHOD, VERSIONS) == entry
    record = json.loads((entry / RECORD).read_text())
    assert record["source"] == source_identity(source) and record["versions"] == VERSIONS
    assert sorted(p.name for p in cache.root.iterdir()) == [entry.name]  # no partial folder left


def test_each_source_and_method_has_its_own_entry(cache, source, tmp_path):
    other = tmp_path / "elsewhere" / source.name
    other.parent.mkdir()
    other.write_bytes(source.read_bytes())
    entries = {cache.entry(source, METHOD), cache.entry(other, METHOD), cache.entry(source, "svdq_int4_r128_dq")}
    assert len(entries) == 3


def test_changed_source_weights_make_the_entry_stale(cache, source):
    entry = build(cache, source)
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # the same bytes, re-downloaded
    assert cache.problem(source, METHOD, VERSIONS) == "the source weights changed since it was made"
    assert cache.lookup(source, METHOD, VERSIONS) is None
    assert not entry.exists()


def test_another_cache_dit_version_makes_the_entry_stale(cache, source):
    entry = build(cache, source)
    newer = {"cache_dit": "1.6.0"}
    assert cache.problem(source, METHOD, newer) == (
        f"it was made for {METHOD} with {{'cache_dit': '1.5.3'}}, not {{'cache_dit': '1.6.0'}}"
    )
    assert cache.lookup(source, METHOD, newer) is None and not entry.exists()


def _truncate(entry):
    checkpoint = entry / f"{METHOD}.safetensors"
    checkpoint.write_bytes(checkpoint.read_bytes()[:-10])


def _scramble_header(entry):
    checkpoint = entry / f"{METHOD}.safetensors"
    data = checkpoint.read_bytes()
    checkpoint.write_bytes(b"\xff" * 16 + data[16:])


@pytest.mark.parametrize("damage, reason", [
    (_truncate, f"{METHOD}.safetensors is damaged (its size changed)"),
    (_scramble_header, "it is damaged ("),
    (lambda entry: (entry / f"{METHOD}.safetensors").unlink(), f"{METHOD}.safetensors is missing"),
    (lambda entry: (entry / "quant_config.json").unlink(), "quant_config.json is missing"),
    (lambda entry: (entry / "quant_config.json").write_text("{not json"), "it is damaged ("),
    (lambda entry: (entry / RECORD).write_text("[]"), f"its record {RECORD} is missing or unreadable"),
    (lambda entry: (entry / RECORD).unlink(), f"its record {RECORD} is missing or unreadable"),
])
def test_a_damaged_entry_is_removed(cache, source, damage, reason):
    entry = build(cache, source)
    damage(entry)
    assert cache.problem(source, METHOD, VERSIONS).startswith(reason)
    assert cache.lookup(source, METHOD, VERSIONS) is None
    assert not entry.exists()
    assert build(cache, source) == entry and cache.lookup(source, METHOD, VERSIONS) == entry


def test_an_interrupted_build_leaves_nothing_that_looks_finished(cache, source):
    with pytest.raises(KeyboardInterrupt):
        with cache.build(source, METHOD, VERSIONS) as folder:
            write_like_cache_dit(folder)
            raise KeyboardInterrupt
    assert list(cache.root.iterdir()) == []
    # A process killed mid-build leaves its partial folder: a later build removes it once it is an hour old; a
    # newer one may be another ComfyUI's build in progress (they share the models folder), left alone.
    name = cache.entry(source, METHOD).name
    stale, running = cache.root / f".{name}.1-1.partial", cache.root / f".{name}.2-2.partial"
    for partial in (stale, running):
        partial.mkdir()
        (partial / "part.bin").write_bytes(b"x")
    hours_ago = time.time() - 7200
    for path in (stale / "part.bin", stale):
        os.utime(path, (hours_ago, hours_ago))
    entry = build(cache, source)
    assert not stale.exists() and running.exists() and not (entry / "part.bin").exists()


def test_a_build_without_a_checkpoint_is_an_error(cache, source):
    with pytest.raises(ErnieImageError, match=f"No {METHOD}.safetensors was written into"):
        with cache.build(source, METHOD, VERSIONS):
            pass
    assert list(cache.root.iterdir()) == []


def test_an_unwritable_cache_folder_says_so(tmp_path, source):
    blocked = tmp_path / "ernie_quantized"
    blocked.write_text("a file where the folder should be")
    with pytest.raises(ErnieImageError, match=r"Cannot write the quantized DiT to .*ernie_quantized .* writable"):
        build(SavedDiTs(blocked, beside=(QUANT_CONFIG,)), source)


def test_a_snapshot_is_identified_by_its_transformer_files(tmp_path):
    snapshot = tmp_path / "ERNIE-Image-Turbo"
    (snapshot / "transformer").mkdir(parents=True)
    (snapshot / "vae").mkdir()
    (snapshot / "model_index.json").write_text("{}")
    (snapshot / "transformer" / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, str(snapshot / "transformer" / "diffusion_pytorch_model.safetensors"))
    save_file({"w": torch.ones(2)}, str(snapshot / "vae" / "diffusion_pytorch_model.safetensors"))
    before = source_identity(snapshot)
    assert [f[0] for f in before["files"]] == ["config.json", "diffusion_pytorch_model.safetensors"]
    save_file({"w": torch.zeros(3)}, str(snapshot / "vae" / "diffusion_pytorch_model.safetensors"))
    assert source_identity(snapshot) == before  # another part of the snapshot: the saved DiT stays valid
    (snapshot / "transformer" / "config.json").write_text('{"num_layers": 36}')
    assert source_identity(snapshot) != before


# --- the real cache-dit files ----------------------------------------------------------------------------------------

@pytest.fixture
def svdq_without_kernels(monkeypatch):
    """cache-dit's ``QuantizeConfig`` refuses SVDQuant unless its CUDA kernels import, although its dynamic
    quantization, serialization and loading are plain torch that runs on the CPU (only the forward needs the
    kernels). Let the config be built here, so the files this pack saves and reloads are cache-dit's own."""
    from cache_dit.quantization.backend import QuantizeBackend

    monkeypatch.setattr(QuantizeBackend, "is_supported", classmethod(lambda cls, backend: True))


@pytest.fixture
def tiny_dit_file(tmp_path):
    from diffusers import ErnieImageTransformer2DModel

    from scripts.tiny_models import TINY_DIT, save_dit_single_file

    torch.manual_seed(0)
    return save_dit_single_file(ErnieImageTransformer2DModel(**{**TINY_DIT, "num_layers": 2}),
                                tmp_path / "ernie-tiny.safetensors")


def test_svdquant_dit_is_saved_reloaded_and_rebuilt_when_stale(svdq_without_kernels, tiny_dit_file, cache):
    import cache_dit
    from cache_dit.quantization import SVDQW4A4Linear

    def load():
        return load_dit(tiny_dit_file, torch.bfloat16)

    def quantized():
        return load_or_build_svdq(load, METHOD, source=tiny_dit_file, device=torch.device("cpu"), cache=cache)

    def saved_stamp():
        return (cache.entry(tiny_dit_file, METHOD) / f"{METHOD}.safetensors").stat().st_mtime_ns

    built = quantized()
    assert all(isinstance(block.mlp.gate_proj, SVDQW4A4Linear) for block in built.layers)
    for high_precision in (built.text_proj, built.adaLN_modulation[1], built.final_linear):
        assert isinstance(high_precision, torch.nn.Linear) and not isinstance(high_precision, SVDQW4A4Linear)
        assert high_precision.weight.dtype == torch.bfloat16
    stamp = saved_stamp()

    reloaded = quantized()
    assert saved_stamp() == stamp  # read back, not quantized again
    for name, tensor in built.layers[1].self_attention.to_q.state_dict().items():
        assert torch.equal(tensor, reloaded.layers[1].self_attention.to_q.state_dict()[name]), name

    entry = cache.entry(tiny_dit_file, METHOD)
    (entry / "quant_config.json").write_text(json.dumps({**json.loads((entry / "quant_config.json").read_text()),
                                                         "quant_type": "svdq_int4_r128_dq"}))
    assert isinstance(quantized().layers[0].mlp.up_proj, SVDQW4A4Linear)  # cache_dit.load refused it: rebuilt
    assert saved_stamp() != stamp and cache.lookup(tiny_dit_file, METHOD, {"cache_dit": cache_dit.__version__})
    stamp = saved_stamp()

    stat = tiny_dit_file.stat()
    os.utime(tiny_dit_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    quantized()
    assert saved_stamp() != stamp  # the source changed: quantized again


def test_a_link_in_place_of_an_entry_is_removed_not_followed(cache, source, tmp_path):
    """A symbolic link planted in place of an entry made every load quantize again: its removal and the rename onto
    it failed silently. The link alone goes (what it points to stays), and the next build saves a real entry."""
    entry = build(cache, source)
    elsewhere = tmp_path / "elsewhere"
    entry.rename(elsewhere)
    entry.symlink_to(elsewhere, target_is_directory=True)
    assert cache.problem(source, METHOD, VERSIONS) == (
        f"it is a symbolic link, which the pack does not follow in {cache.root}")
    assert cache.lookup(source, METHOD, VERSIONS) is None
    assert not entry.is_symlink() and (elsewhere / RECORD).is_file()
    assert build(cache, source) == entry and cache.lookup(source, METHOD, VERSIONS) == entry
    (entry / QUANT_CONFIG).unlink()
    (entry / QUANT_CONFIG).symlink_to(elsewhere / QUANT_CONFIG)
    assert cache.problem(source, METHOD, VERSIONS) == (
        f"{QUANT_CONFIG} is a symbolic link, which the pack does not follow there")


def test_a_record_nested_deeply_is_unreadable_not_a_crash(cache, source):
    entry = build(cache, source)
    (entry / RECORD).write_text("[" * 100_000 + "]" * 100_000)
    assert cache.problem(source, METHOD, VERSIONS) == f"its record {RECORD} is missing or unreadable"


def _poison_checkpoint(entry) -> str:
    """A NaN in the first floating-point tensor of the saved checkpoint, its record's size kept true (a hostile
    edit); the tensor's name."""
    from safetensors import safe_open

    checkpoint = entry / f"{METHOD}.safetensors"
    with safe_open(str(checkpoint), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(checkpoint))
    name = next(k for k, v in tensors.items() if v.is_floating_point() and v.dtype.itemsize > 1)
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, str(checkpoint), metadata)
    record = json.loads((entry / RECORD).read_text())
    (entry / RECORD).write_text(json.dumps({**record, "checkpoint_bytes": checkpoint.stat().st_size}))
    return name


def test_a_saved_svdquant_dit_with_a_nan_is_made_again(svdq_without_kernels, tiny_dit_file, cache, caplog):
    """A NaN in a saved SVDQuant entry loaded unchecked (NaN images): each tensor is checked before
    ``cache_dit.load``, and the entry is removed, named, and made again."""
    def quantized():
        return load_or_build_svdq(lambda: load_dit(tiny_dit_file, torch.bfloat16), METHOD, source=tiny_dit_file,
                                  device=torch.device("cpu"), cache=cache)

    quantized()
    entry = cache.entry(tiny_dit_file, METHOD)
    name = _poison_checkpoint(entry)
    with caplog.at_level(logging.WARNING):
        rebuilt = quantized()
    assert (f"cannot load the saved SVDQuant DiT {entry} ({name} holds values that are not finite); quantizing "
            "again") in caplog.text
    assert all(torch.isfinite(t).all() for t in rebuilt.state_dict().values() if t.is_floating_point())
    saved = load_file(str(entry / f"{METHOD}.safetensors"))  # saved again, whole
    assert all(torch.isfinite(t).all() for t in saved.values() if t.is_floating_point() and t.dtype.itemsize > 1)


def test_cancel_while_svdquant_quantizes_stops_within_a_layer_and_leaves_no_entry(svdq_without_kernels, tiny_dit_file,
                                                                                 cache):
    """SVDQuant quantizes every layer in one cache-dit call (minutes at full size), which Cancel did not stop."""
    import cache_dit
    import comfy.model_management as mm
    from cache_dit.quantization.svdquant import ptq

    lookup, looked_up = ptq._get_named_submodule, []

    def counted(*args, **kwargs):
        looked_up.append(mm.processing_interrupted())
        if len(looked_up) == 3:
            mm.interrupt_current_processing(True)  # the user presses Cancel while the third layer is quantized
        return lookup(*args, **kwargs)

    def quantized():
        return load_or_build_svdq(lambda: load_dit(tiny_dit_file, torch.bfloat16), METHOD, source=tiny_dit_file,
                                  device=torch.device("cpu"), cache=cache)

    ptq._get_named_submodule = counted
    try:
        with pytest.raises(mm.InterruptProcessingException):
            quantized()
    finally:
        ptq._get_named_submodule = lookup
        mm.interrupt_current_processing(False)
    assert len(looked_up) == 3 and not any(looked_up)  # no layer started after Cancel
    assert list(cache.root.iterdir()) == []  # no entry and no .partial folder left
    quantized()  # the next prompt quantizes it whole
    assert cache.lookup(tiny_dit_file, METHOD, {"cache_dit": cache_dit.__version__}) is not None
