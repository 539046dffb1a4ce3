"""The writer of Ministral 3 GGUF files for the GPU check and the benchmark (``scripts/ministral_gguf_writer.py``):
its Q8_0 file is llama.cpp's converter's byte for byte (the fixture, made by llama.cpp 0c1e57098's
``convert_hf_to_gguf.py`` from the same tiny text encoder); its Q4_K_M file encodes through the pack's loader exactly
like the same weights as a safetensors single file; its Q4_K_M mix at Ministral 3 3B's geometry is llama-quantize's;
and the tokenizer it grows to 131,072 tokens passes the pack's checks and splits every text as the tokenizer it grew
from."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from checks.gpu.e2e_models import TRUE_MINISTRAL
from comfyui_ernie_image.nodes.ministral_gguf import MinistralGGUF
from comfyui_ernie_image.nodes.text.encoder import ErnieTextEncoder
from helpers.gguf_files import dequantized_twin
from scripts.ministral_gguf_writer import (
    llama_cpp_tensors,
    q4_k_m_kind,
    random_state,
    write_from_model,
    write_ministral_gguf,
)
from scripts.tiny_models import make_pipeline, make_tokenizer, save_text_encoder_single_file

FIXTURE = Path(__file__).parent / "fixtures" / "gguf" / "ernie-image-text-encoder-tiny-Q8_0.gguf"
PROMPTS = ["a red cat sits on a blue mat", "", "一只 红色 的 猫", "3 dogs, 42 cats & 2024's moon!\n[INST]</s>",
           'quotes "and" \\ backslashes\nnewline', "ÿþ <s>Ā"]
NAME = "ERNIE-Image text encoder tiny"
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def pipe():
    return make_pipeline()  # seed 0: the model the fixture was converted from


def test_the_q8_0_file_is_llama_cpps_converters_byte_for_byte(pipe, tmp_path):
    """Same tensors in the same order, types and bytes (the query and key rows permuted as the converter does), and
    the same metadata but the name (ours is given) and the size label (the converter's count of parameters)."""
    path = write_from_model(tmp_path / "te-Q8_0.gguf", pipe.text_encoder.language_model, "Q8_0", pipe.tokenizer, NAME)
    ours, theirs = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(FIXTURE))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, converted in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == converted.tensor_type, mine.name
        assert np.array_equal(np.array(mine.data), np.array(converted.data)), mine.name
    fields = {key: field.contents() for key, field in ours.fields.items() if key != "GGUF.kv_count"}
    expected = {key: field.contents() for key, field in theirs.fields.items()
                if key not in ("GGUF.kv_count", "general.size_label")}
    assert fields == {**expected, "general.name": NAME}


def test_a_q4_k_m_file_encodes_exactly_like_its_weights_as_a_single_file(pipe, tmp_path):
    """The tiny model's rows (32 values) do not fill 256-value blocks: llama-quantize's fallback types (Q5_0 for
    Q4_K) but where they do (the attention output, 256 wide)."""
    path = write_from_model(tmp_path / "te-Q4_K_M.gguf", pipe.text_encoder.language_model, "Q4_K_M",
                            pipe.tokenizer, NAME)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert (kinds["blk.0.attn_q.weight"], kinds["blk.0.attn_output.weight"], kinds["token_embd.weight"],
            kinds["blk.2.ffn_norm.weight"]) == ("Q5_0", "Q4_K", "Q8_0", "F32")
    single = save_text_encoder_single_file(pipe, tmp_path / "ministral-3-3b.safetensors")
    twin = dequantized_twin(path, single, tmp_path / "twin.safetensors")
    from_gguf = ErnieTextEncoder.from_gguf(path, torch.float32)
    from_twin = ErnieTextEncoder.from_single_file(twin, torch.float32)
    for prompt in PROMPTS:
        assert from_gguf.token_ids(prompt) == from_twin.token_ids(prompt)
        expected = from_twin.encode(prompt, CPU)
        assert torch.isfinite(expected).all() and expected.abs().max() > 0
        torch.testing.assert_close(from_gguf.encode(prompt, CPU), expected, rtol=0, atol=0)


def test_the_q4_k_m_mix_at_ministral_3_3b_is_llama_quantizes():
    """At 26 layers ``use_more_bits`` keeps the value and down projections of layers 0-2, 5, 8, …, 20 and 22-25 in
    Q6_K, and the tied embeddings (no output.weight) Q6_K: about 2.1 GB, what the issue expects (no file written)."""
    state = random_state(TRUE_MINISTRAL)
    kind = q4_k_m_kind(TRUE_MINISTRAL["num_hidden_layers"])
    kinds = {name: kind(name, value) for name, value in llama_cpp_tensors(state, 32, 8).items()}
    more = [0, 1, 2, 5, 8, 11, 14, 17, 20, 22, 23, 24, 25]
    for part in ("attn_v", "ffn_down"):
        assert [i for i in range(26) if kinds[f"blk.{i}.{part}.weight"] == "Q6_K"] == more
    assert kinds["token_embd.weight"] == "Q6_K" and "output.weight" not in kinds
    assert {kinds[f"blk.{i}.{p}.weight"] for i in range(26) for p in ("attn_q", "attn_k", "attn_output", "ffn_gate",
                                                                       "ffn_up")} == {"Q4_K"}
    nbytes = sum(value.numel() * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kinds[name]]][1]
                 // gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kinds[name]]][0]
                 for name, value in llama_cpp_tensors(state, 32, 8).items())
    assert 2.10e9 < nbytes < 2.20e9, nbytes


def test_the_tokenizer_grown_to_131072_tokens_passes_the_loaders_checks(tmp_path):
    """The true-size files' tokenizer (a model of Ministral 3 3B's vocabulary, narrow, to keep the file small): the
    pack reads all 131,072 tokens and their merges and splits every prompt into the ids of the tokenizer it grew from
    (the GPU check's safetensors text encoder's)."""
    config = dict(TRUE_MINISTRAL, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1)
    base = make_tokenizer()
    path = write_ministral_gguf(tmp_path / "vocabulary.gguf", random_state(config), config, "Q8_0", base, NAME)
    tokenizer = MinistralGGUF(path, "text encoder", "use another file", lm_head=False).tokenizer()
    assert len(tokenizer) == 131072 and len(base) == 400
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 3)
    for prompt in PROMPTS:
        assert tokenizer(prompt)["input_ids"] == base(prompt)["input_ids"], prompt
