"""Install as a user does: a brand-new Python environment with ComfyUI's own requirements, then the pack as ComfyUI
Manager installs it (its files under another folder name in custom_nodes/, its requirements.txt resolved by pip),
ComfyUI started with that environment's Python: every node registers and nothing fails to import.

The new environment holds only the user's torch and what ComfyUI's requirements.txt and the pack's requirements.txt
bring, so a dependency that the pack imports but forgot to list fails here even when the test venv happens to have it.
The user's torch is the test environment's torch, torchvision and what they need, linked rather than installed a second
time: a CUDA build is 5.5 GB, and a second copy once filled CI's disk.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from conftest import COMFY_DIR, REPO
from scripts.comfy_headless import ComfyServer

NODE_IDS = {
    "ErnieImageLoader", "ErnieImageDiTLoader", "ErnieImageTextEncoderLoader", "ErnieImageTextEncode",
    "ErnieImageScheduler", "ErnieImagePELoader", "ErnieImagePERemote", "ErnieImagePromptEnhance",
    "ErnieImageCacheDiT", "ErnieImageCompile", "ErnieImageVAELoader", "ErnieImageLoraLoader", "ErnieImageParallel",
}
PACK_FOLDER = "ERNIE-Image For ComfyUI"  # not the repository's name: imports must be relative
# A user's ComfyUI has its own torch; ComfyUI's requirements.txt names torch without a version.
USER_TORCH = ["torch", "torchvision"]
# ... and a ComfyUI environment's transformers (ComfyUI's requirements.txt asks for one).
COMFYUI_PACKAGES = [*USER_TORCH, "transformers"]
# The torch floor the README's install states (cache-dit's), and the wheels a torch upgrade from PyPI brings.
TORCH_FLOOR = re.search(r"torch ≥ ([\d.]+)", (REPO / "README.md").read_text())[1]
CUDA_WHEELS = ("nvidia-", "cuda-", "triton")


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return out.split()


def _pip_install(python, *args: str) -> str:
    result = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", *args],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result.stdout


def _distributions_needed(requirements: list[str]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions that `requirements` need, extras included (torch needs cuda-toolkit[cublas, ...])."""
    needed: dict[str, importlib.metadata.Distribution] = {}
    followed: set[tuple[str, str]] = set()
    todo = [Requirement(text) for text in requirements]
    while todo:
        requirement = todo.pop()
        dist = importlib.metadata.distribution(requirement.name)
        name = dist.metadata["Name"].lower()
        needed[name] = dist
        for extra in {"", *requirement.extras} - {e for n, e in followed if n == name}:
            followed.add((name, extra))
            todo += [dependency for dependency in map(Requirement, dist.requires or [])
                     if dependency.marker is None or dependency.marker.evaluate({"extra": extra})]
    return needed


def _link_user_packages(python: Path, into: Path, requirements: list[str]) -> None:
    """Makes the test environment's packages (torch: the user's own) the new environment's: what `requirements`
    need, linked into one folder that a .pth file puts on the new environment's path (after its site-packages, so
    anything pip installs there wins)."""
    into.mkdir()
    for dist in _distributions_needed(requirements).values():
        for top in {file.parts[0] for file in dist.files or []}:
            if top not in ("..", "__pycache__") and not top.endswith(".pth") and not (into / top).exists():
                (into / top).symlink_to(Path(dist.locate_file(top)))
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "user_packages.pth").write_text(f"{into}\n")


def _version(python, package: str) -> str:
    return subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_requirements_keep_a_torch_at_the_floor_and_bring_gguf(tmp_path):
    """pip's own resolution (a dry run, with its report) of requirements.txt in a ComfyUI environment whose torch
    meets the floor: it installs no torch, no CUDA wheel, keeps the environment's transformers, and brings gguf. Each
    torch requirement of what it would install admits the floor itself, so a torch 2.7.1 stays too (resolving against
    torch==2.7.1 directly would download its 821 MB wheel: this index serves no metadata-only files)."""
    requirements = (REPO / "requirements.txt").read_text()
    assert not re.search(r"^torch\b", requirements, re.MULTILINE), "ComfyUI Manager must not fight the user's torch"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    _link_user_packages(python, tmp_path / "comfyui_packages", COMFYUI_PACKAGES)
    report = tmp_path / "report.json"
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--dry-run",
                             "--disable-pip-version-check", "--report", str(report), "-r", "requirements.txt"],
                            cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    installs = {canonicalize_name(item["metadata"]["name"]): item["metadata"] for item in
                json.loads(report.read_text())["install"]}
    assert not {"torch", "torchvision", "transformers"} & set(installs), {n: installs[n]["version"] for n in installs}
    assert not [name for name in installs if name.startswith(CUDA_WHEELS)], sorted(installs)
    assert "gguf" in installs, sorted(installs)
    needs = [(name, Requirement(text)) for name, item in installs.items() for text in item.get("requires_dist", [])]
    asks = [(name, r) for name, r in needs if r.name == "torch" and (r.marker is None or r.marker.evaluate())]
    assert "cache-dit" in dict(asks), asks  # the floor's source: the check below is not empty
    assert [f"{name}: {r}" for name, r in asks if not r.specifier.contains(TORCH_FLOOR)] == [], TORCH_FLOOR


def test_fresh_environment_with_comfyui_then_the_pack_registers_every_node(tmp_path):
    venv = tmp_path / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = venv / "bin" / "python"
        bare = subprocess.run([str(python), "-c", "import torch"], capture_output=True)
        assert bare.returncode != 0, "the new environment must not see the test environment's packages"
        _link_user_packages(python, tmp_path / "user_torch", USER_TORCH)
        torch_version = _version(python, "torch")
        assert torch_version == importlib.metadata.version("torch")
        _pip_install(python, "-r", str(COMFY_DIR / "requirements.txt"))
        assert _version(python, "torch") == torch_version, "ComfyUI's requirements changed the user's torch"

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
        shutil.rmtree(venv, ignore_errors=True)  # hundreds of MB: not kept among pytest's temporary folders
    assert str(python) == server.args[0]
    pack_lines = [line for line in log.splitlines() if PACK_FOLDER in line]  # ComfyUI names the pack's failures
    assert NODE_IDS <= registered, (NODE_IDS - registered, pack_lines)
    assert not [line for line in pack_lines if "IMPORT FAILED" in line or "Cannot import" in line], pack_lines
    assert re.search(rf"\d+\.\d+ seconds: .*{re.escape(PACK_FOLDER)}", log), "the pack is not in ComfyUI's import times"
