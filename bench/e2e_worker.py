"""One ComfyUI process of the GPU end-to-end check (``gpu_e2e.py`` starts one per VRAM mode).

ComfyUI 0.3.75 is imported in-process the way its ``main.py`` starts (arguments parsed, ``cuda_malloc`` chosen,
the extra model paths and the custom nodes loaded, the pack under another folder name), and its own
``PromptExecutor`` runs the API twins of ``tests/workflows/``: nodes run inside ``torch.inference_mode()`` and models
are loaded, moved and freed by ComfyUI's model management, as in the server. Each workflow runs twice (the second
time with another prompt text and seed, so the text encoder runs again); after the local PE, ComfyUI's ``/free``
(what the server's worker runs for it) and the Turbo workflow once more. One JSON line per run goes to ``--json``.

An emulated smaller card is this process's alone, whatever else runs on the GPU (``gpu_e2e --parallel``): torch
may allocate no more than the card less a CUDA context (``set_per_process_memory_fraction``), and
``torch.cuda.mem_get_info``, which ComfyUI and the pack read for total and free memory, reports the card and what
this process has not reserved of it. Missing ``av`` (ComfyUI's API imports it; absent on the GPU machine): a
stand-in module while ComfyUI imports.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import resource
import sys
import time
import types
import uuid
from pathlib import Path

GIB = 2**30
CUDA_CONTEXT_GIB = 0.5  # what a CUDA context takes of a real card, outside torch's allocator
NOTEWORTHY = re.compile(r"out of memory|retry|tiled|fall(s|ing)? back|fell back|loaded partially|recompile|"
                        r"compil(e|ing) the DiT|ERNIE-Image", re.IGNORECASE)


class _AvStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for ``av`` and ``av.*`` (only while ComfyUI imports, and only where ``av`` is missing)."""

    def find_spec(self, name, path=None, target=None):
        if name == "av" or name.startswith("av."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)

        def attribute(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)  # inspect and importlib probe dunders
            return type(attr, (), {})

        module.__getattr__ = attribute
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class LogNotes(logging.Handler):
    """The warnings, OOM retries and fallbacks ComfyUI and the pack log during a run."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage().splitlines()[0][:300] if record.getMessage() else ""
        if record.levelno >= logging.WARNING or NOTEWORTHY.search(message):
            self.lines.append(f"{record.levelname}: {message}")


def emulate_card(torch, card_gib: float) -> None:
    """This process sees a card of ``card_gib``: the device-wide free memory (the other modes' processes included)
    is replaced by the card less the context and this process's own reservations."""
    card, context = card_gib * GIB, CUDA_CONTEXT_GIB * GIB
    torch.cuda.set_per_process_memory_fraction((card - context) / torch.cuda.get_device_properties(0).total_memory)

    def mem_get_info(device=None) -> tuple[int, int]:
        return max(int(card - context) - torch.cuda.memory_reserved(device), 0), int(card)

    torch.cuda.mem_get_info = mem_get_info


def start_comfyui(comfy_dir: Path, base_dir: Path, flags: list[str], card_gib: float | None):
    """Import ComfyUI as ``main.py`` would, with ``flags``; returns its ``execution`` and ``nodes`` modules."""
    sys.argv = ["main.py", *flags, "--base-directory", str(base_dir), "--disable-auto-launch"]
    sys.path.insert(0, str(comfy_dir))
    os.chdir(comfy_dir)
    import comfy.options

    comfy.options.enable_args_parsing()
    from comfy.cli_args import args

    if not args.cpu:
        import cuda_malloc  # noqa: F401  (ComfyUI's default allocator choice, made before torch loads)
    import torch

    if card_gib is not None:  # before ComfyUI's model management reads the card's size
        emulate_card(torch, card_gib)
    stand_in = _AvStandIn() if importlib.util.find_spec("av") is None else None
    if stand_in is not None:
        sys.meta_path.insert(0, stand_in)
    try:
        import execution

        import nodes

        asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))
    finally:
        if stand_in is not None:  # diffusers and transformers must not find a fake av later
            sys.meta_path.remove(stand_in)
            for name in [n for n in sys.modules if n == "av" or n.startswith("av.")]:
                del sys.modules[name]
    return execution, nodes


class _Server:
    """What the executor needs of ComfyUI's server, recording when each node starts (the executor announces nodes
    to a client only: each prompt names this one). The GPU is synchronised first, so that a node's time includes its
    work."""

    client_id = "gpu-e2e-check"
    last_node_id = last_prompt_id = None

    def __init__(self):
        self.started: list[tuple[str, float]] = []

    def send_sync(self, event, data, sid=None) -> None:
        if event == "executing" and data.get("node") is not None:
            _synchronize()
            self.started.append((data["node"], time.perf_counter()))


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def node_seconds(started: list[tuple[str, float]], end: float, graph: dict) -> dict[str, float]:
    """Each executed node's seconds (until the next one started), slowest first, named ``id ClassType``."""
    ends = [t for _, t in started[1:]] + [end] if started else []
    seconds = {f"{node} {graph.get(node, {}).get('class_type', '?')}": round(stop - start, 2)
               for (node, start), stop in zip(started, ends, strict=True)}
    return dict(sorted(seconds.items(), key=lambda item: -item[1]))


def variant(graph: dict, run: int, pe_tokens: int, size: int | None, base_steps: int | None) -> dict:
    """The twin for run ``run``: another prompt text and seed after the first, the PE capped at ``pe_tokens``."""
    graph = copy.deepcopy(graph)
    for node in graph.values():
        inputs, kind = node["inputs"], node["class_type"]
        if kind == "ErnieImagePromptEnhance":
            inputs.update(max_new_tokens=pe_tokens, prompt=inputs["prompt"] + f" (variation {run})")
            inputs["seed"] += run
        elif kind in ("ErnieImageTextEncode", "CLIPTextEncode") and isinstance(inputs.get("text"), str):
            if inputs["text"]:  # the positive prompt (the empty negative stays empty)
                inputs["text"] += f" (variation {run})"
        elif kind == "SamplerCustom":
            inputs["noise_seed"] += run
        elif kind == "EmptyFlux2LatentImage" and size is not None:
            inputs.update(width=size, height=size)
        elif kind == "ErnieImageScheduler" and base_steps is not None:
            inputs["steps"] = min(inputs["steps"], base_steps)
    return graph


def run_prompt(execution, executor, graph: dict) -> dict:
    """Validate and execute ``graph``; its time, result, peak GPU memory and log notes."""
    import torch

    notes = LogNotes()
    logging.getLogger().addHandler(notes)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        try:
            torch.cuda.reset_peak_memory_stats()  # whole-run peaks: this run's alone
        except RuntimeError:  # an allocator without peak statistics: none recorded
            cuda = False
    executor.server.started.clear()
    start = time.perf_counter()
    try:
        prompt_id = uuid.uuid4().hex
        valid, error, outputs, node_errors = asyncio.run(execution.validate_prompt(prompt_id, graph, None))
        if not valid:
            return dict(ok=False, error=f"invalid: {error} {node_errors}"[:600], seconds=0.0, notes=notes.lines)
        executor.execute(graph, prompt_id, {"client_id": _Server.client_id}, outputs)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        failure = next((data for kind, data in executor.status_messages if kind == "execution_error"), None)
        row = dict(ok=executor.success and failure is None, seconds=round(seconds, 2), notes=notes.lines,
                   nodes_s=node_seconds(executor.server.started, start + seconds, graph),
                   peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1))  # KiB
        if failure is not None:
            kind = str(failure.get("exception_type", "")).rsplit(".", 1)[-1]
            row["error"] = f"{failure.get('node_type')}: {kind}: {failure.get('exception_message', '')}"[:600]
        if cuda:
            row.update(peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 2),
                       peak_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 2))
        return row
    finally:
        logging.getLogger().removeHandler(notes)


def free(executor) -> dict:
    """What the server's worker runs for ``POST /free`` (unload models, free memory); GPU memory before and after."""
    import comfy.model_management as mm
    import torch

    def held() -> dict:
        if not torch.cuda.is_available():
            return {}
        return dict(allocated_gib=round(torch.cuda.memory_allocated() / GIB, 2),
                    reserved_gib=round(torch.cuda.memory_reserved() / GIB, 2))

    before = held()
    executor.reset()
    mm.unload_all_models()
    gc.collect()
    mm.soft_empty_cache()
    return dict(before=before, after=held())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", type=Path, required=True)
    parser.add_argument("--base", type=Path, required=True, help="ComfyUI's base directory (models/ linked inside)")
    parser.add_argument("--flags", default="", help="ComfyUI's command-line flags for this mode")
    parser.add_argument("--card-gib", type=float, help="emulate a card of this many GiB")
    parser.add_argument("--workflows", required=True, help="comma-separated API twins (paths)")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--pe-tokens", type=int, default=64)
    parser.add_argument("--size", type=int, help="image size instead of the workflows' own")
    parser.add_argument("--base-steps", type=int, help="at most this many sampling steps")
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
    execution, _ = start_comfyui(options.comfyui, options.base, options.flags.split(), options.card_gib)
    import torch

    executor = execution.PromptExecutor(_Server(), cache_type=execution.CacheType.CLASSIC,
                                        cache_args={"lru": 0, "ram": 0})
    facts = dict(allocator=torch.cuda.get_allocator_backend() if torch.cuda.is_available() else "cpu",
                 torch=torch.__version__)
    out = options.json.open("a")

    def record(workflow: str, run: str, row: dict) -> None:
        out.write(json.dumps(dict(workflow=workflow, run=run, **facts, **row)) + "\n")
        out.flush()
        print(f"== {workflow} [{run}]: {row}", flush=True)

    turbo = None
    for path in map(Path, options.workflows.split(",")):
        graph = json.loads(path.read_text())
        turbo = graph if path.stem == "ernie_image_turbo" else turbo
        for run, label in enumerate(("first", "warm")):
            record(path.stem, label, run_prompt(execution, executor, variant(
                graph, run, options.pe_tokens, options.size, options.base_steps)))
        if path.stem == "ernie_image_pe_local":
            record(path.stem, "/free", dict(ok=True, **free(executor)))
            if turbo is not None:
                record("ernie_image_turbo", "after /free", run_prompt(execution, executor, variant(
                    turbo, 2, options.pe_tokens, options.size, options.base_steps)))


if __name__ == "__main__":
    main()
