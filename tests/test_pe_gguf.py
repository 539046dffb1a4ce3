"""The Prompt Enhancer from a GGUF file of llama.cpp's own converter: the greedy tokens and text of the same file
dequantized into ComfyUI's single-file layout, and near the float32 PE it was converted from.

The fixture ``fixtures/gguf/ernie-image-prompt-enhancer-tiny-Q8_0.gguf`` is the tiny PE (``tiny_models``, seed 0)
converted by ``convert_hf_to_gguf.py --outtype q8_0`` of llama.cpp 0c1e57098 (the llama-cpp-python 0.3.36 source
distribution's copy), with ``python -m scripts.tiny_ministral_gguf <that llama.cpp folder> tests/fixtures/gguf``.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from comfyui_ernie_image.nodes.gguf.dequant import BLOCKS
from comfyui_ernie_image.nodes.gguf.linear import GGUFBlockLinear
from comfyui_ernie_image.nodes.pe.local.weights import path_source
from comfyui_ernie_image.nodes.pe.nodes import ErnieImagePELoader
from comfyui_ernie_image.nodes.pe.protocol import EnhancerError, PromptSpec, SamplingParams
from helpers.gguf_files import dequantized_twin, retyped, rewrite_gguf

FIXTURE = Path(__file__).parent / "fixtures" / "gguf" / "ernie-image-prompt-enhancer-tiny-Q8_0.gguf"
PROMPTS = [PromptSpec("a cat", 1024, 1024), PromptSpec("一只黑白相间的中华田园犬", 1264, 848),
           PromptSpec("a red cat sits on a blue mat", 1024, 1024)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
# Q8_0's weights against the float32 PE's: the logits over a chat prompt within 5 % (relative norm; measured 2.6 % on
# the three prompts, CPU, float32, 2026-12-04).
LOGIT_ERROR = 0.05


@pytest.fixture(scope="module")
def twin(tiny_models, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pe_twin")
    return dequantized_twin(FIXTURE, tiny_models["pe_single_file"],
                            folder / "ernie-image-prompt-enhancer-tiny-dequantized.safetensors")


def _chat_ids(tokenizer, spec: PromptSpec) -> torch.Tensor:
    return torch.tensor([tokenizer.apply_chat_template(spec.messages(), add_generation_prompt=False, tokenize=True,
                                                       return_dict=True)["input_ids"]])


@torch.inference_mode()
def _greedy(model, ids: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=GREEDY.max_new_tokens, pad_token_id=0)


def test_gguf_pe_gives_the_greedy_tokens_of_its_dequantized_twin(twin):
    model, tokenizer = path_source(FIXTURE).load(torch.float32)
    twin_model, twin_tokenizer = path_source(twin).load(torch.float32)
    assert sum(isinstance(m, GGUFBlockLinear) for m in model.modules()) == 3 * 7
    assert tokenizer.chat_template == twin_tokenizer.chat_template
    for spec in PROMPTS:
        ids = _chat_ids(tokenizer, spec)
        assert torch.equal(ids, _chat_ids(twin_tokenizer, spec))
        expected = _greedy(twin_model, ids)
        assert expected.shape[1] > ids.shape[1]
        assert torch.equal(_greedy(model, ids), expected)
        with torch.inference_mode():
            torch.testing.assert_close(model(input_ids=ids).logits, twin_model(input_ids=ids).logits, rtol=0, atol=0)


def test_gguf_pe_stays_near_the_pe_it_was_converted_from(tiny_models):
    model, tokenizer = path_source(FIXTURE).load(torch.float32)
    original, _ = path_source(tiny_models["pe_single_file"]).load(torch.float32)
    for spec in PROMPTS:
        ids = _chat_ids(tokenizer, spec)
        with torch.inference_mode():
            actual, expected = model(input_ids=ids).logits, original(input_ids=ids).logits
        assert float((actual - expected).norm() / expected.norm()) <= LOGIT_ERROR


@pytest.mark.parametrize("kind", [k for k in BLOCKS if k != "Q8_0"])
def test_every_gguf_type_of_the_dit_in_a_mixed_pe_gives_the_greedy_tokens_of_its_twin(tiny_models, tmp_path, kind):
    """Community files mix types (a Q4_K_M keeps some tensors in Q6_K): two attention output projections (rows of 256
    values, which every block type fills) in ``kind``, the third in Q6_K, the embeddings in F16, beside the
    converter's Q8_0. The PE decodes every layer of every token through them."""
    reader, rng = gguf.GGUFReader(str(FIXTURE)), np.random.default_rng(1)
    kinds = {"blk.0.attn_output.weight": kind, "blk.1.attn_output.weight": kind, "blk.2.attn_output.weight": "Q6_K",
             "token_embd.weight": "F16"}
    path = rewrite_gguf(FIXTURE, tmp_path / f"mixed-{kind}.gguf", tensors={
        name: (retyped(k, name, reader, rng), gguf.GGMLQuantizationType[k]) for name, k in kinds.items()})
    twin = dequantized_twin(path, tiny_models["pe_single_file"], tmp_path / f"mixed-{kind}.safetensors")
    model, tokenizer = path_source(path).load(torch.float32)
    twin_model, _ = path_source(twin).load(torch.float32)
    assert {m.kind for m in model.modules() if isinstance(m, GGUFBlockLinear)} == {kind, "Q6_K", "Q8_0"}
    for spec in PROMPTS[:2]:
        ids = _chat_ids(tokenizer, spec)
        expected = _greedy(twin_model, ids)
        assert expected.shape[1] > ids.shape[1]
        assert torch.equal(_greedy(model, ids), expected)


def test_a_pe_file_named_as_mistrals_own_ministral_or_with_a_layer_of_the_wrong_shape_is_refused_by_name(tmp_path):
    renamed = rewrite_gguf(FIXTURE, tmp_path / "renamed.gguf", fields={"general.name": "Ministral 3 3B Instruct"})
    with pytest.raises(EnhancerError, match=r"renamed\.gguf is named Ministral 3 3B Instruct \(general\.name\): "
                       r"Mistral's own Ministral 3, not ERNIE-Image's prompt enhancer"):
        path_source(renamed).load(torch.float32)
    up = next(t for t in gguf.GGUFReader(str(FIXTURE)).tensors if t.name == "blk.2.ffn_up.weight")
    narrower = rewrite_gguf(FIXTURE, tmp_path / "narrower.gguf",
                            tensors={up.name: (np.array(up.data)[:-2], up.tensor_type)})  # 62 rows of 64
    with pytest.raises(EnhancerError, match=r"narrower\.gguf.*blk\.2\.ffn_up\.weight.*\[62, 32\].*\[64, 32\]"):
        path_source(narrower).load(torch.float32)


@pytest.fixture
def listed(placed, twin):
    names = {"gguf": FIXTURE.name, "twin": twin.name}
    placed("text_encoders", names["gguf"]).write_bytes(FIXTURE.read_bytes())
    placed("text_encoders", names["twin"]).write_bytes(twin.read_bytes())
    return {key: f"text_encoders/{name}" for key, name in names.items()}


def test_the_pe_loader_lists_a_gguf_pe_and_enhances_like_the_twin(listed, placed):
    from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader

    assert listed["gguf"] in ErnieImagePELoader.define_schema().inputs[0].options
    placed("text_encoders", "upper/ernie-image-prompt-enhancer-tiny.GGUF").write_bytes(FIXTURE.read_bytes())
    assert "text_encoders/upper/ernie-image-prompt-enhancer-tiny.GGUF" in ErnieImagePELoader.define_schema(
        ).inputs[0].options  # a suffix in capitals is a GGUF file to every list of the pack, as to is_gguf
    assert listed["gguf"] not in ErnieImageTextEncoderLoader.define_schema().inputs[0].options
    texts = []
    for key in ("gguf", "twin"):
        (handle,) = ErnieImagePELoader.execute(listed[key], "cpu", "float32").result
        texts.append([completion.text for completion in handle.enhance(PROMPTS, GREEDY)])
    assert all(texts[0]) and texts[0] == texts[1]


def test_fp8_asked_of_a_gguf_pe_is_refused(listed):
    with pytest.raises(EnhancerError, match=r"weight_dtype fp8_e4m3fn stores the prompt enhancer's layers in fp8, "
                       r"but .*ernie-image-prompt-enhancer-tiny-Q8_0\.gguf is a GGUF file, quantized already"):
        ErnieImagePELoader.execute(listed["gguf"], "cpu", "float32", "fp8_e4m3fn")


def test_the_all_in_one_loader_takes_a_gguf_pe_as_its_last_input(listed, comfy_paths):
    """Its new last input: the snapshot's PE (as a workflow saved before it runs), or a PE of models/text_encoders;
    the memory plan reads the same choice off the graph."""
    from comfyui_ernie_image.nodes import planning
    from comfyui_ernie_image.nodes.loaders import ErnieImageLoader

    inputs = ErnieImageLoader.define_schema().inputs
    spec = inputs[-1]
    assert (spec.id, spec.optional, spec.default) == ("prompt_enhancer", True, "snapshot")
    assert listed["gguf"] in spec.options and listed["twin"] in spec.options
    assert not any(o.startswith("diffusers/") for o in spec.options)  # a snapshot's PE is the loader's own
    snapshot = "diffusers/ERNIE-Image-Turbo-tiny"
    before = ErnieImageLoader.execute(snapshot).result[3]
    chosen = ErnieImageLoader.execute(snapshot, prompt_enhancer=listed["gguf"]).result[3]
    twin = ErnieImageLoader.execute(snapshot, prompt_enhancer=listed["twin"]).result[3]
    assert before.identity != chosen.identity and FIXTURE.name in chosen.identity
    texts = [[c.text for c in pe.enhance(PROMPTS, GREEDY)] for pe in (chosen, twin)]
    assert all(texts[0]) and texts[0] == texts[1]
    with pytest.raises(EnhancerError, match=r"pe_weight_dtype fp8_e4m3fn stores the prompt enhancer's layers in fp8, "
                       r"but .*\.gguf is a GGUF file, quantized already"):
        ErnieImageLoader.execute(snapshot, pe_weight_dtype="fp8_e4m3fn", prompt_enhancer=listed["gguf"])
    graph = {"1": {"class_type": "ErnieImageLoader", "inputs": {"model_name": snapshot,
                                                                 "prompt_enhancer": listed["gguf"]}},
             "2": {"class_type": "ErnieImagePromptEnhance", "inputs": {"pe": ["1", 3]}}}
    assert planning.wanted(graph).pe[0].name == FIXTURE.name


def test_the_gguf_pe_enhances_after_moves_and_after_free():
    """Loaded on first use, inside the enhance node (inference mode); moved as in ``test_inference_mode_moves``."""
    from test_inference_mode_moves import CopyingMoves, free_models

    from comfyui_ernie_image.nodes.pe.comfy_runtime import ComfyRuntime
    from comfyui_ernie_image.nodes.pe.local.enhancer import LocalPromptEnhancer

    pe = LocalPromptEnhancer.from_path(FIXTURE, runtime=ComfyRuntime())
    texts = []
    for _ in range(2):
        with torch.inference_mode(), CopyingMoves():
            texts.append(pe.enhance([PROMPTS[0]], GREEDY)[0].text)
        free_models()
    assert texts[0] and texts[1] == texts[0]
