"""One fingerprint of model files (``model_files.file_stamps``) for the PE's result cache and the saved SVDQuant
DiTs, giving the values both gave before it, so that what users have cached stays valid (engine, no server)."""

from __future__ import annotations

import hashlib
import json

from comfyui_ernie_image.nodes.model_files import file_stamps
from comfyui_ernie_image.nodes.pe.local.weights import PESource
from comfyui_ernie_image.nodes.quant.saved import source_identity, weight_files


def test_the_pe_identity_is_as_before(tiny_models):
    source = PESource(tiny_models["pe_folder"], tiny_models["pe_folder"])
    files = sorted(source.weights.iterdir()) + [source.tokenizer / name for name in
                                                ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                                                 "tekken.json")]
    before = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
    digest = hashlib.sha256(json.dumps(before).encode()).hexdigest()[:16]
    assert source.identity() == f"{source.weights.resolve()}#{digest}"


def test_the_svdq_record_is_as_before(tiny_models):
    for source in (tiny_models["snapshot"], tiny_models["single_file"]):
        before = [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in weight_files(source)]
        assert source_identity(source) == {"path": str(source.resolve()), "files": before}


def test_files_that_are_not_there_are_left_out(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"12345")
    stamps = file_stamps([tmp_path / "a.safetensors", tmp_path / "missing.json", tmp_path])
    assert stamps == [[str(tmp_path / "a.safetensors"), 5, (tmp_path / "a.safetensors").stat().st_mtime_ns]]
