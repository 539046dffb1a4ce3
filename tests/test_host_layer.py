"""Every use of ComfyUI's internals lives in one host layer (``nodes/host/``), which adapts to the running core; the
rest of the pack reaches core only through it, the V3 API (``comfy_api``) and ``folder_paths``."""

from __future__ import annotations

import ast

from conftest import REPO

# ComfyUI's own top-level modules a custom node could import (its core package, the executor, the server).
CORE_MODULES = {"comfy", "comfy_extras", "comfy_execution", "server", "execution", "nodes", "latent_preview",
                "comfyui_version", "cuda_malloc", "main"}


def _core_imports(path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return [name for name in names if name.split(".")[0] in CORE_MODULES]


def test_only_the_host_layer_imports_comfyui_internals():
    pack = REPO / "nodes"
    outside = {str(path.relative_to(REPO)): found for path in sorted(pack.rglob("*.py"))
               if not path.is_relative_to(pack / "host") and (found := _core_imports(path))}
    assert outside == {}


def test_the_host_layer_is_where_they_are():
    found = {name for path in (REPO / "nodes" / "host").rglob("*.py") for name in _core_imports(path)}
    assert {"comfy.model_patcher", "comfy.model_management", "comfy.ops", "comfy.patcher_extension"} <= found
