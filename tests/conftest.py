"""Shared fixtures: a real ComfyUI core (in-process and as a headless server), the pack, tiny models.

ComfyUI comes from ``scripts/setup_env.sh`` (``.cache/comfyui``) or ``ERNIE_TEST_COMFYUI``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMFY_DIR = Path(os.environ.get("ERNIE_TEST_COMFYUI", REPO / ".cache" / "comfyui"))
PACK_NAME = "comfyui_ernie_image"

sys.path.insert(0, str(REPO / "tests"))


def _import_comfyui() -> None:
    """Put the ComfyUI core on sys.path in CPU mode (before anything imports model management)."""
    if not (COMFY_DIR / "main.py").exists():
        raise RuntimeError(f"no ComfyUI core at {COMFY_DIR}: run scripts/setup_env.sh first")
    sys.path.insert(0, str(COMFY_DIR))
    from comfy.cli_args import args

    args.cpu = True


def _import_pack():
    """Import the repository as the package ComfyUI would load from custom_nodes/."""
    spec = importlib.util.spec_from_file_location(
        PACK_NAME, REPO / "__init__.py", submodule_search_locations=[str(REPO)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK_NAME] = module
    spec.loader.exec_module(module)
    return module


_import_comfyui()
_import_pack()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """A ComfyUI models folder with a tiny ERNIE-Image snapshot and the same DiT as a single file."""
    from scripts.tiny_models import write_models_folder

    models_dir = tmp_path_factory.mktemp("models")
    paths = write_models_folder(models_dir)
    paths["models_dir"] = models_dir
    return paths


@pytest.fixture(scope="session")
def comfy_paths(tiny_models):
    """ComfyUI's folder_paths, in this process, pointed at the tiny models."""
    import folder_paths

    for name in ("diffusers", "diffusion_models", "text_encoders", "loras"):
        folder_paths.add_model_folder_path(name, str(tiny_models["models_dir"] / name), is_default=True)
    return folder_paths


@pytest.fixture
def placed(tiny_models, comfy_paths):
    """``placed(folder, name)``: a path among ComfyUI's model folders (``models/<folder>/<name>``) for a file or folder
    a test writes there, as a user would put it, removed when the test ends."""
    from helpers.files import in_model_folder

    with contextlib.ExitStack() as stack:
        yield lambda folder, name: stack.enter_context(in_model_folder(tiny_models["models_dir"], folder, name))


@pytest.fixture
def loaded_models(monkeypatch) -> list:
    """ComfyUI's list of loaded models, empty for this test (core reads the module's list at every call):
    ``helpers.loaded.hold`` lists models in it."""
    import comfy.model_management as mm

    models: list = []
    monkeypatch.setattr(mm, "current_loaded_models", models)
    return models


@pytest.fixture
def cpu_workers(monkeypatch):
    """The switch that lets ERNIE-Image Parallel start its workers on the CPU (docs/ARCHITECTURE.md §7), for the
    parallel tests only."""
    monkeypatch.setenv("ERNIE_IMAGE_PARALLEL_CPU_WORKERS", "1")


@pytest.fixture(scope="session")
def comfy_server(tiny_models, tmp_path_factory):
    """A real headless ComfyUI (subprocess, CPU) with this pack installed under custom_nodes/."""
    from scripts.comfy_headless import ComfyServer

    server = ComfyServer(COMFY_DIR, tmp_path_factory.mktemp("comfy_base"), REPO, tiny_models["models_dir"])
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pe_server(tiny_models, tmp_path_factory):
    """A real OpenAI-compatible server (``transformers serve``) on the tiny PE, one per test module."""
    from helpers.pe_servers import transformers_serve

    with transformers_serve(tiny_models["pe_folder"], tmp_path_factory.mktemp("serve")) as url:
        yield url


@pytest.fixture
def fault():
    """The fault server: answers a real server cannot be made to give (5xx, hangs, malformed bodies)."""
    from helpers.pe_servers import FaultServer

    with FaultServer() as server:
        yield server
