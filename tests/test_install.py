"""Install as ComfyUI Manager does: the pack's files under another folder name in custom_nodes/, its
requirements.txt resolved by pip, ComfyUI started: every node registers and nothing fails to import.

The environment is the test venv (ComfyUI's requirements and torch already there, as in a user's ComfyUI); pip
checks that requirements.txt is satisfiable there without changing it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

from comfy_headless import ComfyServer
from conftest import COMFY_DIR, REPO

NODE_IDS = {
    "ErnieImageLoader", "ErnieImageDiTLoader", "ErnieImageTextEncoderLoader", "ErnieImageTextEncode",
    "ErnieImageScheduler", "ErnieImagePELoader", "ErnieImagePERemote", "ErnieImagePromptEnhance",
    "ErnieImageCacheDiT", "ErnieImageCompile", "ErnieImageVAELoader",
}


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return out.split()


def test_requirements_resolve_without_pinning_torch():
    requirements = (REPO / "requirements.txt").read_text()
    assert not re.search(r"^torch\b", requirements, re.MULTILINE), "ComfyUI Manager must not fight the user's torch"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "-q", "-r", "requirements.txt"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_pack_under_another_folder_name_registers_every_node(tiny_models, tmp_path):
    copy = tmp_path / "pack-copy"
    for name in _tracked_files():  # what a git clone by ComfyUI Manager holds
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, copy / name)
    server = ComfyServer(COMFY_DIR, tmp_path / "base", copy, tiny_models["models_dir"],
                         pack_name="ERNIE-Image For ComfyUI")
    server.start()
    try:
        registered = set(server.object_info())
        log = server.log()
    finally:
        server.stop()
    assert NODE_IDS <= registered, NODE_IDS - registered
    pack_lines = [line for line in log.splitlines() if "ERNIE-Image For ComfyUI" in line]
    assert not [line for line in pack_lines if "IMPORT FAILED" in line or "Cannot import" in line], pack_lines
    assert re.search(r"\d+\.\d+ seconds: .*ERNIE-Image For ComfyUI", log), "the pack is not in ComfyUI's import times"
