"""ERNIE-Image models with random weights in every on-disk layout users download, under their real names.

A ComfyUI ``models`` folder for the GPU end-to-end check (``gpu_e2e.py``):

- ``diffusers/ERNIE-Image-Turbo/``: the Hugging Face snapshot (``model_index.json``, ``transformer/``,
  ``text_encoder/``, ``tokenizer/``, ``vae/``, ``scheduler/``, ``pe/``, ``pe_tokenizer/``), written by diffusers'
  and transformers' own ``save_pretrained``; ``diffusers/ERNIE-Image/`` is the same files, hard-linked (Base and
  Turbo share the architecture, and the GPU machine's disk is 64 GiB);
- ComfyUI's repack: ``diffusion_models/ernie-image-turbo.safetensors`` (the snapshot's DiT file: the same keys,
  hard-linked; the snapshot's DiT is saved unsharded for that), ``text_encoders/ministral-3-3b.safetensors`` (the
  language model with its tokenizer inside), ``text_encoders/ernie-image-prompt-enhancer.safetensors`` (the same
  file, hard-linked: a random PE has the text encoder's architecture), ``vae/flux2-vae.safetensors`` (hard-linked);
- ``diffusion_models/ernie-image-turbo-Q4_K_M.gguf``: the DiT as a Q4_K_M GGUF, named and made as the community's
  (unsloth/ERNIE-Image-Turbo-GGUF has this name; city96's converter, which has no ERNIE-Image entry, writes the
  released keys under ``general.architecture`` ``wan``): K-quant layers as random valid blocks, the rest from the
  DiT's weights (``scripts/gguf_writer.py``; 5.2 GB at true size, tensor by tensor: 17 s on a 2-core CPU, most of
  it writing to disk, and about 1 GB of host memory);
- ``diffusion_models/ernie-image-turbo-Q3_K_M.gguf``: the same with a Q3_K_M-like mix (most layers Q3_K, the
  value and down projections Q4_K; about 4 GB at true size), for the 8 GB card's smaller option;
- ``loras/ernie-image-turbo-lora.safetensors``: a LoRA on every block linear layer (rank 64; 4 for tiny models) in
  the diffusers PEFT layout, the name the LoRA workflow picks;
- on demand, only when a twin that reads them runs (``--gguf-text-encoders``, which ``gpu_e2e.py`` passes):
  ``text_encoders/ernie-image-text-encoder-Q4_K_M.gguf`` and ``-Q8_0.gguf``, the text encoder as llama.cpp's Q4_K_M
  and Q8_0 files (``scripts/ministral_gguf_writer.py``: its names, metadata and mix; the single file's tokenizer
  grown to the vocabulary, so a prompt has the same ids with both). At true size their weights are random valid
  blocks (2.1 and 3.6 GB); tiny, the tiny text encoder's weights quantized.

``true_size=True`` builds the released sizes on the GPU (an 8B DiT and two 3.4B Ministral 3 models, bf16,
normal(0, 0.02) weights, about 42 GB on disk with the GGUF); otherwise the tiny models of ``scripts/tiny_models.py``
(CPU, seconds).

Run from the repository root as ``python -m checks.gpu.e2e_models MODELS_DIR [--true-size]`` (``gpu_e2e.py`` does).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from bench.common import write_lora
from scripts.gguf_writer import mixed_kind, q3_mixed_kind, write_gguf
from scripts.ministral_gguf_writer import write_from_model, write_true_size
from scripts.tiny_models import (
    PE_CHAT_TEMPLATE,
    make_pipeline,
    make_tokenizer,
    save_text_encoder_single_file,
)

TURBO, BASE = "ERNIE-Image-Turbo", "ERNIE-Image"
# Ministral 3 3B, the text encoder's language model and the PE (docs/ARCHITECTURE.md §2: 3.4B, tied embeddings).
TRUE_MINISTRAL = dict(vocab_size=131072, hidden_size=3072, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=3)
GGUF_DIT = "diffusion_models/ernie-image-turbo-Q4_K_M.gguf"
GGUF_Q3_DIT = "diffusion_models/ernie-image-turbo-Q3_K_M.gguf"
# The GGUF text encoders (name: llama.cpp's file type), written only when a twin reads them.
GGUF_TEXT_ENCODERS = {"text_encoders/ernie-image-text-encoder-Q4_K_M.gguf": "Q4_K_M",
                      "text_encoders/ernie-image-text-encoder-Q8_0.gguf": "Q8_0"}
GGUF_NAME = "ERNIE-Image text encoder"  # general.name: not one of Mistral's own releases, which the pack refuses
_DONE = ".complete"  # written last: a folder without it was interrupted and is written again


@torch.no_grad()
def _randomise(module: torch.nn.Module) -> torch.nn.Module:
    """normal(0, 0.02) weights, norm weights 1: speed and memory do not depend on the values."""
    for name, param in module.named_parameters():
        param.fill_(1.0) if "norm" in name and name.endswith("weight") else param.normal_(0.0, 0.02)
    return module.eval()


def _true_size(cls, config, device: str = "cuda") -> torch.nn.Module:
    with torch.device("meta"):
        module = cls(config)
    module = module.to_empty(device=device).to(torch.bfloat16)
    module.tie_weights()  # to_empty gives the tied LM head a tensor of its own (a random PE then wrote no text)
    return _randomise(module)


@torch.no_grad()
def _writes_words(pe: torch.nn.Module, tokenizer) -> torch.nn.Module:
    """Random weights pick from 131072 ids, which the small test tokenizer cannot decode: an empty text. The (tied)
    embedding rows of the tokenizer's word pieces get a large scale and every other row (special tokens and pieces
    that decode to white space included) zeros, so sampling picks words and runs to ``max_new_tokens``, as a long
    real answer does. (Baidu's template ends the prompt with ``[/INST]``, and a random PE with tied embeddings
    repeats its last token: it wrote ``[/INST]`` 64 times, which decodes to no text.)"""
    embed = pe.get_input_embeddings().weight
    embed[:len(tokenizer)].normal_(0.0, 1.0)
    embed[tokenizer.all_special_ids] = 0.0
    embed[[i for i in range(len(tokenizer)) if not tokenizer.decode([i], skip_special_tokens=True).strip()]] = 0.0
    embed[len(tokenizer):] = 0.0
    return pe


def true_size_pipeline():
    """The released architecture at full size with random weights, bf16 on the GPU."""
    from diffusers import AutoencoderKLFlux2, ErnieImagePipeline, FlowMatchEulerDiscreteScheduler
    from transformers import (
        Ministral3Config,
        Ministral3ForCausalLM,
        Mistral3Config,
        Mistral3Model,
        PixtralVisionConfig,
    )

    from bench.common import random_true_size_dit

    text_config = Ministral3Config(**TRUE_MINISTRAL)
    pe_tokenizer = make_tokenizer(PE_CHAT_TEMPLATE)
    vision = PixtralVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                 head_dim=32)  # never used by ERNIE-Image: kept small
    return ErnieImagePipeline(
        transformer=random_true_size_dit(),
        vae=AutoencoderKLFlux2().to("cuda", torch.bfloat16).eval(),
        text_encoder=_true_size(Mistral3Model, Mistral3Config(text_config=text_config, vision_config=vision)),
        tokenizer=make_tokenizer(),
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=4.0),
        pe=_writes_words(_true_size(Ministral3ForCausalLM, text_config), pe_tokenizer),
        pe_tokenizer=pe_tokenizer,
    )


def write_gguf_dit(state: Mapping[str, torch.Tensor], path: Path,
                   kind: Callable[[str, torch.Tensor], str] = mixed_kind) -> Path:
    """The DiT's weights ``state`` (on any device) as a Q4_K_M-like GGUF file at ``path`` (``kind``:
    ``q3_mixed_kind`` for the Q3_K_M-like one), as community files are: the released keys, ``general.architecture``
    ``wan`` (the pack must recognise the DiT by its names)."""
    return write_gguf(path, state, kind, arch="wan")


def _link(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    os.link(source, target)


def _link_tree(source: Path, target: Path) -> None:
    for path in source.rglob("*"):
        if path.is_file():
            _link(path, target / path.relative_to(source))


def write_models(models_dir: Path, true_size: bool) -> Path:
    """Write (once) every layout under ``models_dir``; returns ``models_dir``."""
    if (models_dir / _DONE).is_file():
        return models_dir
    pipe = true_size_pipeline() if true_size else make_pipeline()
    turbo = models_dir / "diffusers" / TURBO
    pipe.save_pretrained(turbo, safe_serialization=True, max_shard_size="64GB")  # the DiT unsharded: linked below
    _link(turbo / "transformer" / "diffusion_pytorch_model.safetensors",
          models_dir / "diffusion_models" / "ernie-image-turbo.safetensors")
    text_encoder = save_text_encoder_single_file(pipe, models_dir / "text_encoders" / "ministral-3-3b.safetensors")
    _link(text_encoder, models_dir / "text_encoders" / "ernie-image-prompt-enhancer.safetensors")
    _link(turbo / "vae" / "diffusion_pytorch_model.safetensors", models_dir / "vae" / "flux2-vae.safetensors")
    _link_tree(turbo, models_dir / "diffusers" / BASE)
    write_lora(pipe.transformer, models_dir / "loras" / "ernie-image-turbo-lora.safetensors", 64 if true_size else 4)
    for name, kind in ((GGUF_DIT, mixed_kind), (GGUF_Q3_DIT, q3_mixed_kind)):
        start = time.perf_counter()
        gguf_dit = write_gguf_dit(pipe.transformer.state_dict(), models_dir / name, kind)
        print(f"{name}: {gguf_dit.stat().st_size / 1e6:,.1f} MB in {time.perf_counter() - start:.1f} s", flush=True)
    (models_dir / _DONE).write_text("ok\n")
    return models_dir


def write_gguf_text_encoders(models_dir: Path, names: list[str], true_size: bool) -> None:
    """The ``GGUF_TEXT_ENCODERS`` files ``names`` not written yet: true size from random blocks (on the CPU, seconds:
    no model is built), tiny from the tiny text encoder's weights."""
    missing = [name for name in names if not (models_dir / name).is_file()]
    pipe = None if true_size or not missing else make_pipeline()
    for name in missing:
        start, path = time.perf_counter(), models_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if true_size:
            write_true_size(path, TRUE_MINISTRAL, GGUF_TEXT_ENCODERS[name], GGUF_NAME)
        else:
            write_from_model(path, pipe.text_encoder.language_model, GGUF_TEXT_ENCODERS[name], pipe.tokenizer,
                             GGUF_NAME)
        print(f"{name}: {path.stat().st_size / 1e6:,.1f} MB in {time.perf_counter() - start:.1f} s", flush=True)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models_dir", type=Path)
    parser.add_argument("--true-size", action="store_true", help="the released sizes, on the GPU")
    parser.add_argument("--gguf-text-encoders", default="", help="comma-separated names of GGUF_TEXT_ENCODERS to "
                        "write too (once)")
    args = parser.parse_args()
    write_models(args.models_dir, args.true_size)
    write_gguf_text_encoders(args.models_dir, [n for n in args.gguf_text_encoders.split(",") if n], args.true_size)


if __name__ == "__main__":
    main()
