"""The pack's import graph, read from its source: no cycle, and the features are peers. A feature (``dit``, ``text``,
``pe``, ``lora``, ``accel``, ``quant``, ``parallel``) imports its own modules, the host layer and the shared helpers
named below, never another feature; the loaders where the features meet, and the extension that lists every node, sit
on top.
Every module is counted somewhere: a new top-level module must be named here, as a helper or at the top."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACK = "nodes"
FEATURES = {"dit", "text", "pe", "lora", "accel", "quant", "parallel"}
HOST = "host"  # every use of ComfyUI's internals (test_host_layer.py)
# Small modules every feature may build on: errors, file reading and checks, model folders and the model-choice
# grammar, node input checks, the pack's socket types, the GGUF file format (``gguf/``), Cancel for the engine's loops,
# the time a first run waited for the compiler (the DiT's blocks and the PE's decode step), the out-of-memory advice
# (the host words it for every feature's models), the memory plan's records, planner and session (``plan/``). They
# import only each other.
SHARED = {"errors", "model_files", "paths", "choices", "structure", "quant_layout", "ministral_file", "ministral_gguf",
          "fp8_linear", "fp8_gemv", "bounded_json", "inputs", "sockets", "gguf", "memory_advice", "cancel",
          "compile_clock", "plan"}
TOP = {"loaders", "extension", "planning"}  # and the package itself: they may import anything of the pack


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str, root: Path) -> bool:
    path = root.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package at ``root`` and the pack's modules it imports (relative imports, also those
    inside functions; ``from .host import ops`` counts as ``host.ops``)."""
    graph = {}
    for path in sorted(root.rglob("*.py")):
        name = _module_name(path, root)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue  # an absolute import is another package's (``nodes`` alone is ComfyUI's)
            base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
            target = f"{base}.{node.module}" if node.module else base
            submodules = {f"{target}.{alias.name}" for alias in node.names}
            imported |= {m for m in submodules if _is_module(m, root)} or {target}
        graph[name] = imported - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted: a cycle runs through each."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph.get(module, ())):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while not group or group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def _place(module: str) -> str:
    """Where a module of the pack sits: a feature's name, ``host``, ``shared``, ``top``, or ``unknown``."""
    first = module.split(".")[1] if "." in module else ""
    if first in FEATURES:
        return first
    if first == HOST:
        return HOST
    if first in SHARED:
        return "shared"
    return "top" if first in TOP or not first else "unknown"


def _may_import(importer: str, imported: str) -> bool:
    if importer == "top":
        return True
    if importer in FEATURES:
        return imported in (importer, HOST, "shared")
    if importer == HOST:
        return imported in (HOST, "shared")
    return importer == "shared" and imported == "shared"


def layering_problems(graph: dict[str, set[str]]) -> list[str]:
    """Each import that crosses the layers the wrong way, and each module that sits in no layer, in words."""
    problems = [f"{module} is in no layer: name it in SHARED or TOP, or put it in a feature"
                for module in sorted(graph) if _place(module) == "unknown"]
    for module, imported in sorted(graph.items()):
        here = _place(module)
        for other in sorted(imported):
            if here != "unknown" and not _may_import(here, _place(other)):
                problems.append(f"{module} ({here}) imports {other} ({_place(other)})")
    return problems


def test_the_pack_has_no_import_cycle():
    assert cycles(import_graph(REPO / PACK)) == []


def test_features_are_peers_and_build_only_on_the_host_and_the_shared_helpers():
    assert layering_problems(import_graph(REPO / PACK)) == []


def test_the_rules_catch_a_sideways_import_and_a_cycle():
    graph = {"nodes.lora.patching": {"nodes.accel.patching", "nodes.errors"},
             "nodes.accel.patching": {"nodes.host.model"}, "nodes.host.model": {"nodes.errors"},
             "nodes.errors": set(), "nodes.pe.runtime": {"nodes.pe.comfy"}, "nodes.pe.comfy": {"nodes.pe.runtime"}}
    assert layering_problems(graph) == ["nodes.lora.patching (lora) imports nodes.accel.patching (accel)"]
    assert cycles(graph) == [["nodes.pe.comfy", "nodes.pe.runtime"]]
