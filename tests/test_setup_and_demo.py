"""The first commands a new user runs, on the mistakes a first hour makes: the setup run with a Python that is too
old, a `.venv` left by another Python, and the demo pointed at a models folder that is not there or holds no model.
Each is refused (or mended) in words before anything is made or started.

The setup runs in a copy of its folder layout under the test's folder (it works on the folder above its script), so
the project's own `.venv` is never touched; its other steps find their work done there (an empty requirements file, a
ComfyUI folder with a `main.py`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from conftest import REPO

# A Python 3.10 stand-in (no real 3.10 is installed here): it answers the version query as 3.10 does and refuses
# anything else, so nothing it would make can hide a missing check.
PYTHON_310_SHIM = """#!/bin/sh
if [ "$1" = "-c" ]; then echo 3.10; exit 0; fi
echo "python 3.10 shim: not a real Python ($*)" >&2
exit 1
"""


def _setup_copy(root: Path) -> Path:
    """The setup script in a folder of its own, with its other steps already done there."""
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "setup_env.sh", root / "scripts" / "setup_env.sh")
    (root / "tests").mkdir()
    (root / "tests" / "requirements.txt").write_text("# nothing to install: this test checks the setup's steps\n")
    (root / ".cache" / "comfyui").mkdir(parents=True)
    (root / ".cache" / "comfyui" / "main.py").write_text("")
    return root / "scripts" / "setup_env.sh"


def _shim(folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(PYTHON_310_SHIM)
    (folder / name).chmod(0o755)
    return folder / name


def _run(command: list[str], path_first: Path | None = None, python: str | None = None) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != "PYTHON"}
    if python is not None:
        env["PYTHON"] = python
    if path_first is not None:
        env["PATH"] = f"{path_first}{os.pathsep}{env['PATH']}"
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)


def _python_version(python: str) -> str:
    return subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def test_setup_refuses_a_python_310_shim_before_making_venv(tmp_path):
    setup = _setup_copy(tmp_path / "clone")
    shim = _shim(tmp_path / "bin", "python3")
    result = _run(["bash", str(setup)], path_first=shim.parent)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"python3 is Python 3.10 ({shim}), and the pack needs Python 3.11 or newer" in result.stdout
    assert "PYTHON=python3.11" in result.stdout and "Nothing was made." in result.stdout
    assert not (tmp_path / "clone" / ".venv").exists()


def test_setup_with_a_python_310_shim_keeps_a_good_venv_untouched(tmp_path):
    setup = _setup_copy(tmp_path / "clone")
    venv = tmp_path / "clone" / ".venv"
    venv.mkdir()
    (venv / "pyvenv.cfg").write_text("version = 3.11.7\n")
    shim = _shim(tmp_path / "bin", "python3")
    result = _run(["bash", str(setup)], path_first=shim.parent)
    assert result.returncode == 1 and "needs Python 3.11 or newer" in result.stdout, result.stdout + result.stderr
    assert (venv / "pyvenv.cfg").read_text() == "version = 3.11.7\n"


def test_setup_refuses_a_named_python_it_cannot_run(tmp_path):
    setup = _setup_copy(tmp_path / "clone")
    missing = tmp_path / "no such python3.11"
    result = _run(["bash", str(setup)], python=str(missing))
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"setup: cannot run {missing} as a Python: install Python 3.11 or newer" in result.stdout
    assert not (tmp_path / "clone" / ".venv").exists()


def test_setup_makes_venv_again_when_another_python_made_it(tmp_path):
    """A `.venv` made by Python 3.10 (a shim as its Python) and the setup run again with this machine's Python."""
    setup = _setup_copy(tmp_path / "clone")
    venv = tmp_path / "clone" / ".venv"
    _shim(venv / "bin", "python")
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\nversion = 3.10.12\n")
    python = _python_version("python3")
    result = _run(["bash", str(setup)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f".venv was made by Python 3.10 and python3 is Python {python}: making it again" in result.stdout
    assert f"version = {python}." in (venv / "pyvenv.cfg").read_text()
    assert _python_version(str(venv / "bin" / "python")) == python


def _demo(*args: str) -> subprocess.CompletedProcess:
    return _run(["bash", str(REPO / "scripts" / "demo.sh"), *args])


def test_demo_refuses_a_models_folder_that_does_not_exist(tmp_path):
    missing = tmp_path / "no such folder"
    result = _demo("--models", str(missing))
    assert result.returncode == 1, result.stdout
    assert f"demo: the models folder {missing} does not exist." in result.stderr
    assert "bash scripts/demo.sh --tiny" in result.stderr
    assert "ComfyUI started" not in result.stdout and "tiny" not in result.stdout


def test_demo_refuses_a_models_folder_without_the_snapshot(tmp_path):
    (tmp_path / "diffusers" / "ERNIE-Image-Turbo").mkdir(parents=True)  # an unfinished download: no model_index.json
    result = _demo("--models", str(tmp_path))
    assert result.returncode == 1, result.stdout
    assert f"demo: the models folder {tmp_path} holds no ERNIE-Image-Turbo snapshot:" in result.stderr
    assert f"{tmp_path}/diffusers/ERNIE-Image-Turbo/model_index.json is missing" in result.stderr
    assert "hf download baidu/ERNIE-Image-Turbo" in result.stderr
    assert "ComfyUI started" not in result.stdout


def test_demo_says_when_the_named_folder_is_the_snapshot_itself(tmp_path):
    (tmp_path / "model_index.json").write_text("{}")
    result = _demo("--models", str(tmp_path))
    assert result.returncode == 1, result.stdout
    assert "this folder is a snapshot itself: name the models folder that holds diffusers/" in result.stderr
