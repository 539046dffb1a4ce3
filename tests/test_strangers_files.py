"""Issue 24, files: names from a stranger's workflow, and model folders with damaged or hostile contents.

Every resolver refuses a name that leaves its model folder (``..``, absolute, a drive), also when the node's
``validate_inputs`` and schema check are bypassed (its own ``execute`` code called directly); a symlink the user put
inside the folder still works. A damaged ``model_index.json`` hides its folder, not the pack's loaders, and a
symlink loop does not make the model list endless."""

from __future__ import annotations

import inspect
import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import folder_paths
import pytest
import torch
from safetensors.torch import load_file, save_file

from comfyui_ernie_image.nodes.dit.nodes import ErnieImageVAELoader
from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.loaders import ErnieImageDiTLoader, ErnieImageLoader
from comfyui_ernie_image.nodes.lora.nodes import ErnieImageLoraLoader
from comfyui_ernie_image.nodes.paths import snapshot_names, snapshot_path
from comfyui_ernie_image.nodes.pe.nodes import ErnieImagePELoader
from comfyui_ernie_image.nodes.text.nodes import ErnieImageTextEncoderLoader
from helpers.files import linked_copy
from helpers.parses import count_header_parses

SNAPSHOT = "ERNIE-Image-Turbo-tiny"
LOADERS = ("ErnieImageLoader", "ErnieImageDiTLoader", "ErnieImageTextEncoderLoader", "ErnieImagePELoader")


def _own_execute(node: type) -> Callable:
    """The node's own ``execute`` code, without the schema check in front of it (as if every check before the
    resolver had been bypassed)."""
    return inspect.unwrap(node.__dict__["execute"].__func__).__get__(node)


def _within(seconds: float, function: Callable):
    """``function()``'s result, or a failure when it has not returned after ``seconds`` (it runs in a thread that is
    left behind: a hung listing cannot be stopped)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(function()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"{function.__name__} did not return within {seconds} s"
    return result[0]


@pytest.fixture
def outside(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """Real models outside the models folder, where a traversal name would reach: a snapshot and a weights file."""
    folder = tmp_path_factory.mktemp("outside")
    return {"snapshot": linked_copy(tiny_models["snapshot"], folder / "snap"),
            "file": linked_copy(tiny_models["single_file"], folder / "weights.safetensors")}


def _names(target: Path, root: Path) -> list[str]:
    """Names a workflow could give for ``target`` from the model folder ``root``: relative with ``..``, the same
    behind a detour, absolute, with backslashes (Windows' separator), a drive, a NUL."""
    relative = os.path.relpath(target, root)
    return [relative, f"x/../{relative}", str(target), relative.replace("/", "\\"), f"C:/{relative}",
            f"{relative}\0.safetensors"]


def _cases(models: Path, outside: dict[str, Path]) -> list[tuple[type, str, Callable[[str], tuple]]]:
    """(node, folder named in the refusal, the node's arguments for a name) for every resolver of the pack."""
    snap, file = outside["snapshot"], outside["file"]
    diffusers, text_encoders = models / "diffusers", models / "text_encoders"
    return [
        (ErnieImageLoader, "diffusers", _names(snap, diffusers), lambda n: (n,)),
        (ErnieImageDiTLoader, "diffusers", _names(snap, diffusers), lambda n: ("diffusers/" + n,)),
        (ErnieImageDiTLoader, "diffusion_models", _names(file, models / "diffusion_models"), lambda n: (n,)),
        (ErnieImageTextEncoderLoader, "diffusers", _names(snap, diffusers), lambda n: (n,)),
        (ErnieImageTextEncoderLoader, "text_encoders", _names(file, text_encoders), lambda n: ("text_encoders/" + n,)),
        (ErnieImageVAELoader, "vae", _names(file, models / "vae"), lambda n: (n,)),
        (ErnieImageLoraLoader, "loras", _names(file, models / "loras"), lambda n: (None, n, 1.0)),
        (ErnieImagePELoader, "diffusers", _names(snap, diffusers), lambda n: ("diffusers/" + n, "cpu", "auto")),
        (ErnieImagePELoader, "text_encoders", _names(snap / "pe", text_encoders),
         lambda n: ("text_encoders/" + n, "cpu", "auto")),
    ]


def test_a_name_out_of_the_model_folder_is_refused_by_every_resolver(comfy_paths, tiny_models, outside):
    """On main, ``../../outside/snap`` and the absolute path loaded the snapshot outside the models folder."""
    models = tiny_models["models_dir"]
    attacks = 0
    for node, folder, names, arguments in _cases(models, outside):
        for name in names:
            with pytest.raises(ErnieImageError) as error:
                _own_execute(node)(*arguments(name))
            assert str(error.value).startswith(
                f"{repr(name)[:120]} is not a model name under ComfyUI's models/{folder}: a name is a path relative "
                "to that folder, without '..', '.' or empty parts, not absolute and without a drive."), (
                node.__name__, name, str(error.value))
            attacks += 1
    assert attacks == 54


def test_a_snapshot_the_user_linked_into_the_folder_is_listed_and_loads(comfy_paths, tiny_models, outside):
    """The rule compares names, not resolved paths: a folder linked in from another disk is the user's choice. (The
    same test refuses the traversal to that folder, so that it fails on a pack that allows both.)"""
    link, again = (tiny_models["models_dir"] / "diffusers" / name for name in ("linked-from-elsewhere", "same-again"))
    link.symlink_to(outside["snapshot"], target_is_directory=True)
    again.symlink_to(outside["snapshot"], target_is_directory=True)  # two names for one folder: both are listed
    try:
        assert {"linked-from-elsewhere", "same-again"} <= set(snapshot_names())
        assert snapshot_path("linked-from-elsewhere") == link
        with pytest.raises(ErnieImageError, match="is not a model name under ComfyUI's models/diffusers"):
            snapshot_path(os.path.relpath(outside["snapshot"], link.parent))
    finally:
        link.unlink()
        again.unlink()


BAD_INDEXES = {
    "bad-list": json.dumps([{"_class_name": "ErnieImagePipeline"}]),
    "bad-string": json.dumps("ErnieImagePipeline"),
    "bad-number": "24",
    "bad-invalid": '{"_class_name": "ErnieImagePipeline"',
    "bad-utf8": b'{"_class_name": "\xff"}',
    "bad-deep": "[" * 100_000 + "]" * 100_000,  # json.loads raises RecursionError, no ValueError
}


@pytest.fixture
def damaged_folders(tiny_models):
    """Folders under models/diffusers whose model_index.json is not an object, and a PE folder under text_encoders
    whose config.json is a list; removed after the test (the server is shared)."""
    made = []
    for name, text in BAD_INDEXES.items():
        folder = tiny_models["models_dir"] / "diffusers" / name
        folder.mkdir()
        (folder / "model_index.json").write_bytes(text if isinstance(text, bytes) else text.encode())
        made.append(folder)
    pe = tiny_models["models_dir"] / "text_encoders" / "bad-pe-config"
    pe.mkdir()
    (pe / "config.json").write_text("[]")
    (pe / "tokenizer.json").write_text("{}")
    made.append(pe)
    yield made
    for folder in made:
        for file in folder.iterdir():
            file.unlink()
        folder.rmdir()


def _listed(info: dict, node: str) -> list[str]:
    return info[node]["input"]["required"]["model_name"][1]["options"]


def test_a_damaged_model_index_hides_its_folder_not_the_loaders_in_the_server(comfy_server, damaged_folders):
    """On main, a list or a string (AttributeError) or deep nesting (RecursionError) in one folder's
    model_index.json made every loader of the pack vanish from object_info."""
    info = comfy_server.object_info()
    assert set(LOADERS) <= set(info)
    assert f"diffusers/{SNAPSHOT}" in _listed(info, "ErnieImageLoader")
    assert f"diffusers/{SNAPSHOT}" in _listed(info, "ErnieImageDiTLoader")
    assert "text_encoders/ernie-image-prompt-enhancer-tiny" in _listed(info, "ErnieImagePELoader")
    listed = {*_listed(info, "ErnieImageLoader"), *_listed(info, "ErnieImagePELoader")}
    assert not {name for name in listed if "bad-" in name}
    log = comfy_server.wait_for_log("diffusers/bad-list/model_index.json is a JSON list, not an object, so its "
                                    "folder is not listed", 0)
    assert "bad-pe-config/config.json is a JSON list, not an object" in log


def test_a_symlink_loop_under_diffusers_is_walked_once_in_the_server(comfy_server, tiny_models):
    """On main, ``diffusers/loop -> .`` listed the snapshot again under loop/, loop/loop/, ... (40 deep, until the
    system's link limit)."""
    loop = tiny_models["models_dir"] / "diffusers" / "loop"
    loop.symlink_to(".", target_is_directory=True)
    try:
        info = comfy_server.object_info()
    finally:
        loop.unlink()
    assert f"diffusers/{SNAPSHOT}" in _listed(info, "ErnieImageLoader")
    assert [name for name in _listed(info, "ErnieImageLoader") if name.startswith("diffusers/loop")] == []


def test_loops_fifos_and_huge_indexes_cannot_stall_the_model_list(tiny_models, tmp_path, monkeypatch):
    """Two loops side by side make the walk of main 2^40 folders long; a FIFO named model_index.json blocked its read
    forever; a 2 MB index was read whole at every listing (and listed)."""
    diffusers = tmp_path / "diffusers"
    linked_copy(tiny_models["snapshot"], diffusers / "good")
    for name in ("a", "b"):
        (diffusers / name).symlink_to(".", target_is_directory=True)
    (diffusers / "fifo").mkdir()
    os.mkfifo(diffusers / "fifo" / "model_index.json")
    (diffusers / "huge").mkdir()
    (diffusers / "huge" / "model_index.json").write_text('{"_class_name": "ErnieImagePipeline"}' + " " * (2 << 20))
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "diffusers", ([str(diffusers)], set()))
    assert _within(20, snapshot_names) == ["good"]


# Issue 41: a safetensors header is parsed once per file and load, Cancel stops a DiT load between tensors, and no
# error quotes a whole name from a file.


def test_a_dit_checkpoint_of_85000_foreign_keys_has_its_header_parsed_once(tiny_models, placed, monkeypatch):
    """The DiT under ComfyUI's checkpoint prefix beside 85 000 empty tensors of other models: main parsed the whole
    header again for each of the DiT's tensors (12 s on the audit's machine)."""
    tensors = {f"model.diffusion_model.{k}": v for k, v in load_file(tiny_models["single_file"]).items()}
    tensors |= {f"first_stage_model.part_{i}.weight": torch.zeros(0) for i in range(85_000)}
    save_file(tensors, placed("diffusion_models", "foreign_keys.safetensors"))
    parses = count_header_parses(monkeypatch)
    start = time.perf_counter()
    model = ErnieImageDiTLoader.execute("foreign_keys.safetensors", "default", "none").result[0]
    print(f"85 000 foreign keys: loaded in {time.perf_counter() - start:.2f} s")
    assert parses == {"foreign_keys.safetensors": 1}
    assert len(model.model.diffusion_model.layers) == 10


EIGHT_MIB_NAME = "first_stage_model." + "x" * (8 * 2**20 - 2**16)  # the header still fits under its 8 MiB cap


@pytest.mark.parametrize("where", ["beside the DiT", "in block 0"])
def test_an_8_mib_tensor_name_is_quoted_cut_short(tiny_models, placed, where):
    """Main echoed the name whole: an 8.4-million-character error. (In block 0, the error names block 1's key
    that is missing.)"""
    name = EIGHT_MIB_NAME if where == "beside the DiT" else "layers.0." + EIGHT_MIB_NAME
    save_file({**load_file(tiny_models["single_file"]), name: torch.zeros(1)},
              placed("diffusion_models", "long.safetensors"))
    with pytest.raises(ErnieImageError) as error:
        ErnieImageDiTLoader.execute("long.safetensors", "default", "none")
    message = str(error.value)
    assert len(message) < 2000, message[:300]
    assert "long.safetensors" in message and EIGHT_MIB_NAME[:150] in message and "characters)" in message


def _safetensors_bytes(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


@pytest.mark.parametrize("header, data, words", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4,
     "a, a F32 tensor of shape [2], is given 4 bytes"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4,
     "the bytes of b start at 0, not where the tensor before ends (4)"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8,
     "the bytes of a start at 4, not where the tensor before ends (0)"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "its tensors end at byte"),
    ({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "a has the unknown dtype"),
    ({"a": {"dtype": "F32", "shape": [1] * 9, "data_offsets": [0, 4]}}, b"\0" * 4, "a has no shape of at most 8"),
    ({"__metadata__": {"format": 1}}, b"", "its __metadata__ is not a JSON object of strings"),
    ([], b"", "its header is not a JSON object"),
])
def test_a_damaged_safetensors_header_is_refused_naming_the_file(tmp_path, header, data, words):
    """What safetensors checked on main (a tensor's bytes fit its dtype and shape; the tensors fill the data one
    after another) the pack's own reader checks, so that each file's header is parsed once."""
    from comfyui_ernie_image.nodes.model_files import read_header

    path = tmp_path / "damaged.safetensors"
    path.write_bytes(_safetensors_bytes(header, data))
    with pytest.raises(ErnieImageError) as error:
        read_header(path)
    assert str(error.value).startswith(f"Cannot read {path} ({words}")
    assert "The file is damaged or incomplete (an interrupted download?): download it again." in str(error.value)
