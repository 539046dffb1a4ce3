"""Install as a user does: a brand-new Python environment with ComfyUI's own requirements, then the pack as ComfyUI
Manager installs it (its files under another folder name in custom_nodes/, its requirements.txt resolved by pip),
ComfyUI started with that environment's Python: every node registers and nothing fails to import.

The new environment holds only what ComfyUI's requirements.txt and the pack's requirements.txt bring (torch pinned as
the test setup pins it, since the pack never pins torch), so a dependency that the pack imports but forgot to list
fails here even when the test venv happens to have it.
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
PACK_FOLDER = "ERNIE-Image For ComfyUI"  # not the repository's name: imports must be relative
# torch as the test setup installs it (tests/requirements.txt): a CPU-runnable build from this machine's disk. A user's
# ComfyUI has its own torch; ComfyUI's requirements.txt names torch without a version.
TORCH_PINS = re.findall(r"^(?:torch|torchvision)==\S+", (REPO / "tests" / "requirements.txt").read_text(), re.MULTILINE)


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return out.split()


def _pip_install(python, *args: str) -> str:
    result = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", *args],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def _version(python, package: str) -> str:
    return subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_requirements_resolve_without_pinning_torch():
    requirements = (REPO / "requirements.txt").read_text()
    assert not re.search(r"^torch\b", requirements, re.MULTILINE), "ComfyUI Manager must not fight the user's torch"
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "-q", "-r", "requirements.txt"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_fresh_environment_with_comfyui_then_the_pack_registers_every_node(tmp_path):
    assert len(TORCH_PINS) == 2, TORCH_PINS
    venv = tmp_path / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = venv / "bin" / "python"
        bare = subprocess.run([str(python), "-c", "import torch"], capture_output=True)
        assert bare.returncode != 0, "the new environment must not see the test environment's packages"
        _pip_install(python, "-r", str(COMFY_DIR / "requirements.txt"), *TORCH_PINS)
        torch_version = _version(python, "torch")

        copy = tmp_path / "custom_nodes_src" / PACK_FOLDER
        for name in _tracked_files():  # what a git clone by ComfyUI Manager holds
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
        _pip_install(python, "-r", str(copy / "requirements.txt"))  # what ComfyUI Manager runs
        assert _version(python, "torch") == torch_version, "the pack's requirements changed the user's torch"

        (tmp_path / "models").mkdir()
        server = ComfyServer(COMFY_DIR, tmp_path / "base", copy, tmp_path / "models", pack_name=PACK_FOLDER,
                             python=python)
        server.start()
        try:
            registered = set(server.object_info())
            log = server.log()
        finally:
            server.stop()
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # several GB (torch): not kept among pytest's temporary folders
    assert str(python) == server.args[0]
    pack_lines = [line for line in log.splitlines() if PACK_FOLDER in line]  # ComfyUI names the pack's failures
    assert NODE_IDS <= registered, (NODE_IDS - registered, pack_lines)
    assert not [line for line in pack_lines if "IMPORT FAILED" in line or "Cannot import" in line], pack_lines
    assert re.search(rf"\d+\.\d+ seconds: .*{re.escape(PACK_FOLDER)}", log), "the pack is not in ComfyUI's import times"
