"""Host RAM while a model is read: from safetensors, moved away piece by piece (``model_files.read_safetensors``);
from GGUF, read without mapping the file (``gguf/reader.py``).

safetensors maps a file once per handle and keeps every page a tensor of that handle touched until the last of
them is gone. A DiT read through one handle so kept its whole file in host RAM while its blocks were quantized and
moved to the GPU one by one (26.9 GiB on an emulated 16 GB card, bench/RESULTS.md 2026-12-02). A GGUF DiT checked
through the ``gguf`` package's map of its file, then copied, was held twice at the load's peak (session 18). These
tests measure the process's resident pages of a real file's mappings (Linux ``/proc/self/smaps``).
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from comfyui_ernie_image.nodes.dit.gguf import load_gguf_dit
from comfyui_ernie_image.nodes.dit.model import ErnieImageDiffusionModel
from comfyui_ernie_image.nodes.model_files import read_safetensors
from scripts.gguf_writer import uniform_kind, write_gguf
from scripts.tiny_models import tiny_dit_state

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")

MIB = 2**20
TENSOR_MIB = 16


def resident_mib(path: Path) -> float:
    """This process's resident pages of ``path``'s mappings (``/proc/self/smaps``): nothing else's memory counts."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:  # a mapping's first line: range, perms, ..., path
            inside = fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total / 1024


@pytest.fixture
def blocks_file(tmp_path: Path) -> Path:
    path = tmp_path / "blocks.safetensors"
    save_file({f"layers.{i}.weight": torch.full((TENSOR_MIB * MIB // 4,), float(i)) for i in range(8)}, path)
    return path


@pytest.mark.parametrize("keys", ["all", "named"])
def test_a_tensor_moved_away_gives_back_its_pages(blocks_file: Path, keys: str) -> None:
    tensors = read_safetensors(blocks_file, None if keys == "all" else [f"layers.{i}.weight" for i in range(8)])
    for tensor in tensors.values():
        tensor[:: 1024].sum()  # a number on every 4 KiB page: all of them resident now
    before = resident_mib(blocks_file)
    assert before >= 0.8 * 8 * TENSOR_MIB  # the measure sees the file
    for i in range(7):  # as the per-block quantization replaces each block's weights with new ones
        tensors[f"layers.{i}.weight"] = tensors[f"layers.{i}.weight"][:1].clone()
    gc.collect()
    freed = before - resident_mib(blocks_file)
    # Seven 16 MiB tensors' pages left (through one handle: none until the eighth is gone too).
    assert freed >= 0.8 * 7 * TENSOR_MIB, f"only {freed:.0f} MiB of file pages went with seven moved tensors"
    assert float(tensors["layers.7.weight"][0]) == 7.0  # the one kept is still read from the file


def test_a_gguf_dit_is_read_without_its_file_resident(tmp_path: Path, monkeypatch) -> None:
    path = write_gguf(tmp_path / "tiny-Q8_0.gguf", tiny_dit_state(), uniform_kind("Q8_0"))
    at_assembly = []
    real = ErnieImageDiffusionModel.load_state_dict

    def spy(self, *args, **kwargs):  # called once every tensor has been read and checked, before the model is given
        at_assembly.append(resident_mib(path))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ErnieImageDiffusionModel, "load_state_dict", spy)
    model = load_gguf_dit(path, torch.float32)
    assert at_assembly == [0.0], f"{at_assembly} MiB of the {path.stat().st_size / MIB:.2f} MiB file resident"
    assert model.layers[0].mlp.up_proj.gguf_type == "Q8_0"
