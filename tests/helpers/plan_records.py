"""ERNIE-Image's models as load records at their true sizes (from the check's true-size files, bench/RESULTS.md), and
costs as measured on the H200 (bench/RESULTS.md), for the planner's CPU tests. No file is read."""

from __future__ import annotations

from comfyui_ernie_image.nodes.plan.costs import Costs
from comfyui_ernie_image.nodes.plan.describe import Tensor, dit_record, language_model_record, lora_set, vae_record
from comfyui_ernie_image.nodes.plan.records import PROMPT_ENHANCER, TEXT_ENCODER
from helpers.card_faults import CPU_SECONDS, PAGEABLE, PINNED, SECONDS

GIB = 2**30
FLOOR = int(0.8 * GIB)  # core's minimum inference memory, less its reserve


def dit_tensors(gguf: str | None = None) -> list[Tensor]:
    """The 8B DiT: 36 blocks of hidden 4096, FFN 12288; as GGUF, its linears at Q4_K's 144 bytes per 256 values."""
    tensors = []
    for i in range(36):
        for name, shape in (("self_attention.to_q", (4096, 4096)), ("self_attention.to_k", (4096, 4096)),
                            ("self_attention.to_v", (4096, 4096)), ("self_attention.to_out.0", (4096, 4096)),
                            ("mlp.gate_proj", (12288, 4096)), ("mlp.up_proj", (12288, 4096)),
                            ("mlp.linear_fc2", (4096, 12288))):
            numel = shape[0] * shape[1]
            tensors.append(Tensor(f"layers.{i}.{name}.weight", shape, numel // 256 * 144 if gguf else None))
        tensors.append(Tensor(f"layers.{i}.adaLN.weight", (4096,)))
    tensors += [Tensor("x_embedder.weight", (4096, 128)), Tensor("adaLN_modulation.weight", (6 * 4096, 4096)),
                Tensor("text_proj.weight", (4096, 3072))]
    return tensors


def lm_tensors(layers: int = 26, lm_head: bool = False) -> list[Tensor]:
    """Ministral 3 3B's language model: hidden 3072, MLP 9216, 32 query and 8 key-value heads of 128."""
    tensors = [Tensor("model.embed_tokens.weight", (131072, 3072))]
    for i in range(layers):
        for name, shape in (("self_attn.q_proj", (4096, 3072)), ("self_attn.k_proj", (1024, 3072)),
                            ("self_attn.v_proj", (1024, 3072)), ("self_attn.o_proj", (3072, 4096)),
                            ("mlp.gate_proj", (9216, 3072)), ("mlp.up_proj", (9216, 3072)),
                            ("mlp.down_proj", (3072, 9216))):
            tensors.append(Tensor(f"model.layers.{i}.{name}.weight", shape))
    return tensors + ([Tensor("lm_head.weight", (131072, 3072))] if lm_head else [])


def costs(pinned: float = PINNED, pageable: float = PAGEABLE) -> Costs:
    """One forward at 1024², one encode, one PE token, one 1024² decode and its PNG (``helpers/card_faults``)."""
    return Costs("test", pinned, pageable, dict(SECONDS), dict(CPU_SECONDS))


def graph(gguf: bool = True, pe: bool = False, lora: bool = False, steps: int = 8, fp8_matmul: bool = True,
          te_fixed: tuple[str | None, tuple[str, ...] | None] = (None, None)):
    records = [
        dit_record("dit", dit_tensors("Q4_K" if gguf else None), gguf_type="Q4_K" if gguf else None,
                   fp8_matmul=fp8_matmul, runs=steps, working=FLOOR),
        language_model_record(TEXT_ENCODER, "te", lm_tensors(), runs=1, working=FLOOR, fixed_form=te_fixed[0],
                              places=te_fixed[1]),
        vae_record("vae", [Tensor("decoder.w", (84_000_000,))], working=int(1.2 * GIB)),
    ]
    if pe:
        records.append(language_model_record(PROMPT_ENHANCER, "pe", lm_tensors(lm_head=True), runs=64, working=FLOOR,
                                             streams=False))
    patches = [Tensor(f"layers.{i}.mlp.up_proj.lora_{ab}.weight", shape) for i in range(36)
               for ab, shape in (("A", (16, 4096)), ("B", (12288, 16)))]
    return records, lora_set(["lora"], patches) if lora else None
