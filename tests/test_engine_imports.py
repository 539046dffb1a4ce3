"""The engine modules import no ComfyUI: each loads in a process where ComfyUI's modules (``comfy``, ``folder_paths``,
``comfy_api`` and the rest of ``test_host_layer.CORE_MODULES``) cannot be imported, and none imports at any depth (a
function's own imports included) ComfyUI or a pack module of the ComfyUI side, which it would reach when called.

Every pack module is listed below, as an engine module or as one of the ComfyUI side, so that a new module fails
the test until it is put where it belongs. The engine: plain Python, torch, transformers, safetensors, requests.
The ComfyUI side: the host layer (``host/``, but for its plain-torch ``sizes``), the adapters that go through it
and the node modules (schemas and plumbing, ``comfy_api`` and ``folder_paths``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from test_host_layer import CORE_MODULES

from conftest import PACK_NAME, REPO

PACK = REPO / "nodes"
BLOCKED = sorted(CORE_MODULES | {"folder_paths", "comfy_api"})

# Paths under nodes/.
ENGINE = [
    "__init__.py", "errors.py", "model_files.py", "ministral_file.py", "quant_layout.py", "structure.py",
    "fp8_linear.py", "fp8_gemv.py", "bounded_json.py", "memory_advice.py", "cancel.py", "compile_clock.py",
    "plan/__init__.py", "plan/costs.py", "plan/describe.py", "plan/planner.py", "plan/records.py", "plan/session.py",
    "gguf/__init__.py", "gguf/dequant.py", "gguf/header.py", "gguf/reader.py", "gguf/linear.py", "gguf/tokenizer.py",
    "ministral_gguf.py",
    "accel/__init__.py", "accel/cache.py", "accel/cache_presets.py", "accel/compile.py",
    "quant/__init__.py", "quant/capability.py", "quant/choice.py", "quant/quantize.py", "quant/requantize.py",
    "quant/saved.py", "quant/torchao_file.py",
    "dit/attention.py", "dit/dit.py", "dit/schedule.py", "dit/weights.py",
    "lora/__init__.py", "lora/keys.py", "lora/files.py",
    "parallel/__init__.py", "parallel/messages.py", "parallel/pool.py", "parallel/rendezvous.py", "parallel/split.py",
    "pe/__init__.py", "pe/protocol.py", "pe/cache.py", "pe/runtime.py",
    "pe/local/__init__.py", "pe/local/enhancer.py", "pe/local/weights.py", "pe/local/decode.py",
    "pe/local/attention.py", "pe/local/fused.py", "pe/local/batching.py", "pe/local/template.py",
    "pe/remote/__init__.py", "pe/remote/enhancer.py", "pe/remote/bounded_http.py", "pe/remote/key_policy.py",
    "pe/remote/url.py",
    "text/encoder.py", "text/streaming.py",
]
# The host layer's modules that engines may use: plain torch, no core.
PLAIN_HOST = ["host/__init__.py", "host/sizes.py"]
COMFY_SIDE = [
    "extension.py", "inputs.py", "paths.py", "choices.py", "loaders.py", "planning.py", "sockets.py",
    "accel/nodes.py", "accel/patching.py",
    "dit/build.py", "dit/gguf.py", "dit/model.py", "dit/nodes.py", "dit/precision.py", "dit/vae.py",
    "lora/nodes.py", "lora/patching.py",
    "parallel/nodes.py", "parallel/patching.py", "parallel/worker.py",
    "pe/comfy_runtime.py", "pe/locate.py", "pe/nodes.py",
    "text/managed.py", "text/nodes.py",
]
HOST = "host/"


def _module(path: str) -> str:
    """``pe/local/decode.py`` → ``nodes.pe.local.decode``; a package's ``__init__.py`` → the package."""
    parts = ["nodes", *Path(path).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules_on_disk() -> dict[str, str]:
    return {_module(str(p.relative_to(PACK))): str(p.relative_to(PACK)) for p in sorted(PACK.rglob("*.py"))}


def _imports(path: str) -> set[str]:
    """Every module ``path`` imports, anywhere in it: top-level names for outside modules, dotted pack names for the
    pack's own (``from . import x`` names the submodule ``x`` where there is one)."""
    name, known = _module(path), _modules_on_disk()
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse((PACK / path).read_text(), path)):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            submodules = {f"{target}.{alias.name}" for alias in node.names} & known.keys()
            found |= submodules or {target}
    return found


def test_every_pack_module_is_an_engine_module_or_one_of_the_comfyui_side():
    listed = set(ENGINE) | set(PLAIN_HOST) | set(COMFY_SIDE)
    on_disk = set(_modules_on_disk().values())
    unlisted = {p for p in on_disk - listed if not p.startswith(HOST)}
    assert unlisted == set() and listed - on_disk == set(), (unlisted, listed - on_disk)
    assert set(ENGINE).isdisjoint(COMFY_SIDE)


def test_no_engine_module_imports_comfyui_or_the_comfyui_side_even_inside_a_function():
    allowed = {_module(p) for p in ENGINE + PLAIN_HOST}
    pack_modules = set(_modules_on_disk())
    reached = {}
    for path in ENGINE + PLAIN_HOST:
        bad = {m for m in _imports(path) if m in BLOCKED or (m in pack_modules and m not in allowed)}
        if bad:
            reached[path] = sorted(bad)
    assert reached == {}


_IMPORT_ALL = """
import importlib, importlib.abc, importlib.util, json, sys
blocked, pack, repo, modules = json.loads(sys.argv[1])
tried = []

class NoComfyUI(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in blocked:
            tried.append(fullname)
            raise ModuleNotFoundError(f"No module named {fullname!r} (ComfyUI is not importable here)")
        return None

sys.meta_path.insert(0, NoComfyUI())
spec = importlib.util.spec_from_file_location(pack, repo + "/__init__.py", submodule_search_locations=[repo])
sys.modules[pack] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules[pack])
failed = {}
for name in modules:
    try:
        importlib.import_module(f"{pack}.{name}")
    except Exception as error:
        failed[name] = repr(error)
print(json.dumps({"failed": failed, "tried": tried}))
"""


def test_every_engine_module_imports_where_comfyui_cannot_be_imported():
    modules = [_module(p) for p in ENGINE + PLAIN_HOST]
    argument = json.dumps([BLOCKED, PACK_NAME, str(REPO), modules])
    run = subprocess.run([sys.executable, "-c", _IMPORT_ALL, argument], capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # An import of ComfyUI that a module tried and then did without (try/except ImportError) counts too.
    assert result == {"failed": {}, "tried": []}
