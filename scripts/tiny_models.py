"""Tiny random ERNIE-Image models in the real on-disk layouts, for tests and the offline demo.

No machine here reaches a model hub, so tests build the real diffusers / transformers classes at a
tiny size with random weights and save them exactly as users find them on disk:

- a Hugging Face snapshot (``model_index.json``, ``transformer/``, ``text_encoder/``, ``tokenizer/``,
  ``vae/``, ``scheduler/``, ``pe/``, ``pe_tokenizer/``) written by ``ErnieImagePipeline.save_pretrained``;
- ComfyUI repack single files (``diffusion_models/*.safetensors`` with diffusers' DiT keys);
- the PE under ``text_encoders/``: a Hugging Face folder and a ComfyUI-style single file (tokenizer inside).

Run as a script to write both layouts under a ComfyUI ``models`` folder (``--gguf``: the DiT as a GGUF too).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors.torch import save_file

# A vocabulary whose words are printable, so a random PE still decodes to visible text.
_WORDS = (
    "a the cat dog sits on red blue green mat under over sky sun moon tree house river "
    "mountain city street night day light dark bright small big old young woman man child "
    "photo painting style detailed portrait landscape of with and in at"
).split()

# The PE chat template: the pack's copy of Baidu's, as a real snapshot's pe_tokenizer/ carries it (the local PE renders
# no other: a folder with another template gets a warning and this one).
PE_CHAT_TEMPLATE = (Path(__file__).resolve().parents[1] / "nodes" / "pe" / "local" / "chat_template.jinja").read_text(
    encoding="utf-8")

TINY_DIT = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_layers=10,
    ffn_hidden_size=128,
    in_channels=128,
    out_channels=128,
    text_in_dim=32,
    rope_axes_dim=(4, 6, 6),
)
TINY_GGUF = "ernie-image-turbo-tiny-Q4_K_M.gguf"  # --gguf: under diffusion_models/


def make_tokenizer(chat_template: str | None = None):
    """A byte-level BPE tokenizer trained in a moment on a small corpus, with Mistral's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM]", "[/SYSTEM]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = [" ".join(_WORDS[i:] + _WORDS[:i]) for i in range(len(_WORDS))] + ["猫 狗 天空 一只 红色 的"]
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.model_max_length = 256
    if chat_template is not None:
        fast.chat_template = chat_template
        fast.model_max_length = 4096  # Baidu's PE system prompt alone is 382 tokens of this byte-level vocabulary
    return fast


def _ministral3_config(vocab_size: int, hidden_size: int):
    """Tiny, but with Ministral 3's 128-wide heads: single-file loaders read the head count off that width."""
    from transformers import Ministral3Config

    return Ministral3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=128,
        pad_token_id=3,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )


def randomise_zero_init(transformer: torch.nn.Module, generator: torch.Generator) -> None:
    """diffusers zero-initialises the output and modulation layers; a zero DiT predicts zeros and caches
    look perfect, so give them random weights like every other layer."""
    with torch.no_grad():
        for module in (transformer.final_linear, transformer.adaLN_modulation[-1]):
            module.weight.normal_(0.0, 0.05, generator=generator)
            module.bias.normal_(0.0, 0.05, generator=generator)


# --- Prompt enhancer (PE) -------------------------------------------------------------------------------------------
# The tiny PE keeps the real geometry where loaders depend on it (Ministral 3's 128-wide heads, tied embeddings) and is
# shaped so that it writes words: every other token scores exactly zero, words and EOS score around it, depending
# on the prompt.

# The pre-tokenizer split of GPT-2 byte-level BPE, which the tiny tokenizer uses; tekken files carry theirs.
_BYTE_LEVEL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def make_pe(tokenizer, generator: torch.Generator):
    """A tiny ``Ministral3ForCausalLM`` whose likeliest tokens are printable words (and EOS), float32."""
    import re

    from transformers import Ministral3ForCausalLM

    pe = Ministral3ForCausalLM(_ministral3_config(len(tokenizer), 32)).eval()
    words = [i for i in range(len(tokenizer)) if re.fullmatch(r" [a-z]{2,}", tokenizer.decode([i]))]
    words.append(tokenizer.eos_token_id)
    with torch.no_grad():
        embed = pe.model.embed_tokens.weight  # tied: also the LM head
        half = embed.shape[1] // 2
        # Dims [:half] carry the input; dims [half:] score the output, and only words have output dims.
        embed.normal_(0.0, 1.0, generator=generator)
        embed[:, half:] = 0.0
        embed[words, half:] = 0.3 * torch.randn(len(words), embed.shape[1] - half, generator=generator)
        pe.model.norm.weight[:half] = 0.0
        pe.model.norm.weight[half:] = 3.0
        # Strong unit-scale layers: the words depend on the whole prompt, not mostly on the previous word.
        for name, module in pe.model.layers.named_modules():
            if isinstance(module, torch.nn.Linear):
                gain = 3.0 if name.endswith(("o_proj", "down_proj")) else 1.0
                module.weight.normal_(0.0, gain * module.in_features**-0.5, generator=generator)
    return pe


def tekken_json(tokenizer) -> bytes:
    """The tokenizer as a Mistral ``tekken.json`` (what ComfyUI's repacks embed as ``tekken_model``)."""
    import base64
    import json

    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    specials = sorted((i, token.content) for i, token in tokenizer.added_tokens_decoder.items())
    assert [i for i, _ in specials] == list(range(len(specials))), "tekken numbers its special tokens first"
    regular = sorted((i, s) for s, i in tokenizer.get_vocab().items() if i >= len(specials))
    vocab = [
        {"rank": i - len(specials), "token_bytes": base64.b64encode(bytes(byte_of[c] for c in s)).decode(),
         "token_str": None}
        for i, s in regular
    ]
    config = {"pattern": _BYTE_LEVEL_PATTERN, "num_vocab_tokens": len(vocab), "default_vocab_size": len(tokenizer),
              "default_num_special_tokens": len(specials), "version": "v7"}
    special_tokens = [{"rank": i, "token_str": s, "is_control": True} for i, s in specials]
    return json.dumps({"config": config, "vocab": vocab, "special_tokens": special_tokens}).encode()


def save_pe_layouts(pipe, text_encoders_dir: Path) -> dict[str, Path]:
    """Write the snapshot's PE as a user would keep it under ``text_encoders``: a Hugging Face folder (``pe/`` and
    ``pe_tokenizer/`` merged, as for ``vllm serve``) and a ComfyUI-style single file with the tokenizer inside."""
    folder = text_encoders_dir / "ernie-image-prompt-enhancer-tiny"
    pipe.pe.save_pretrained(folder, safe_serialization=True)
    pipe.pe_tokenizer.save_pretrained(folder)
    single = text_encoders_dir / "ernie-image-prompt-enhancer-tiny.safetensors"
    state = {k: v.contiguous() for k, v in pipe.pe.state_dict().items() if k != "lm_head.weight"}  # tied
    state["tekken_model"] = tekken_entry(pipe.pe_tokenizer)
    save_file(state, str(single), metadata={"format": "pt"})
    return {"pe_folder": folder, "pe_single_file": single}


def tekken_entry(tokenizer) -> torch.Tensor:
    """The ``tekken_model`` tensor of a ComfyUI single file: the tokenizer's ``tekken.json`` as bytes."""
    return torch.frombuffer(bytearray(tekken_json(tokenizer)), dtype=torch.uint8)


def save_text_encoder_single_file(pipe, path: Path) -> Path:
    """The text encoder's language model as ComfyUI repacks it (``ministral-3-3b.safetensors``): ``model.`` keys and
    the tokenizer inside; no vision tower."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {f"model.{k}": v.contiguous() for k, v in pipe.text_encoder.language_model.state_dict().items()}
    state["tekken_model"] = tekken_entry(pipe.tokenizer)
    save_file(state, str(path), metadata={"format": "pt"})
    return path


def make_pipeline(seed: int = 0, with_pe: bool = True):
    """The whole ERNIE-Image pipeline at a tiny size, random weights, float32."""
    from diffusers import (
        AutoencoderKLFlux2,
        ErnieImagePipeline,
        ErnieImageTransformer2DModel,
        FlowMatchEulerDiscreteScheduler,
    )
    from transformers import Mistral3Config, Mistral3Model, PixtralVisionConfig

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    transformer = ErnieImageTransformer2DModel(**TINY_DIT)
    randomise_zero_init(transformer, generator)

    # The VAE keeps its real architecture (84M): ComfyUI's core VAE recognises the Flux.2 VAE only at that shape.
    vae = AutoencoderKLFlux2()
    with torch.no_grad():
        # Trained BN statistics are far from (0, 1); make them so, or epsilon mistakes hide.
        vae.bn.running_mean.normal_(0.0, 0.5, generator=generator)
        vae.bn.running_var.uniform_(0.5, 2.0, generator=generator)

    tokenizer = make_tokenizer()
    text_config = _ministral3_config(len(tokenizer), TINY_DIT["text_in_dim"])
    vision_config = PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16
    )
    text_encoder = Mistral3Model(Mistral3Config(text_config=text_config, vision_config=vision_config))

    pe = pe_tokenizer = None
    if with_pe:
        pe_tokenizer = make_tokenizer(PE_CHAT_TEMPLATE)
        pe = make_pe(pe_tokenizer, generator)

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=4.0)
    pipe = ErnieImagePipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        scheduler=scheduler,
        pe=pe.eval() if pe is not None else None,
        pe_tokenizer=pe_tokenizer,
    )
    return pipe


def save_snapshot(pipe, folder: Path) -> Path:
    """Write the Hugging Face snapshot layout (``baidu/ERNIE-Image-Turbo``'s shape) with safetensors only."""
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


def save_dit_single_file(transformer: torch.nn.Module, path: Path) -> Path:
    """Write the DiT as one ``.safetensors`` file with diffusers' keys, as in the ComfyUI repack."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in transformer.state_dict().items()}
    save_file(state, str(path), metadata={"format": "pt"})
    return path


def tiny_dit_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny DiT's weights (diffusers' class, zero-initialised layers randomised), float32."""
    from diffusers import ErnieImageTransformer2DModel

    torch.manual_seed(seed)
    transformer = ErnieImageTransformer2DModel(**TINY_DIT)
    randomise_zero_init(transformer, torch.Generator().manual_seed(seed))
    return {k: v.detach().contiguous() for k, v in transformer.state_dict().items()}


def write_gguf_dit(path: Path, seed: int = 0) -> Path:
    """The tiny DiT as a GGUF of the community's Q4_K_M types (random valid K-quant blocks: ``gguf_writer.py``)."""
    from scripts.gguf_writer import mixed_kind, write_gguf

    return write_gguf(path, tiny_dit_state(seed), mixed_kind)


def write_models_folder(models_dir: Path, seed: int = 0) -> dict[str, Path]:
    """A ComfyUI ``models`` folder holding one tiny snapshot and its parts as single files: the DiT
    (``diffusion_models``), the text encoder and the PE (``text_encoders``, the PE also as a folder), the VAE."""
    pipe = make_pipeline(seed)
    snapshot = save_snapshot(pipe, models_dir / "diffusers" / "ERNIE-Image-Turbo-tiny")
    single_file = models_dir / "diffusion_models" / "ernie-image-turbo-tiny.safetensors"
    single = save_dit_single_file(pipe.transformer, single_file)
    text_encoder = save_text_encoder_single_file(pipe, models_dir / "text_encoders" / "ministral-3-3b-tiny.safetensors")
    vae = models_dir / "vae" / "flux2-vae-tiny.safetensors"  # the snapshot's VAE file, as a single file
    vae.parent.mkdir(parents=True, exist_ok=True)
    vae.write_bytes((snapshot / "vae" / "diffusion_pytorch_model.safetensors").read_bytes())
    return {"snapshot": snapshot, "single_file": single, "text_encoder_file": text_encoder, "vae_file": vae,
            **save_pe_layouts(pipe, models_dir / "text_encoders")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models_dir", type=Path, help="a ComfyUI models folder to write into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gguf", action="store_true", help=f"also the DiT as diffusion_models/{TINY_GGUF} (needs "
                        "the gguf package; run as python -m scripts.tiny_models)")
    args = parser.parse_args()
    paths = write_models_folder(args.models_dir, args.seed)
    if args.gguf:
        paths["gguf_file"] = write_gguf_dit(args.models_dir / "diffusion_models" / TINY_GGUF, args.seed)
    for name, path in paths.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
