"""GGUF DiT files, good and hostile, through the DiT loader node a user picks them with: listed under the one
model-choice grammar, loaded by their tensor names whatever ``general.architecture`` says, and each bad one refused
in words (the file, the first bad tensor, what to do): a bad header before any weight is read, a bad value
before the model is given out; Cancel stops a load within a tensor.

The files are written with the ``gguf`` package (``scripts.gguf_writer``), the hostile headers byte by byte. Loads
that a reader without bounds would turn into an endless loop or a memory bomb run in a capped child process with a
timeout (``helpers.bounded``), which also measures what reading a heavy header costs in memory.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import time

import comfy.model_management as mm
import gguf
import numpy as np
import pytest
import torch

from comfyui_ernie_image.nodes.dit.gguf import build_gguf_dit, read_gguf_dit
from comfyui_ernie_image.nodes.dit.weights import MAX_BLOCKS
from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.gguf.header import HeaderError, walk_header
from comfyui_ernie_image.nodes.gguf.reader import GGUFTensor, read_gguf
from comfyui_ernie_image.nodes.host.gguf_layers import GGUFModelPatcher
from comfyui_ernie_image.nodes.loaders import DIT_MODELS, ErnieImageDiTLoader
from helpers.bounded import run_bounded
from helpers.files import replace_bytes
from helpers.gguf_files import (
    f32_gguf,
    gguf_string,
    one_blob_gguf,
    raw_header,
    scale_offset,
    set_tensor_offset,
    set_tensor_type,
    tensor_offset,
)
from scripts.gguf_writer import mixed_kind, uniform_kind, write_gguf
from scripts.tiny_models import tiny_dit_state

FLUX_NAMES = ("double_blocks.0.img_attn.qkv.weight", "double_blocks.0.img_mlp.0.weight", "img_in.weight")


@pytest.fixture(scope="module")
def state():
    return tiny_dit_state()


def load(name: str, weight_dtype: str = "default", quantization: str = "none"):
    """What ComfyUI runs for an ``ErnieImageDiTLoader`` node."""
    return ErnieImageDiTLoader.execute(name, weight_dtype, quantization).result[0]


def placed_gguf(placed, name: str, tensors, kind=mixed_kind, **options):
    """``tensors`` as a GGUF file among the diffusion models: its path."""
    return write_gguf(placed("diffusion_models", name), tensors, kind, **options)


def listed(path) -> str:
    return f"diffusion_models/{path.name}"


@pytest.mark.parametrize("arch, prefix", [("flux", ""), ("wan", "model.diffusion_model."), ("pig", "")])
def test_an_ernie_gguf_loads_by_its_tensor_names_whatever_its_architecture_says(placed, state, caplog, arch, prefix):
    name = listed(placed_gguf(placed, f"ernie-image-tiny-{arch}.gguf", state, arch=arch, prefix=prefix))
    assert name in DIT_MODELS.options() and DIT_MODELS.check(name) is True
    with caplog.at_level(logging.INFO):
        model = load(name, "fp32")
    assert isinstance(model, GGUFModelPatcher)
    dit = model.model.diffusion_model
    assert dit.gguf_types == {"Q4_K", "Q5_K", "Q6_K"} and dit.precision.compute == torch.float32
    assert f"says general.architecture '{arch}'; its tensors are ERNIE-Image's" in caplog.text
    assert re.search(r"linear layers held as GGUF blocks \(52 Q4_K, 1 Q5_K, 20 Q6_K\), [\d.]+ MiB in all "
                     r"\([\d.]+ MiB in bf16\)", caplog.text)


def test_the_loaders_quantization_and_fp8_storage_are_refused_for_a_gguf(placed, state):
    name = listed(placed_gguf(placed, "ernie-image-tiny-refused.gguf", state))
    with pytest.raises(ErnieImageError, match="quantization fp8_per_row quantizes bf16 weights at load, but a GGUF "
                       "file is quantized already .*set quantization to none"):
        load(name, "default", "fp8_per_row")
    with pytest.raises(ErnieImageError, match="weight_dtype fp8_e4m3fn stores the weights in fp8, but a GGUF file "
                       "keeps its own types: set weight_dtype to default, bf16 or fp32"):
        load(name, "fp8_e4m3fn")


def _without(state, key):
    return {k: v for k, v in state.items() if k != key}


def _reshaped(state, key, shape):
    return {**state, key: torch.zeros(shape)}


HOSTILE = {
    "another model's names": (
        lambda s: {name: torch.zeros(64, 256) for name in FLUX_NAMES},
        r"is not an ERNIE-Image diffusion model \(it looks like a Flux model\)"),
    "a missing block tensor": (
        lambda s: _without(s, "layers.9.mlp.linear_fc2.weight"),
        r"is not a whole ERNIE-Image DiT: layers\.9\.mlp\.linear_fc2\.weight is missing \(block 0 has it\)"),
    "a missing tensor": (
        lambda s: _without(s, "final_norm.linear.bias"),
        r"is not a whole ERNIE-Image DiT: final_norm\.linear\.bias is missing"),
    "a wrong shape": (
        lambda s: _reshaped(s, "time_embedding.linear_1.weight", (64, 32)),
        r"does not fit the ERNIE-Image DiT: time_embedding\.linear_1\.weight has shape \[64, 32\], the ERNIE-Image "
        r"DiT needs \[64, 64\]"),
    "a wrong block shape": (
        lambda s: _reshaped(s, "layers.4.mlp.up_proj.weight", (256, 64)),
        r"does not fit a ERNIE-Image DiT: layers\.4\.mlp\.up_proj\.weight has shape \[256, 64\], block 0's has "
        r"\[128, 64\]"),
    "a block past the cap": (
        lambda s: {**s, "layers.300.adaLN_sa_ln.weight": torch.ones(64)},
        r"declares block 300 \(layers\.300\.adaLN_sa_ln\.weight\): a ERNIE-Image DiT has at most 256 blocks"),
    "a tensor another DiT has": (
        lambda s: {**s, **{f"layers.{i}.self_attention.to_q.bias": torch.zeros(64) for i in range(10)}},
        r"holds layers\.0\.self_attention\.to_q\.bias \(and 9 more\), which the ERNIE-Image DiT does not have"),
}


@pytest.mark.parametrize("attack", list(HOSTILE))
def test_a_file_that_is_not_a_whole_ernie_dit_is_refused_by_its_header(placed, state, attack):
    change, words = HOSTILE[attack]
    with pytest.raises(ErnieImageError, match=words) as raised:
        load(listed(placed_gguf(placed, "hostile.gguf", change(state))))
    message = str(raised.value)
    assert "hostile.gguf" in message and ("Download it again" in message or "Pick ernie-image" in message)


@pytest.mark.parametrize("value, words", [(0x7C00, "inf"), (0x7E00, "nan"), (0xFC00, "-inf")])
def test_a_non_finite_block_scale_is_refused_naming_the_tensor(placed, state, value, words):
    path = placed_gguf(placed, "non-finite-scale.gguf", state, uniform_kind("Q4_K"))
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, scale_offset(path, "layers.2.mlp.up_proj.weight") + 144, value)  # block 1's d
    replace_bytes(path, bytes(data))
    with pytest.raises(ErnieImageError, match=rf"non-finite-scale\.gguf: the fp16 block scale at byte 0 of block 1 of "
                       rf"layers\.2\.mlp\.up_proj\.weight is {words}; a weight must be made of finite numbers"):
        load(listed(path))


def test_a_non_finite_plain_value_is_refused(placed, state):
    bad = {**state, "final_norm.linear.bias": torch.full((128,), float("nan"))}
    with pytest.raises(ErnieImageError, match=r"final_norm\.linear\.bias holds NaN or infinite values"):
        load(listed(placed_gguf(placed, "nan-bias.gguf", bad)))


def test_a_type_the_pack_does_not_read_is_named_with_advice(placed, state):
    """TQ2_0 (BitNet's ternary type: llama.cpp reads it, ComfyUI-GGUF does not)."""
    name = listed(placed_gguf(placed, "tq2_0.gguf", state, lambda n, v: "F32" if v.ndim == 1 else
                              ("TQ2_0" if "to_k" in n else "Q8_0")))
    with pytest.raises(ErnieImageError, match=r"tq2_0\.gguf stores layers\.0\.self_attention\.to_k\.weight as TQ2_0 "
                       r"\(and 9 more tensors in types it cannot read\), a GGUF type this pack does not read\. The "
                       r"pack reads the GGUF types Q8_0, Q6_K, Q5_1, Q5_K, Q5_0, Q4_1, Q4_K, IQ4_NL, Q4_0, IQ4_XS, "
                       r"Q3_K and Q2_K"):
        load(name)


def test_a_type_number_gguf_does_not_know_is_refused(placed, state):
    path = placed_gguf(placed, "type-99.gguf", state)
    set_tensor_type(path, "layers.0.mlp.gate_proj.weight", 99)
    with pytest.raises(ErnieImageError, match=r"stores layers\.0\.mlp\.gate_proj\.weight in type number 99, which no "
                       r"GGUF type of the installed gguf package \(0\.\d+\.\d+\) is"):
        load(listed(path))


def test_a_truncated_or_foreign_file_is_refused_in_words(placed, state, tiny_models):
    path = placed_gguf(placed, "truncated.gguf", state)
    replace_bytes(path, path.read_bytes()[:-5000])
    with pytest.raises(ErnieImageError, match=r"Cannot read .*truncated\.gguf as a GGUF file: it declares the tensor "
                       r"\S+ at bytes the file does not have \(it is truncated: an interrupted download\?\)"):
        load(listed(path))
    renamed = placed("diffusion_models", "safetensors-renamed.gguf")
    renamed.write_bytes(tiny_models["single_file"].read_bytes())
    with pytest.raises(ErnieImageError, match=r"it declares no GGUF signature"):
        load("diffusion_models/safetensors-renamed.gguf")


def test_a_file_cut_short_or_gone_after_its_header_was_read_is_refused_in_words(placed, state):
    """The file changes between the header's checks and the reading of its data (a download still running, say)."""
    path = placed_gguf(placed, "cut-later.gguf", state)
    tensors, config = read_gguf_dit(path)
    replace_bytes(path, path.read_bytes()[:-5000])
    with pytest.raises(ErnieImageError, match=r"Cannot read .*cut-later\.gguf as a GGUF file: it declares \d+ bytes "
                       r"of data at byte \d+, but it ends after \d+\. The file is damaged"):
        build_gguf_dit(tensors, config, torch.float32)
    path.unlink()
    with pytest.raises(ErnieImageError, match=r"Cannot read .*cut-later\.gguf \(\[Errno 2\] No such file or directory"
                       r".*\)\. Check the file, or download it again\."):
        build_gguf_dit(tensors, config, torch.float32)


def test_an_original_shape_that_does_not_fit_is_refused(placed, state):
    def lie(writer):
        writer.add_array("comfy.gguf.orig_shape.layers.0.mlp.up_proj.weight", [128, 65])

    name = listed(placed_gguf(placed, "orig-shape.gguf", state, extra=lie))
    with pytest.raises(ErnieImageError, match=r"declares comfy\.gguf\.orig_shape\.layers\.0\.mlp\.up_proj\.weight = "
                       r"\[128, 65\] for a tensor of 8192 values"):
        load(name)


def test_without_the_gguf_package_the_loader_says_how_to_install_it(placed, state, monkeypatch):
    name = listed(placed_gguf(placed, "no-package.gguf", state))
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # ``import gguf`` raises ImportError
    with pytest.raises(ErnieImageError, match=r"needs the gguf package.*`pip install gguf`"):
        load(name)


# Headers made to hang or exhaust a reader without bounds: an array said to hold 2^60 items (gguf.GGUFReader alone
# loops for ever on it: each read past the end is empty), 2^40 tensors, a 2^60-byte string, a tensor of 2^62 values.
BOMBS = {
    "endless-array.gguf": (raw_header(gguf_string("x") + struct.pack("<IIQ", 9, 0, 1 << 60), field_count=1),
                           "arrays of more than 1048576 items in all"),
    "many-tensors.gguf": (raw_header(tensor_count=1 << 40),
                          "1099511627776 tensors and 0 fields (a model file has at most 65536 of each)"),
    "long-string.gguf": (raw_header(gguf_string("x") + struct.pack("<IQ", 8, 1 << 60), field_count=1),
                         "a string of 1152921504606846976 bytes, more than the"),
    "huge-tensor.gguf": (raw_header(gguf_string("layers.0.adaLN_sa_ln.weight") + struct.pack("<I", 2)
                                    + struct.pack("<QQIQ", 1 << 31, 1 << 31, 0, 0), tensor_count=1),
                         "the tensor layers.0.adaLN_sa_ln.weight of 4611686018427387904 values"),
}
_EACH = """
messages = []
for name in {names!r}:
    try:
        ErnieImageDiTLoader.execute("diffusion_models/" + name, "default", "none")
    except ErnieImageError as error:
        messages.append(str(error))
raise ErnieImageError(" | ".join(messages))
"""


def test_a_header_made_to_hang_or_exhaust_memory_is_refused_at_once(placed):
    """In one child process capped at 512 MiB above its imports, with a timeout: each refused in words."""
    folder = None
    for name, (data, _) in BOMBS.items():
        path = placed("diffusion_models", name)
        path.write_bytes(data)
        folder = path.parent
    report = run_bounded(_EACH.format(names=list(BOMBS)), folders={"diffusion_models": folder}, timeout_s=90,
                         setup="from comfyui_ernie_image.nodes.loaders import ErnieImageDiTLoader\n"
                               "from comfyui_ernie_image.nodes.errors import ErnieImageError")
    assert report["outcome"] == "ErnieImageError", report
    messages = report["message"].split(" | ")
    assert len(messages) == len(BOMBS), report
    for message, (name, (_, words)) in zip(messages, BOMBS.items(), strict=True):
        assert name in message and words in message and "download it again" in message, message
    assert report["rss_growth_mb"] < 50, report


def _deep(state, blocks: int = MAX_BLOCKS) -> dict[str, torch.Tensor]:
    """The tiny DiT with ``blocks`` blocks, block i a copy of block i % 10: as many tensors as a DiT file may have."""
    rest = {k: v for k, v in state.items() if not k.startswith("layers.")}
    block = {k.split(".", 2)[2]: v for k, v in state.items() if k.startswith("layers.0.")}
    return {**rest, **{f"layers.{i}.{k}": v for i in range(blocks) for k, v in block.items()}}


def _counted_reads(monkeypatch, after_read=lambda count: None) -> list[int]:
    """Where each tensor the loader reads from now on lies, in order; ``after_read(count)`` runs after each read."""
    reads, read = [], GGUFTensor.read

    def counted(tensor):
        data = read(tensor)
        reads.append(tensor.offset)
        after_read(len(reads))
        return data

    monkeypatch.setattr(GGUFTensor, "read", counted)
    return reads


def test_tensors_that_share_bytes_are_refused_before_any_is_read(placed, state, monkeypatch):
    """Issue 41's memory bomb: every tensor of a 256-block DiT at one blob (a 0.3 MiB file declaring 40 MiB here)."""
    reads = _counted_reads(monkeypatch)
    blob = one_blob_gguf(placed("diffusion_models", "one-blob.gguf"), {k: tuple(v.shape) for k, v in
                                                                        _deep(state).items()})
    with pytest.raises(ErnieImageError, match=r"one-blob\.gguf as a GGUF file: it declares tensors of \d+ bytes in "
                       r"all, more than the \d+ bytes of data it holds, which no GGUF writer makes \(each tensor has "
                       r"bytes of its own\)\. The file is damaged or was crafted to exhaust memory: download it again"):
        load(listed(blob))
    shared = placed_gguf(placed, "shared-bytes.gguf", state)
    to_q = tensor_offset(shared, "layers.2.self_attention.to_q.weight")
    set_tensor_offset(shared, "layers.3.mlp.up_proj.weight", to_q)
    with pytest.raises(ErnieImageError, match=r"shared-bytes\.gguf as a GGUF file: it declares the tensors "
                       r"layers\.2\.self_attention\.to_q\.weight and layers\.3\.mlp\.up_proj\.weight in the same bytes "
                       r"\(bytes \d+ to \d+ of the data\), which no GGUF writer makes .* crafted to exhaust memory"):
        load(listed(shared))
    long_names = f32_gguf(placed("diffusion_models", "long-names.gguf"),
                          {"a" * 60_000: ((64,), 0), "b" * 60_000: ((64,), 128)}, 512)
    with pytest.raises(ErnieImageError, match=r"the tensors a{200}… \(60000 characters\) and b{200}… \(60000 "
                       r"characters\) in the same bytes") as raised:
        load(listed(long_names))
    assert len(str(raised.value)) < 1000 and not reads


# Headers within the caps that gguf.GGUFReader took seconds and gigabytes over (issue 41), one field each.
HEAVY = {
    "empty-strings.gguf": struct.pack("<IIQ", 9, 8, 1 << 20) + bytes(8 << 20),
    "nested-arrays.gguf": struct.pack("<IIQ", 9, 9, 1000) + (struct.pack("<IQ", 5, 1000) + bytes(4000)) * 1000,
    "byte-array.gguf": struct.pack("<IIQ", 9, 0, 1 << 20) + bytes(1 << 20),
}
_EACH_MEASURED = """
from pathlib import Path
growth = {{}}
for name in {names!r}:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = status("VmRSS")
    read_gguf(Path({folder!r}) / name)
    growth[name] = status("VmHWM") - start
raise ErnieImageError(json.dumps(growth))
"""


def test_a_heavy_header_within_the_caps_is_read_in_memory_below_twice_its_size(placed):
    """Each header read in a child process capped at 512 MiB: its peak resident memory grows by less than twice the
    header's bytes (the file's pages the walk touches count too)."""
    sizes = {}
    for name, field in HEAVY.items():
        path = placed("diffusion_models", name)
        path.write_bytes(raw_header(gguf_string("heavy") + field, field_count=1))
        sizes[name] = path.stat().st_size
    warm = placed("diffusion_models", "warm.gguf")
    warm.write_bytes(raw_header(gguf_string("light") + struct.pack("<IIQ", 9, 8, 1) + gguf_string("x"), field_count=1))
    report = run_bounded(_EACH_MEASURED.format(names=list(HEAVY), folder=str(warm.parent)),
                         folders={"diffusion_models": warm.parent}, timeout_s=120,
                         setup="import json\nfrom comfyui_ernie_image.nodes.errors import ErnieImageError\n"
                               "from comfyui_ernie_image.nodes.gguf.reader import read_gguf\n"
                               f"read_gguf(__import__('pathlib').Path({str(warm)!r}))")
    assert report["outcome"] == "ErnieImageError", report
    growth = json.loads(report["message"])
    for name, size in sizes.items():
        print(f"{name}: {size / 2**20:.2f} MiB header, peak RSS +{growth[name] / 2**20:.2f} MiB")
        assert growth[name] < 2 * size, (name, growth[name], size)


def test_a_tokenizer_within_the_caps_is_skipped_by_the_loader_and_read_on_demand_bounded(placed):
    """A Ministral text encoder's tokenizer (131,072 tokens and their merges): what a later reader asks for."""
    tokens = [f"tok{i}" for i in range(131_072)]
    merges = [f"t ok{i}" for i in range(100_000)]

    def tokenizer(writer):
        writer.add_array("tokenizer.ggml.tokens", tokens)
        writer.add_array("tokenizer.ggml.token_type", [1] * len(tokens))
        writer.add_array("tokenizer.ggml.merges", merges)

    path = write_gguf(placed("text_encoders", "ministral-tokenizer.gguf"), {"output_norm.weight": torch.ones(64)},
                      mixed_kind, arch="mistral3", extra=tokenizer)
    assert read_gguf(path).architecture == "mistral3"
    sizes = {int(kind): size for kind, size in gguf.GGML_QUANT_SIZES.items()}
    header = walk_header(path, sizes, lambda key: key.startswith("tokenizer."))
    assert header.field("tokenizer.ggml.tokens", 4 << 20) == tokens
    assert header.field("tokenizer.ggml.merges", 4 << 20) == merges
    token_type = header.field("tokenizer.ggml.token_type", 4 << 20)
    assert token_type.dtype == np.int32 and token_type.tolist() == [1] * len(tokens)
    assert header.field("general.architecture", 4 << 20) is None  # not asked for
    with pytest.raises(HeaderError, match=r"the field tokenizer\.ggml\.tokens of \d+ bytes \(at most 65536 are read "
                       r"of it\)"):
        header.field("tokenizer.ggml.tokens", 1 << 16)


def test_a_big_endian_gguf_is_refused_by_name(placed, state):
    """Written by the gguf package's writer for big-endian machines: every number in it byte-swapped."""
    path = placed_gguf(placed, "big-endian.gguf", state, endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ErnieImageError, match=rf"^{re.escape(str(path))} is a big-endian GGUF; this pack reads "
                       r"little-endian files: convert it with the gguf package's `gguf-convert-endian "
                       r".*big-endian\.gguf little` .* or download the little-endian file\.$"):
        load(listed(path))


def test_cancel_stops_a_gguf_load_within_one_tensor_and_the_next_load_runs(placed, state, monkeypatch):
    """A DiT file of 256 blocks (2,829 tensors, 7 MiB): Cancel pressed as the tenth tensor is read."""
    path = placed_gguf(placed, "ernie-image-256-blocks.gguf", _deep(state))
    reads = _counted_reads(monkeypatch, lambda count: count == 10 and mm.interrupt_current_processing(True))
    try:
        with pytest.raises(mm.InterruptProcessingException):
            load(listed(path))
    finally:
        mm.interrupt_current_processing(False)
    interrupted, start = len(reads), time.perf_counter()
    assert interrupted <= 11, interrupted  # the one in hand at most
    assert isinstance(load(listed(path)), GGUFModelPatcher)
    print(f"uninterrupted: {len(reads) - interrupted} tensors read in {time.perf_counter() - start:.1f} s")
    assert len(reads) - interrupted == len(_deep(state)) > 2800
