"""Where a local PE comes from, and reading it: safetensors weights plus a tokenizer with a chat template.

Three layouts:

- a Hugging Face snapshot of ERNIE-Image(-Turbo): ``pe/`` (``Ministral3ForCausalLM``) and ``pe_tokenizer/``;
- a Hugging Face folder with both (``pe/`` and ``pe_tokenizer/`` copied together, as for ``vllm serve``);
- ComfyUI's repack ``ernie-image-prompt-enhancer.safetensors`` (read by ``ministral_file``): the LM's keys plus
  the Mistral tokenizer as a ``tekken_model`` entry;
- a GGUF file of llama.cpp's converter (read by ``ministral_gguf``): the tokenizer in its metadata, the quantized
  decoder layers kept in their blocks and decoded as they run (no fp8: the file keeps its own types).

The chat template rendered is always Baidu's (``template``): a folder's own only when it is that same file.

``fp8``: the decoder layers' linears held in fp8 (``fp8_linear``, read through ``ministral_file``); the LM head, the
embeddings and the norms stay in the compute dtype. A file in core's fp8 layouts is fp8 either way.

Only safetensors and GGUF files are read and no remote code runs. No ComfyUI.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ...ministral_file import load_ministral_folder, read_config, read_ministral_file
from ...ministral_gguf import read_ministral_gguf
from ...model_files import file_stamps, is_gguf, read_json
from ..protocol import EnhancerError
from .template import chat_template, tokenizer_folder

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "tekken.json")


@dataclass(frozen=True)
class PESource:
    """PE weights on disk: a folder (``config.json`` + safetensors) or one file; ``tokenizer`` is the tokenizer
    folder, or None when the tokenizer lives inside the single file."""

    weights: Path
    tokenizer: Path | None

    def identity(self) -> str:
        """Names these exact weights and tokenizer (path, sizes, modification times) without reading them."""
        files = [self.weights] if self.weights.is_file() else sorted(self.weights.iterdir())
        if self.tokenizer is not None:
            files += [self.tokenizer / name for name in _TOKENIZER_FILES]
        digest = hashlib.sha256(json.dumps(file_stamps(files)).encode()).hexdigest()[:16]
        return f"{self.weights.resolve()}#{digest}"

    def load(self, dtype: torch.dtype, fp8: bool = False):
        """The model (on the CPU, eval mode; ``fp8``: its decoder linears in fp8) and its tokenizer (with a chat
        template)."""
        if is_gguf(self.weights):
            return _load_gguf(self.weights, dtype, self.chat_template())
        if self.weights.is_file():
            return _load_single_file(self.weights, dtype, fp8, self.chat_template())
        return _load_folder(self.weights, dtype, fp8), _load_tokenizer(self.tokenizer, self.chat_template())

    def chat_template(self) -> str:
        """The chat template the tokenizer renders (``template.chat_template``; its warnings are logged once)."""
        return chat_template(self.tokenizer)


def snapshot_source(snapshot: Path) -> PESource | None:
    """The PE of an ERNIE-Image snapshot folder, or None when it has no ``pe/``."""
    pe = snapshot / "pe"
    if not (pe / "config.json").is_file():
        return None
    tokenizer = snapshot / "pe_tokenizer"
    return PESource(pe, tokenizer if tokenizer.is_dir() else pe)


def path_source(path: Path) -> PESource:
    """A PE given by path: a snapshot folder, a Hugging Face folder, ComfyUI's single ``.safetensors`` file, or a
    GGUF file."""
    if path.is_file():
        if path.suffix != ".safetensors" and not is_gguf(path):
            raise EnhancerError(f"{path.name}: only .safetensors and .gguf prompt-enhancer files can be loaded")
        return PESource(path, None)
    source = snapshot_source(path)
    if source is not None:
        return source
    if (path / "config.json").is_file():
        return PESource(path, path)
    raise EnhancerError(
        f"{path} is not a prompt-enhancer folder: expected an ERNIE-Image snapshot (with pe/), or a folder with "
        "config.json, safetensors weights and the tokenizer"
    )


def _load_folder(folder: Path, dtype: torch.dtype, fp8: bool):
    from transformers import GenerationConfig, Ministral3Config

    model_type = read_json(folder / "config.json").get("model_type")
    if model_type != "ministral3":
        raise EnhancerError(f"{folder} holds a {model_type!r} model; the ERNIE-Image prompt enhancer is 'ministral3'")
    if not any(folder.glob("*.safetensors")):
        raise EnhancerError(f"{folder} has no .safetensors weights (other weight formats are not loaded)")
    config = read_config(Ministral3Config, folder, "prompt enhancer", EnhancerError)
    model = load_ministral_folder(folder, config, dtype, what="prompt enhancer", error=EnhancerError,
                                  instead="download the prompt enhancer's folder again", fp8=fp8)
    if (folder / "generation_config.json").is_file():  # its stop tokens, as transformers' own folder loading reads
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model


def _load_tokenizer(folder: Path, template: str):
    from transformers import AutoTokenizer

    with tokenizer_folder(folder) as staged:
        tokenizer = AutoTokenizer.from_pretrained(staged, trust_remote_code=False)
    tokenizer.chat_template = template
    return tokenizer


def _load_single_file(path: Path, dtype: torch.dtype, fp8: bool, template: str):
    return read_ministral_file(
        path, dtype, what="prompt enhancer", error=EnhancerError,
        instead="use the ERNIE-Image snapshot's pe/ and pe_tokenizer/, or a folder with the weights and the tokenizer",
        chat_template=template,  # the repack has none: Baidu's
        fp8=fp8,
    )


def _load_gguf(path: Path, dtype: torch.dtype, template: str):
    model, tokenizer = read_ministral_gguf(
        path, dtype, what="prompt enhancer", error=EnhancerError,
        instead="use the ERNIE-Image snapshot's pe/ and pe_tokenizer/, or ernie-image-prompt-enhancer.safetensors",
    )
    tokenizer.chat_template = template  # Baidu's, as for every layout
    return model, tokenizer
