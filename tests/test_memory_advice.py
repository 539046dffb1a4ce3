"""The out-of-memory advice's ranking, on plain descriptions of the state (engine: no ComfyUI): the first step not
taken whose saving covers what is missing; the few that do together; the card too small; the method that halves a
DiT on each GPU; and what the text models say of their own tensors. What each state's words are through a real
core: test_oom_advice.py."""

from __future__ import annotations

import torch

from comfyui_ernie_image.nodes.memory_advice import (
    DIT,
    PROMPT_ENHANCER,
    TEXT_ENCODER,
    PackModel,
    Shortage,
    advice,
    format_bytes,
    ministral_choices,
    one_byte_saving,
    q4_k_m_bytes,
    steps,
)
from comfyui_ernie_image.nodes.pe.local.fused import fuse_mlp_projections
from comfyui_ernie_image.nodes.pe.local.weights import snapshot_source
from comfyui_ernie_image.nodes.quant.capability import halving_method

GiB = 2**30
GPU = "cuda:0"


def dit(quantization: str = "none", weight_dtype: str = "bf16", held: int = 16 * GiB, quantize_to="fp8_per_row",
        **fields) -> PackModel:
    """A true-size DiT as it describes itself: 16 GiB in bf16, half of it in its block weights' second bytes."""
    plain = quantization == "none" and not weight_dtype.startswith("fp8")
    return PackModel(DIT, 16 * GiB if plain else 8 * GiB, weight_dtype, GPU, held, fp8_saving=8 * GiB * plain,
                     quantization=quantization, quantize_to=quantize_to, quantize_saving=8 * GiB * plain,
                     loads_in_part=quantization == "none", **fields)


def text_encoder(weight_dtype: str = "bf16", device: str = GPU, held: int = 7 * GiB) -> PackModel:
    fp8 = weight_dtype == "fp8_e4m3fn"
    return PackModel(TEXT_ENCODER, 4 * GiB if fp8 else 7 * GiB, weight_dtype, device, held,
                     fp8_saving=0 if fp8 else 3 * GiB)


def sampling(free: int, need: int, *held: PackModel, **fields) -> Shortage:
    return Shortage(GPU, free, need, None, held, **fields)


def words(shortage: Shortage) -> list[str]:
    return [step.words for step in steps(shortage)]


def test_the_first_step_that_covers_is_named_not_a_later_one():
    message = advice(sampling(0, 2 * GiB, dit(held=16 * GiB), text_encoder()))
    assert "Next step that fits (2.0 GiB missing): set the text encoder's weight_dtype to fp8_e4m3fn" in message
    assert "quantization to fp8_per_row" not in message  # it would fit too, but costs more


def test_a_step_that_frees_too_little_is_passed_over():
    message = advice(sampling(0, 5 * GiB, dit(held=16 * GiB), text_encoder()))
    assert "Next step that fits (5.0 GiB missing): set the DiT loader's quantization to fp8_per_row" in message
    assert "text encoder's weight_dtype" not in message


def test_a_step_already_taken_is_never_offered():
    taken = sampling(0, 1 * GiB, dit("fp8_per_row", held=8 * GiB),
                     text_encoder("fp8_e4m3fn", device="cpu", held=0))
    offered = words(taken)
    assert not any("quantization to fp8_per_row" in w or "int8_weight_only" in w for w in offered)
    assert not any("text encoder" in w for w in offered)  # fp8 already, and on the CPU (nothing of it on the GPU)
    assert offered[0].startswith("set the DiT loader's quantization to none with weight_dtype fp8_e4m3fn")
    fp8_storage = sampling(0, 1 * GiB, dit(weight_dtype="fp8_e4m3fn", held=8 * GiB))
    assert not any("weight_dtype to fp8_e4m3fn" in w or "quantization to" in w for w in words(fp8_storage))


def test_an_older_gpu_is_offered_int8_and_the_cpu_no_quantization():
    assert halving_method((8, 9)) == halving_method((9, 0)) == halving_method((12, 0)) == "fp8_per_row"
    assert halving_method((8, 6)) == halving_method((7, 5)) == "int8_weight_only"
    assert halving_method(None) is None
    older = advice(sampling(0, 5 * GiB, dit(quantize_to=halving_method((8, 6)))))
    assert "set the DiT loader's quantization to int8_weight_only" in older
    assert "fp8_per_row" not in older
    cpu = words(sampling(0, 5 * GiB, dit(quantize_to=halving_method(None))))
    assert not any("quantization to" in w for w in cpu)


def test_a_partly_loaded_dit_frees_only_what_quantizing_would_save_of_its_share():
    # 12 of 16 GiB on a 16 GB card; quantized, it would hold 8 GiB whole: 4 GiB freed.
    quantize = next(s for s in steps(sampling(0, 1 * GiB, dit(held=12 * GiB))) if "fp8_per_row" in s.words)
    assert quantize.saving == 4 * GiB


def test_no_single_step_but_a_few_together():
    message = advice(sampling(2 * GiB, 14 * GiB, dit(held=16 * GiB), text_encoder()))
    assert message.splitlines()[-1] == (
        "No single step frees the 12.0 GiB missing; these together do: set the text encoder's device to cpu "
        "(text_encoder_device on the ERNIE-Image Loader): prompts then encode on the CPU, more slowly (frees about "
        "7.0 GiB); set the DiT loader's quantization to fp8_per_row: its block weights in one byte each, loaded "
        "whole (frees about 8.0 GiB).")


def test_too_small_when_even_every_step_together_falls_short():
    message = advice(sampling(0, 40 * GiB, dit(held=16 * GiB), text_encoder()))  # 7 + 8 GiB at most: 25 short
    last = message.splitlines()[-1]
    assert last.startswith("The card is too small for this: even with every step the pack offers (set the text "
                           "encoder's device to cpu")
    assert last.endswith("25.0 GiB would still be missing on cuda:0. Close other programs that use it, or use a GPU "
                         "with more memory.")


def test_a_smaller_image_is_sized_to_what_is_free():
    message = advice(sampling(1 * GiB, 4 * GiB, dit("fp8_weight_only", held=8 * GiB, quantize_to=None),
                              image=(1024, 1024), multiple=16))
    # The streamed DiT comes first (it costs time, not the picture); with it taken, the image.
    streamed = sampling(1 * GiB, 4 * GiB, dit(weight_dtype="fp8_e4m3fn", held=8 * GiB), image=(1024, 1024),
                        multiple=16)
    assert "set the DiT loader's quantization to none with weight_dtype fp8_e4m3fn" in message
    assert advice(streamed).splitlines()[-1] == (
        "Next step that fits (3.0 GiB missing): make the image at most 512×512 (now 1024×1024) (frees about 3.0 GiB).")


def test_the_prompt_enhancer_in_fp8_then_on_the_cpu():
    pe = PackModel(PROMPT_ENHANCER, 7 * GiB, "bf16", GPU, 7 * GiB, fp8_saving=3 * GiB)
    fp8 = advice(sampling(0, 2 * GiB, dit("fp8_per_row", held=8 * GiB), pe))
    assert ("Chosen: DiT quantization fp8_per_row, weight_dtype bf16 (8.0 GiB on cuda:0); Prompt Enhancer "
            "weight_dtype bf16, device cuda:0 (7.0 GiB on cuda:0).") in fp8
    assert "Next step that fits (2.0 GiB missing): set the Prompt Enhancer's weight_dtype to fp8_e4m3fn " \
           "(pe_weight_dtype on the ERNIE-Image Loader)" in fp8
    cpu = advice(sampling(0, 6 * GiB, dit("fp8_per_row", held=8 * GiB), pe))
    assert "Next step that fits (6.0 GiB missing): run the Prompt Enhancer on the CPU" in cpu
    assert "Prompt Enhancer's weight_dtype" not in cpu  # frees too little
    taken = PackModel(PROMPT_ENHANCER, 4 * GiB, "fp8_e4m3fn", GPU, 4 * GiB)
    assert not any("weight_dtype" in w for w in words(sampling(0, 1 * GiB, taken)))


def test_an_accelerator_is_bypassed_when_that_frees_enough():
    cached = advice(sampling(0, 1 * GiB, dit("fp8_per_row", held=8 * GiB),
                             accelerators=(("ERNIE-Image Cache-DiT", 1 * GiB),)))
    assert "1.0 GiB of it for ERNIE-Image Cache-DiT" in cached
    assert "Next step that fits (1.0 GiB missing): bypass ERNIE-Image Cache-DiT" in cached


def test_the_text_models_describe_their_weights_from_their_tensors(tiny_models):
    """The tiny PE as the enhancer holds it (gate and up stacked into one layer), in bf16 and in fp8: what fp8
    frees is what the fp8 model holds less."""
    source = snapshot_source(tiny_models["snapshot"])
    bf16, fp8 = (source.load(torch.bfloat16, fp8=f)[0] for f in (False, True))
    for model in (bf16, fp8):
        fuse_mlp_projections(model)
    plain, held = ministral_choices(PROMPT_ENHANCER, bf16), ministral_choices(PROMPT_ENHANCER, fp8)
    assert (plain.weight_dtype, held.weight_dtype) == ("bf16", "fp8_e4m3fn")
    assert plain.size - plain.fp8_saving == held.size and held.fp8_saving == 0


def test_unknown_or_under_counted_free_memory_names_the_cheapest_step():
    unknown = advice(Shortage(GPU, None, 8 * GiB, dit("fp8_per_row", held=8 * GiB), (text_encoder(),)))
    assert "with the memory free there could not be read." in unknown
    assert "\nNext step: set the text encoder's weight_dtype to fp8_e4m3fn" in unknown
    counted = advice(sampling(2 * GiB, 1 * GiB, text_encoder()))
    assert "\nNext step (ComfyUI's count said it fit: it took more than counted): set the text encoder's " \
           "weight_dtype to fp8_e4m3fn" in counted


def test_one_byte_savings_come_from_the_tensors():
    bf16 = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert one_byte_saving([bf16]) == 4 * 8 * 1 - 4 * 4  # a byte a weight less, a 4-byte scale a row more
    assert one_byte_saving([torch.zeros(4, 8, dtype=torch.float32)]) == 4 * 8 * 3 - 4 * 4
    assert one_byte_saving([bf16.to(torch.float8_e4m3fn), torch.zeros(8, dtype=torch.bfloat16)]) == 0
    assert (format_bytes(3 * GiB), format_bytes(5 * 2**20), format_bytes(512)) == ("3.0 GiB", "5.0 MiB", "0.5 KiB")


def test_a_dit_that_is_not_gguf_is_offered_a_q4_k_m_file_before_the_cpu():
    """The issue's 8 GB card: the FP8 DiT held whole (7.7 GB) beside nothing else left to move: a Q4_K_M GGUF of it
    (streamable, 4 to 6 bits) comes before the text encoder on the CPU and before streaming the fp8 one; a share of
    it for a DiT ComfyUI holds in part; never for a GGUF DiT."""
    fp8 = dit("fp8_per_row", held=8 * GiB, gguf_saving=3 * GiB)
    message = advice(sampling(0, 2 * GiB, fp8, text_encoder("fp8_e4m3fn", held=4 * GiB)))
    assert ("Next step that fits (2.0 GiB missing): load a Q4_K_M GGUF of the DiT instead (a .gguf file in "
            "models/diffusion_models/, in the ERNIE-Image DiT Loader, quantization none; the ernie_image_turbo_gguf "
            "workflow): its block weights at 4 to 6 bits, decoded as each layer runs (frees about 3.0 GiB).") in message
    assert "text encoder's device to cpu" not in message
    share = next(s for s in steps(sampling(0, 1 * GiB, dit(held=12 * GiB, gguf_saving=10 * GiB))) if "GGUF" in s.words)
    assert share.saving == 12 * GiB * 10 // 16  # 12 of its 16 GiB held: the same share of what GGUF saves
    gguf = dit(weight_dtype="bf16", held=5 * GiB)  # a GGUF DiT says it saves nothing (memory_choices)
    assert not any("GGUF" in w for w in words(sampling(0, 1 * GiB, gguf)))


def test_q4_k_m_bytes_count_whole_256_value_rows_at_5_5_bits():
    assert q4_k_m_bytes(torch.empty(4096, 4096, dtype=torch.bfloat16)) == 4096 * 4096 // 256 * 176
    assert q4_k_m_bytes(torch.empty(128, 64)) is None  # rows not whole blocks: a GGUF writer keeps them in 16 bits
    assert q4_k_m_bytes(torch.empty(4096)) is None
