"""Convert the tiny text encoder and PE (``tiny_models.make_pipeline``) to GGUF with llama.cpp's own converter: the
fixtures of tests/fixtures/gguf/ (their test: tests/test_text_gguf.py).

llama.cpp is not vendored: give the folder of a copy, e.g. the one the llama-cpp-python 0.3.36 source distribution
carries (``vendor/llama.cpp``, llama.cpp 0c1e57098), extracted outside the repository::

    python -m scripts.tiny_ministral_gguf /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp tests/fixtures/gguf

Each model is saved as a Hugging Face folder (``Ministral3ForCausalLM``, its tokenizer) and converted by
``convert_hf_to_gguf.py --outtype q8_0``, run unchanged but for one answer: its BPE pre-tokenizer lookup
(``TextModel.get_vocab_base_pre``) knows tokenizers by the hash of their ids for a test text, and the tiny
tokenizer's is in no table, so it is told ``gpt-2`` (the tiny tokenizer's split is GPT-2's; a real Ministral 3
tokenizer.json hashes to ``tekken``). The converter imports its own ``gguf-py`` (put first on the path).
"""

from __future__ import annotations

import argparse
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

TEXT_ENCODER = "ernie-image-text-encoder-tiny"
PROMPT_ENHANCER = "ernie-image-prompt-enhancer-tiny"
OUTTYPE = "q8_0"


def save_hf_folders(folder: Path, seed: int = 0) -> dict[str, Path]:
    """The tiny text encoder's language model and the tiny PE, each as a Hugging Face folder with its tokenizer."""
    from transformers import Ministral3ForCausalLM

    from scripts.tiny_models import make_pipeline

    pipe = make_pipeline(seed)
    text_encoder = Ministral3ForCausalLM(pipe.text_encoder.config.text_config)
    text_encoder.model.load_state_dict(pipe.text_encoder.language_model.state_dict())
    text_encoder.tie_weights()
    models = {TEXT_ENCODER: (text_encoder, pipe.tokenizer), PROMPT_ENHANCER: (pipe.pe, pipe.pe_tokenizer)}
    for name, (model, tokenizer) in models.items():
        model.save_pretrained(folder / name, safe_serialization=True)
        tokenizer.save_pretrained(folder / name)
    return {name: folder / name for name in models}


def _run_converter() -> None:
    """In a process of its own (its ``gguf-py`` before any other ``gguf``): ``convert_hf_to_gguf.py`` with
    ``sys.argv[1:]`` (the llama.cpp folder first)."""
    llama_cpp = Path(sys.argv[1])
    sys.path[:0] = [str(llama_cpp), str(llama_cpp / "gguf-py")]
    import conversion.base

    conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    sys.argv = [str(llama_cpp / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")


def convert(llama_cpp: Path, model: Path, out: Path) -> None:
    """``convert_hf_to_gguf.py model --outtype q8_0 --outfile out``."""
    code = "from scripts.tiny_ministral_gguf import _run_converter; _run_converter()"
    subprocess.run([sys.executable, "-c", code, str(llama_cpp), str(model), "--outtype", OUTTYPE, "--outfile",
                    str(out)], check=True, cwd=Path(__file__).resolve().parents[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("llama_cpp", type=Path, help="a llama.cpp source folder (with convert_hf_to_gguf.py)")
    parser.add_argument("out", type=Path, help="the folder to write the GGUF files into")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        for name, model in save_hf_folders(Path(folder)).items():
            convert(args.llama_cpp, model, args.out / f"{name}-{OUTTYPE.upper()}.gguf")


if __name__ == "__main__":
    main()
