"""The text encoder from a GGUF file of llama.cpp's own converter: the embeddings of the same file dequantized into
ComfyUI's single-file layout, exactly; the tokenizer of its metadata giving the single file's ids; files of another
model, or with one layer's shape wrong, refused by name.

The fixture ``fixtures/gguf/ernie-image-text-encoder-tiny-Q8_0.gguf`` is the tiny text encoder (``tiny_models``,
seed 0, deterministic) converted by ``convert_hf_to_gguf.py --outtype q8_0`` of llama.cpp 0c1e57098 (the copy in the
llama-cpp-python 0.3.36 source distribution), with
``python -m scripts.tiny_ministral_gguf <that llama.cpp folder> tests/fixtures/gguf`` (the script says the one
answer it gives the converter: the tiny tokenizer's pre-tokenizer name). ``test_the_fixture_is_the_tiny_text_encoder``
checks it still holds the tiny model the tests make.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.gguf.dequant import BLOCKS
from comfyui_ernie_image.nodes.gguf.linear import GGUFBlockEmbedding, GGUFBlockLinear
from comfyui_ernie_image.nodes.text.encoder import ErnieTextEncoder
from helpers.gguf_files import (
    converter_permute,
    dequantized_twin,
    retyped,
    rewrite_gguf,
    set_tensor_offset,
    tensor_offset,
)
from helpers.reference import saved_image
from helpers.workflows import text_to_image

FIXTURE = Path(__file__).parent / "fixtures" / "gguf" / "ernie-image-text-encoder-tiny-Q8_0.gguf"
PROMPTS = ["a red cat sits on a blue mat", "", "一只 红色 的 猫", "3 dogs, 42 cats & 2024's moon!\n[INST]</s>",
           'quotes "and" \\ backslashes\nnewline']
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def twin(tiny_models, tmp_path_factory) -> Path:
    return dequantized_twin(FIXTURE, tiny_models["text_encoder_file"],
                            tmp_path_factory.mktemp("twin") / "ministral-3-3b-tiny-dequantized.safetensors")


def test_the_fixture_is_the_tiny_text_encoder(tiny_models):
    """Each weight of the fixture, read by the pack (rows put back in transformers' order), is the tiny text
    encoder's within Q8_0's rounding (half a step of each 32-value block's scale, and 127 steps of that scale's own
    fp16 rounding): the fixture is still the model the tests make, and the pack undoes the converter's permute
    (undone wrong, a row would be another row)."""
    expected = ErnieTextEncoder.from_single_file(tiny_models["text_encoder_file"], torch.float32)
    loaded = ErnieTextEncoder.from_gguf(FIXTURE, torch.float32)
    reference = expected.language_model.state_dict()
    blocks = 0
    for name, module in loaded.language_model.named_modules():
        if isinstance(module, GGUFBlockLinear):
            blocks += 1
            weight = module(torch.eye(module.in_features)).T  # the decoded weight, as the layer computes with it
            want = reference[f"{name}.weight"]
            step = want.reshape(-1, 32).abs().amax(dim=1, keepdim=True) / 127
            assert ((weight - want).reshape(-1, 32).abs() <= step * (0.5 + 127 * 2**-11)).all(), name
    assert blocks == 3 * 7
    torch.testing.assert_close(loaded.language_model.norm.weight, reference["norm.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gguf_encodes_exactly_like_its_dequantized_twin(twin, dtype):
    from_gguf = ErnieTextEncoder.from_gguf(FIXTURE, dtype)
    from_twin = ErnieTextEncoder.from_single_file(twin, dtype)
    for prompt in PROMPTS:
        assert from_gguf.token_ids(prompt) == from_twin.token_ids(prompt)
        expected = from_twin.encode(prompt, CPU)
        assert expected.abs().max() > 0
        torch.testing.assert_close(from_gguf.encode(prompt, CPU), expected, rtol=0, atol=0)


def test_q8_0_stays_close_to_the_original_model(tiny_models):
    """Q8_0 against the float32 model the file was converted from: within 4 % of the embedding's largest value
    (measured: 1.4-1.9 % over the prompts, CPU, float32, 2026-12-04)."""
    original = ErnieTextEncoder.from_single_file(tiny_models["text_encoder_file"], torch.float32)
    quantized = ErnieTextEncoder.from_gguf(FIXTURE, torch.float32)
    for prompt in PROMPTS:
        expected = original.encode(prompt, CPU)
        error = (quantized.encode(prompt, CPU) - expected).abs().max()
        assert error <= 0.04 * expected.abs().max(), (prompt, float(error))


def test_tokenizer_from_the_metadata_gives_the_single_files_ids(tiny_models):
    single = ErnieTextEncoder.from_single_file(tiny_models["text_encoder_file"], torch.float32).tokenizer
    tokenizer = ErnieTextEncoder.from_gguf(FIXTURE, torch.float32).tokenizer
    assert len(tokenizer) == len(single) == 400
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id, tokenizer.pad_token_id) == (
        single.bos_token_id, single.eos_token_id, single.unk_token_id, single.pad_token_id) == (1, 2, 0, 3)
    for prompt in [*PROMPTS, " ".join(["mountain river"] * 40), "\t tabs  and   spaces  "]:
        assert tokenizer(prompt)["input_ids"] == single(prompt)["input_ids"], prompt
        assert tokenizer.decode(tokenizer(prompt)["input_ids"][1:]) == prompt  # after the BOS


def _variant(tmp_path: Path, name: str, **changes) -> Path:
    return rewrite_gguf(FIXTURE, tmp_path / name, **changes)


def test_a_layer_of_the_wrong_shape_is_refused_by_name(tmp_path):
    reader = gguf.GGUFReader(str(FIXTURE))
    up = next(t for t in reader.tensors if t.name == "blk.1.ffn_up.weight")
    narrower = np.array(up.data)[:-2]  # 62 rows of 32 where the model has 64
    path = _variant(tmp_path, "one-layer-wrong.gguf", tensors={up.name: (narrower, up.tensor_type)})
    with pytest.raises(ErnieImageError, match=r"one-layer-wrong\.gguf.*blk\.1\.ffn_up\.weight.*\[62, 32\].*\[64, 32\]"):
        ErnieTextEncoder.from_gguf(path, torch.float32)


@pytest.mark.parametrize("key", ["general.name", "general.basename"])
def test_a_file_named_as_mistrals_own_ministral_is_refused(tmp_path, key):
    path = _variant(tmp_path, "renamed.gguf", fields={key: "Ministral 3 3B Instruct 2512"})
    with pytest.raises(ErnieImageError, match=rf"renamed\.gguf is named Ministral 3 3B Instruct 2512 \({key}\): "
                       r"Mistral's own Ministral 3, not ERNIE-Image's text encoder as its snapshot ships it\. "
                       r"Their tensors have the same shapes; whether the weights are the same, no model card "
                       r"says") as refused:
        ErnieTextEncoder.from_gguf(path, torch.float32)
    assert str(refused.value).endswith("or convert ERNIE-Image's own with llama.cpp's convert_hf_to_gguf.py.")


def test_a_file_of_another_architecture_is_refused(tmp_path):
    path = _variant(tmp_path, "qwen.gguf", fields={"general.architecture": "qwen2"})
    with pytest.raises(ErnieImageError, match=r"qwen\.gguf holds a qwen2 model \(general\.architecture\), not a "
                       r"Ministral 3 text encoder"):
        ErnieTextEncoder.from_gguf(path, torch.float32)


@pytest.mark.parametrize(("key", "value", "words"), [
    ("mistral3.block_count", 4, r"says mistral3\.block_count = 4, but its tensors make it 3: the file is damaged"),
    ("mistral3.rope.freq_base", 10000.0, r"says mistral3\.rope\.freq_base = 10000\.0, where Ministral 3 has "
                                          r"1000000\.0: it is not ERNIE-Image's text encoder"),
])
def test_metadata_that_contradicts_the_tensors_or_ministral_is_refused(tmp_path, key, value, words):
    path = _variant(tmp_path, "metadata.gguf", fields={key: value})
    with pytest.raises(ErnieImageError, match=r"metadata\.gguf " + words):
        ErnieTextEncoder.from_gguf(path, torch.float32)


@pytest.mark.parametrize(("fields", "words"), [
    ({"tokenizer.ggml.model": "llama"}, r"a tokenizer of kind llama \(tokenizer\.ggml\.model"),
    ({"tokenizer.ggml.pre": "qwen2"}, r"a tokenizer whose split before BPE is qwen2"),
    ({"tokenizer.ggml.bos_token_id": 400}, r"a bos_token_id of 400 for 400 tokens"),
    ({"tokenizer.ggml.eos_token_id": 72}, r"the eos_token_id 72 \(.*\), which is not a special token"),
    ({"tokenizer.ggml.merges": ["Ġ s", "no such"]}, r"the merge no such, which is not two of its tokens"),
])
def test_a_tokenizer_that_does_not_fit_is_refused_before_use(tmp_path, fields, words):
    path = _variant(tmp_path, "tokenizer.gguf", fields=fields)
    with pytest.raises(ErnieImageError, match=r"tokenizer\.gguf carries " + words + r".*not the tokenizer of a "
                       r"Ministral 3 model"):
        ErnieTextEncoder.from_gguf(path, torch.float32)


def test_a_file_without_a_tokenizer_is_refused(tmp_path):
    reader = gguf.GGUFReader(str(FIXTURE))
    path = _variant(tmp_path, "no-tokenizer.gguf", drop=tuple(k for k in reader.fields if k.startswith("tokenizer.")))
    with pytest.raises(ErnieImageError, match=r"no-tokenizer\.gguf carries no tokenizer \(no tokenizer\.ggml\.model "
                       r"field; llama\.cpp's converter writes one\)"):
        ErnieTextEncoder.from_gguf(path, torch.float32)


@pytest.mark.parametrize(("heads", "kv_heads"), [(32, 8), (2, 1), (4, 4)])
def test_unpermute_undoes_the_converters_permute_at_ministral_3_3bs_heads(heads, kv_heads):
    """Ministral 3 3B's 32 query and 8 key-value heads of 128 (the tiny model has 2 and 1): on values, and on a
    quantized row's bytes (rows move whole)."""
    from comfyui_ernie_image.nodes.ministral_gguf import unpermute

    for rows, n_kv in ((heads * 128, heads), (kv_heads * 128, kv_heads)):
        original = torch.randn(rows, 48)
        permuted = converter_permute(original, heads, n_kv)
        assert not torch.equal(permuted, original)
        assert torch.equal(unpermute(permuted, n_kv), original)
        blocks = torch.randint(0, 256, (rows, 34), dtype=torch.uint8)  # a Q8_0 row of 32 values
        assert torch.equal(unpermute(converter_permute(blocks, heads, n_kv), n_kv), blocks)


def test_a_vocabulary_of_another_size_is_refused(tmp_path):
    tokens = gguf.GGUFReader(str(FIXTURE)).fields["tokenizer.ggml.tokens"].contents()
    path = _variant(tmp_path, "vocabulary.gguf", fields={"tokenizer.ggml.tokens": tokens[:-1]})
    with pytest.raises(ErnieImageError, match=r"vocabulary\.gguf carries 399 tokens \(tokenizer\.ggml\.tokens\) for a "
                       r"model of 400 token embeddings"):
        ErnieTextEncoder.from_gguf(path, torch.float32)


def test_the_header_passes_the_bounded_walk_overlapping_tensors(tmp_path):
    path = _variant(tmp_path, "overlapping.gguf")
    set_tensor_offset(path, "blk.1.attn_q.weight", tensor_offset(path, "blk.0.attn_q.weight"))
    with pytest.raises(ErnieImageError, match=r"overlapping\.gguf as a GGUF file: it declares the tensors "
                       r"blk\.0\.attn_q\.weight and blk\.1\.attn_q\.weight in the same bytes .* which no GGUF writer "
                       r"makes"):
        ErnieTextEncoder.from_gguf(path, torch.float32)


def test_the_header_passes_the_bounded_walk_byte_order(tmp_path):
    path = _variant(tmp_path, "big-endian.gguf", endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ErnieImageError, match=r"big-endian\.gguf is a big-endian GGUF; this pack reads little-endian"):
        ErnieTextEncoder.from_gguf(path, torch.float32)


def test_metadata_is_read_under_a_byte_bound(tmp_path):
    """A name is read only when it takes at most 1 KiB: a file may say anything there."""
    path = _variant(tmp_path, "long-name.gguf", fields={"general.name": "ERNIE " * 1000})
    with pytest.raises(ErnieImageError, match=r"long-name\.gguf as a GGUF file: it declares the field general\.name "
                       r"of 6008 bytes \(at most 1024 are read of it\)"):
        ErnieTextEncoder.from_gguf(path, torch.float32)


def test_loading_stops_at_cancel(listed, monkeypatch):
    """ComfyUI's interrupt, set while the fifth tensor is read, stops the load before the sixth; the next load
    works."""
    import comfy.model_management

    from comfyui_ernie_image.nodes.gguf.reader import GGUFTensor
    from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader

    reads, read = [], GGUFTensor.read

    def interrupting(tensor):
        reads.append(tensor)
        if len(reads) == 5:
            comfy.model_management.interrupt_current_processing(True)
        return read(tensor)

    monkeypatch.setattr(GGUFTensor, "read", interrupting)
    try:
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            ErnieImageTextEncoderLoader.execute(listed["gguf"], "cpu")
    finally:
        comfy.model_management.interrupt_current_processing(False)
    assert len(reads) == 5
    assert ErnieImageTextEncoderLoader.execute(listed["gguf"], "cpu").result[0].encoder is not None


@pytest.fixture
def listed(placed, twin):
    """The fixture, its dequantized twin and the PE's GGUF under models/text_encoders, as a user puts them; their
    names as the text encoder loader lists them."""
    names = {"gguf": "ernie-image-text-encoder-tiny-Q8_0.gguf", "twin": twin.name,
             "pe": "ernie-image-prompt-enhancer-tiny-Q8_0.gguf"}
    placed("text_encoders", names["gguf"]).write_bytes(FIXTURE.read_bytes())
    placed("text_encoders", names["twin"]).write_bytes(twin.read_bytes())
    placed("text_encoders", names["pe"]).write_bytes((FIXTURE.parent / names["pe"]).read_bytes())
    return {key: f"text_encoders/{name}" for key, name in names.items()}


def test_the_loader_lists_gguf_text_encoders_and_encodes_like_the_twin(listed):
    from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncode, ErnieImageTextEncoderLoader

    options = ErnieImageTextEncoderLoader.define_schema().inputs[0].options
    assert listed["gguf"] in options and listed["twin"] in options
    assert listed["pe"] not in options  # a PE, listed by the PE loader
    assert ErnieImageTextEncoderLoader.validate_inputs(listed["gguf"]) is True
    conditionings = [ErnieImageTextEncode.execute(ErnieImageTextEncoderLoader.execute(listed[key]).result[0],
                                                  PROMPTS[0]).result[0] for key in ("gguf", "twin")]
    (gguf_cond, _), (twin_cond, _) = conditionings[0][0], conditionings[1][0]
    assert gguf_cond.shape == twin_cond.shape and gguf_cond.shape[0] == 1
    torch.testing.assert_close(gguf_cond, twin_cond, rtol=0, atol=0)


def test_fp8_asked_of_a_gguf_text_encoder_is_refused(listed):
    from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader

    with pytest.raises(ErnieImageError, match=r"weight_dtype fp8_e4m3fn stores the text encoder's layers in fp8, but "
                       r".*ernie-image-text-encoder-tiny-Q8_0\.gguf is a GGUF file, quantized already"):
        ErnieImageTextEncoderLoader.execute(listed["gguf"], "cpu", "fp8_e4m3fn")


def test_a_graph_with_the_gguf_text_encoder_gives_its_twins_image(comfy_server, tiny_models, listed):
    """The whole graph in a real headless ComfyUI: the GGUF text encoder and its dequantized twin, same image."""
    images = []
    for key in ("gguf", "twin"):
        graph = text_to_image(snapshot="ERNIE-Image-Turbo-tiny", prompt=PROMPTS[0], negative="dark", width=128,
                              height=128, steps=2, cfg=4.0, seed=3, prefix=f"gguf_te_{key}")
        graph["te"] = {"class_type": "ErnieImageTextEncoderLoader", "inputs": {"model_name": listed[key]}}
        for node in ("positive", "negative"):
            graph[node]["inputs"]["text_encoder"] = ["te", 0]
        result = comfy_server.run(graph)
        assert result.status == "success", result.messages
        (path,) = comfy_server.output_images(result)
        images.append(saved_image(path))
    assert images[0].std() > 5.0
    assert np.array_equal(images[0], images[1])


@pytest.mark.parametrize("kind", [k for k in BLOCKS if k != "Q8_0"])
def test_every_gguf_type_of_the_dit_encodes_exactly_like_its_twin(tiny_models, tmp_path, kind):
    """Community files mix types (a Q4_K_M keeps some tensors in Q6_K): the attention output projections (rows of
    256 values, which every block type fills) in ``kind``, the embeddings in F16 and a query projection in F32,
    beside the converter's Q8_0."""
    reader, rng = gguf.GGUFReader(str(FIXTURE)), np.random.default_rng(0)
    kinds = {f"blk.{i}.attn_output.weight": kind for i in range(3)}
    kinds.update({"token_embd.weight": "F16", "blk.1.attn_q.weight": "F32"})
    path = _variant(tmp_path, f"mixed-{kind}.gguf", tensors={
        name: (retyped(k, name, reader, rng), gguf.GGMLQuantizationType[k]) for name, k in kinds.items()})
    twin = dequantized_twin(path, tiny_models["text_encoder_file"], tmp_path / f"mixed-{kind}.safetensors")
    from_gguf, from_twin = ErnieTextEncoder.from_gguf(path, torch.float32), ErnieTextEncoder.from_single_file(
        twin, torch.float32)
    held = {m.kind for m in from_gguf.language_model.modules() if isinstance(m, GGUFBlockLinear)}
    assert held == {kind, "Q8_0"}
    for prompt in PROMPTS[:3]:
        expected = from_twin.encode(prompt, CPU)
        assert torch.isfinite(expected).all() and expected.abs().max() > 0
        torch.testing.assert_close(from_gguf.encode(prompt, CPU), expected, rtol=0, atol=0)


def test_the_all_in_one_loader_takes_a_gguf_text_encoder_as_a_new_input_after_the_old_ones(listed):
    from comfyui_ernie_image.nodes.loaders import ErnieImageLoader

    spec = ErnieImageLoader.define_schema().inputs[-2]  # the PE's file came after it (test_pe_gguf)
    assert spec.id == "text_encoder" and spec.optional and spec.default == "snapshot"
    assert listed["gguf"] in spec.options and listed["pe"] not in spec.options
    snapshot = "diffusers/ERNIE-Image-Turbo-tiny"
    before = ErnieImageLoader.execute(snapshot).result[1]  # as a workflow saved before the input runs it
    chosen = ErnieImageLoader.execute(snapshot, text_encoder=listed["gguf"]).result[1]
    twin = ErnieImageLoader.execute(snapshot, text_encoder=listed["twin"]).result[1]
    assert before.encoder.source.endswith("text_encoder")
    assert any(isinstance(m, GGUFBlockLinear) for m in chosen.encoder.language_model.modules())
    torch.testing.assert_close(chosen.encode(PROMPTS[0]), twin.encode(PROMPTS[0]), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_held_bytes_are_what_the_loaded_encoder_holds(dtype):
    """What the memory plan is given for a GGUF text encoder, from the header alone."""
    from comfyui_ernie_image.nodes.gguf.reader import read_gguf
    from comfyui_ernie_image.nodes.ministral_gguf import held_bytes

    planned = sum(held_bytes(n, t, dtype, lm_head=False) for n, t in read_gguf(FIXTURE).tensors.items())
    model = ErnieTextEncoder.from_gguf(FIXTURE, dtype).language_model
    assert planned == sum(p.nbytes for p in model.parameters())
    assert isinstance(model.embed_tokens, GGUFBlockEmbedding)  # the table's Q8_0 rows, decoded as looked up


# Mistral's tekken split, as llama.cpp 0c1e57098 quotes it from tokenizer.json (src/llama-vocab.cpp, TEKKEN).
MISTRAL_TEKKEN_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}"
                          r"\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+"
                          r"[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_a_tekken_gguf_tokenizes_as_transformers_reads_a_tekken_json(tmp_path):
    """Real Ministral 3 files say ``tokenizer.ggml.pre`` ``tekken``: the tiny vocabulary with that split gives the
    pieces and ids of transformers' own reading of a tekken.json (what ComfyUI's single files carry) with Mistral's
    pattern. The pieces tell the splits apart (GPT-2's keeps ``HelloWorld`` and ``12345`` whole); the tiny
    vocabulary's merges, all inside lowercase words, would give the same ids for either."""
    import json

    from transformers.integrations.mistral import convert_tekken_tokenizer

    from scripts.tiny_models import make_tokenizer, tekken_json

    tekken = json.loads(tekken_json(make_tokenizer()))
    tekken["config"]["pattern"] = MISTRAL_TEKKEN_PATTERN
    (tmp_path / "tekken.json").write_text(json.dumps(tekken))
    expected = convert_tekken_tokenizer(str(tmp_path / "tekken.json"))
    path = _variant(tmp_path, "tekken.gguf", fields={"tokenizer.ggml.pre": "tekken"})
    tokenizer = ErnieTextEncoder.from_gguf(path, torch.float32).tokenizer
    split, expected_split = (t.backend_tokenizer.pre_tokenizer for t in (tokenizer, expected))
    for prompt in [*PROMPTS, "HelloWorld 2024 ABCdef it's OK!!", "x\n\n  y\t3.14", "The Sun's light, 12345 mountains."]:
        assert split.pre_tokenize_str(prompt) == expected_split.pre_tokenize_str(prompt), prompt
        assert tokenizer(prompt)["input_ids"][1:] == expected(prompt, add_special_tokens=False)["input_ids"], prompt
    assert [piece for piece, _ in split.pre_tokenize_str("HelloWorld 12345")] == ["Hello", "World", "Ġ", "1", "2", "3",
                                                                                    "4", "5"]


def test_the_gguf_text_encoder_encodes_after_moves_and_after_free(listed):
    """Loaded inside inference mode as ComfyUI runs its loader, moved by model management inside and outside it
    (``test_inference_mode_moves``: a move to the CPU that copies, as one to or from a GPU does)."""
    from test_inference_mode_moves import CopyingMoves, free_models, loaded_in_inference_mode

    from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader

    (encoder,) = loaded_in_inference_mode(ErnieImageTextEncoderLoader, listed["gguf"])
    results = []
    for _ in range(2):
        with torch.inference_mode(), CopyingMoves():
            results.append(encoder.encode(PROMPTS[0]))
        free_models()
    assert results[0].abs().max() > 0
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


def test_the_gguf_text_encoder_streams_a_layer_at_a_time_to_the_same_embeddings():
    """Streamed (``text/streaming.py``: the blocks pass through the device a layer at a time, the table's rows are
    looked up where it lives), the embeddings are the whole model's."""
    from comfyui_ernie_image.nodes.text.streaming import LayerStream

    encoder = ErnieTextEncoder.from_gguf(FIXTURE, torch.float32)
    stream = LayerStream(encoder.language_model, CPU)
    for prompt in PROMPTS[:2]:
        torch.testing.assert_close(encoder.encode(prompt, CPU, stream), encoder.encode(prompt, CPU), rtol=0, atol=0)
    assert stream.working_bytes(10) > 0 and stream.copied_bytes > 0
