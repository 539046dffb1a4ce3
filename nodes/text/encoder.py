"""ERNIE-Image's text encoder: Mistral3's language model, second-to-last hidden state per prompt (engine).

As in ``ErnieImagePipeline.encode_prompt``: the tokenizer adds its special tokens, no chat template, no
padding; an empty prompt becomes the BOS token; the embedding is ``hidden_states[-2]`` of shape ``[T, D]``.
The vision tower of the checkpoint is never used, so only the language model is read (``ministral_file``, which
checks the files before anything is built), from a snapshot or from ComfyUI's repack (one ``.safetensors`` with the
tokenizer inside), or from a GGUF file of llama.cpp's converter (``ministral_gguf``, the tokenizer in its metadata).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ErnieImageError
from ..ministral_file import load_ministral_folder, read_config, read_ministral_file
from ..ministral_gguf import read_ministral_gguf
from ..model_files import read_json
from .streaming import LayerStream

TEXT_ENCODER_CLASSES = ("Mistral3Model", "Mistral3ForConditionalGeneration")


class ErnieTextEncoder:
    """A tokenizer and the language model that turns prompts into ERNIE-Image text embeddings; ``source``: the file
    or folder its weights came from, named when they make embeddings no image can be made from."""

    def __init__(self, language_model: torch.nn.Module, tokenizer, source: str = "the text encoder"):
        self.language_model = language_model.eval()
        self.tokenizer = tokenizer
        self.source = source

    @classmethod
    def from_snapshot(cls, snapshot: Path, dtype: torch.dtype, fp8: bool = False) -> ErnieTextEncoder:
        """Load ``text_encoder/`` (its language model) and ``tokenizer/`` of an ERNIE-Image snapshot (safetensors
        only); ``fp8``: its decoder linears held in fp8 (``ministral_file``)."""
        from transformers import AutoTokenizer, Mistral3Config

        encoder_dir, tokenizer_dir = snapshot / "text_encoder", snapshot / "tokenizer"
        for folder in (encoder_dir, tokenizer_dir):
            if not folder.is_dir():
                raise ErnieImageError(
                    f"The snapshot {snapshot} has no {folder.name}/ folder. The download is incomplete: "
                    "download the whole snapshot."
                )
        config_path = encoder_dir / "config.json"
        architectures = []
        if config_path.is_file():
            architectures = read_json(config_path).get("architectures") or []
        if not set(architectures) & set(TEXT_ENCODER_CLASSES):
            raise ErnieImageError(
                f"{encoder_dir} holds {architectures or 'no model config'}, not ERNIE-Image's Mistral3 text encoder."
            )
        text_config = read_config(Mistral3Config, encoder_dir, "text encoder").text_config
        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        except (OSError, ValueError) as e:
            raise ErnieImageError(f"Cannot load the text encoder in {snapshot} ({e}). Download it again.") from e
        model = load_ministral_folder(encoder_dir, text_config, dtype, what="text encoder", lm_head=False,
                                      instead="download the whole snapshot again", fp8=fp8)
        return cls(model.model, tokenizer, str(encoder_dir))

    @classmethod
    def from_single_file(cls, path: Path, dtype: torch.dtype, fp8: bool = False) -> ErnieTextEncoder:
        """Load ComfyUI's repack ``ministral-3-3b.safetensors`` (the language model with its tokenizer inside)."""
        model, tokenizer = read_ministral_file(
            path, dtype, what="text encoder", lm_head=False, fp8=fp8,
            instead="use an ERNIE-Image snapshot folder (its text_encoder/ and tokenizer/) instead",
        )
        # The snapshot's tokenizer puts a BOS before every prompt (diffusers encodes with add_special_tokens=True);
        # a tokenizer converted from tekken.json does not unless told to.
        tokenizer.add_bos_token = True
        tokenizer.update_post_processor()
        return cls(model.model, tokenizer, str(path))

    @classmethod
    def from_gguf(cls, path: Path, dtype: torch.dtype) -> ErnieTextEncoder:
        """Load a GGUF text encoder as llama.cpp's converter writes it (``ministral_gguf``: the tokenizer from its
        metadata; quantized decoder layers kept as blocks and decoded as they run)."""
        model, tokenizer = read_ministral_gguf(
            path, dtype, what="text encoder", lm_head=False, add_bos=True,  # as the snapshot's tokenizer does
            instead="use ComfyUI's ministral-3-3b.safetensors or an ERNIE-Image snapshot folder instead",
        )
        return cls(model.model, tokenizer, str(path))

    @property
    def embedding_dim(self) -> int:
        return self.language_model.config.hidden_size

    def token_ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=True, truncation=True, padding=False)["input_ids"]
        if not ids:
            ids = [self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else 0]
        return ids

    @torch.no_grad()
    def encode(self, text: str, device: torch.device, stream: LayerStream | None = None) -> torch.Tensor:
        """The ``[T, D]`` embedding of one prompt, computed on ``device``; an error naming the weights' file when it
        holds a NaN or an infinity (weights with absurd values: the DiT would sample a black image from it).
        ``stream``: the language model's ``LayerStream`` through ``device``, which passes the weights through it a
        decoder layer at a time (the same embedding)."""
        input_ids = torch.tensor([self.token_ids(text)])
        if stream is None:
            outputs = self.language_model(input_ids=input_ids.to(device), output_hidden_states=True)
            embedding = outputs.hidden_states[-2][0]
        else:
            embedding = stream.hidden_before_last_layer(input_ids)[0]
        if not bool(torch.isfinite(embedding).all()):
            raise ErnieImageError(
                f"The text encoder {self.source} made text embeddings that are not finite (NaN or infinity): its "
                "weights hold values no prompt can be encoded with, so the image would be black. The file is damaged: "
                "download it again, or load another text encoder file.")
        return embedding
