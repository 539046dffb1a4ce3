"""One ComfyUI process of the GPU end-to-end check (``gpu_e2e.py`` starts one per VRAM mode).

ComfyUI 0.3.75 is imported in-process the way its ``main.py`` starts (arguments parsed, ``cuda_malloc`` chosen,
the extra model paths and the custom nodes loaded, the pack under another folder name); the 0.12.1 fork
(``--core fork``: ``hiddenswitch/pip-and-uv-installable-ComfyUI``, a source tree with ``comfy/cmd/``) the way its
``comfyui`` command starts (``start_fork``). Either core's own ``PromptExecutor`` runs the API twins of
``tests/workflows/``: nodes run inside ``torch.inference_mode()`` and models are loaded, moved and freed by
ComfyUI's model management, as in the server. Each workflow runs twice (the second
time with another prompt text and seed, so the text encoder runs again); after the local PE, ComfyUI's ``/free``
(what the server's worker runs for it) and the Turbo workflow once more. One JSON line per run goes to ``--json``.

An emulated smaller card is this process's alone, whatever else runs on the GPU (``gpu_e2e --parallel``): torch
may allocate no more than the card less a CUDA context (``set_per_process_memory_fraction``), and
``torch.cuda.mem_get_info``, which ComfyUI and the pack read for total and free memory, reports the card and what
this process has not reserved of it. Missing ``av`` (ComfyUI's API imports it; absent on the GPU machine): a
stand-in module while ComfyUI imports (on the fork, also the few modules of ``FORK_STAND_INS``).

Each run's row also holds the peak device memory NVML saw (``nvidia-ml-py``, sampled every 20 ms in a thread:
every allocator's memory, comfy-aimdo's too, which torch's peak statistics do not see), whether the core streams
models with dynamic VRAM (comfy-aimdo) and which patcher class manages each loaded model, and the model loads
the core logged (``Requested to load``, ``loaded completely``/``partially``, ``prepared for dynamic VRAM
loading``): a warm run that loads again what the first left loaded shows there.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import os
import re
import resource
import shutil
import sys
import threading
import time
import types
import uuid
from collections import Counter
from pathlib import Path

GIB = 2**30
CUDA_CONTEXT_GIB = 0.5  # what a CUDA context takes of a real card, outside torch's allocator
NOTEWORTHY = re.compile(r"out of memory|retry|tiled|fall(s|ing)? back|fell back|loaded partially|recompile|"
                        r"compil(e|ing) the DiT|ERNIE-Image", re.IGNORECASE)
# What issue 43's memory goal allows none of in a run's log (core's lines and the pack's): out-of-memory (CUDA's
# words, core's "Ran out of memory when regular VAE decoding, retrying with tiled"), retries and fallbacks.
TROUBLE = re.compile(r"out[ -]?of[ -]?memory|\boom\b|retry|retries|fall(s|ing)? ?back|fell back", re.IGNORECASE)
PLAN_LINE = "ERNIE-Image: plan for "  # the pack's one line per plan; e2e_sweep.parse_plan reads it
# The model loads and unloads cores log, cut to what names them (0.3.75 logs them at INFO, the fork's patcher the
# "loaded ..." lines at DEBUG and dynamic VRAM's staging at INFO; the fork has no "Requested to load").
LOADS = re.compile(r"^(Requested to load \S+|loaded completely|loaded partially|Model \S+ prepared for dynamic VRAM "
                   r"loading|Unloading \S+|Unloaded partially)")
# Modules the fork imports at start-up that the GPU machine lacks and that neither the executor nor the twins' nodes
# run: a stand-in while the fork imports, as for av (``_StandIn``). See scripts/newcore/gpu_carry.py.
FORK_STAND_INS = (
    "av",  # comfy_api's video and audio types (as on 0.3.75)
    "opentelemetry.exporter",  # main_pre's OTLP exporters: made only for an --otel-exporter-otlp-endpoint
)


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for ``names`` (packages, or subpackages such as ``opentelemetry.exporter``) and everything
    under them, only while ComfyUI imports and only for those missing: any attribute is a new empty class, so that
    ``from av import AudioFrame`` and annotations import."""

    def __init__(self, names=("av",)):
        self.names = tuple(name for name in names if not _importable(name))

    def _covers(self, name: str) -> bool:
        return any(name == n or name.startswith(n + ".") for n in self.names)

    def find_spec(self, name, path=None, target=None):
        if self._covers(name):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def remove(self) -> None:
        """Out of ``sys.meta_path`` and ``sys.modules``: diffusers and transformers must not find a fake later."""
        sys.meta_path.remove(self)
        for name in [n for n in sys.modules if self._covers(n)]:
            del sys.modules[name]

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


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its parent package is missing
        return False


class LogNotes(logging.Handler):
    """The warnings, OOM retries and fallbacks ComfyUI and the pack log during a run; the pack's plan lines whole,
    and how many lines spoke of out-of-memory, a retry or a fallback."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.loads: Counter = Counter()
        self.plans: list[str] = []
        self.trouble = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        first = text.splitlines()[0] if text else ""
        message = first[:300]
        load = LOADS.match(message)
        if load:
            self.loads[load.group(1)] += 1
        if record.levelno >= logging.WARNING or NOTEWORTHY.search(message):
            self.lines.append(f"{record.levelname}: {message}")
        if PLAN_LINE in first:
            self.plans.append(first[:2000])
        self.trouble += bool(TROUBLE.search(text))


def emulate_card(torch, card_gib: float) -> None:
    """This process sees a card of ``card_gib``: the device-wide free memory (the other modes' processes included)
    is replaced by the card less the context and this process's own reservations."""
    card, context = card_gib * GIB, CUDA_CONTEXT_GIB * GIB
    total = torch.cuda.get_device_properties(0).total_memory
    if not context < card <= total:
        raise SystemExit(f"cannot emulate a {card_gib:g} GiB card on this GPU of {total / GIB:.1f} GiB: a card "
                         f"takes more than the {CUDA_CONTEXT_GIB} GiB of a CUDA context and at most the GPU")
    torch.cuda.set_per_process_memory_fraction((card - context) / total)

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
    stand_in = _StandIn(("av",))
    sys.meta_path.insert(0, stand_in)
    try:
        import execution

        import nodes

        asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))
    finally:
        stand_in.remove()  # diffusers and transformers must not find a fake av later
    return execution, nodes


def classic_vae(sd_module) -> None:
    """Core's VAE on core's classic patcher, as the fork gives a VAE it must not offload (``disable_offload``: ``mp =
    ModelPatcher``, comfy/sd.py of the 0.12.1 fork): the experiment issue 43 asks for, whether the fork's decode gets
    past its dynamic patcher's defects so (``--vae-patcher classic``; a check option, not the pack's behaviour)."""
    from comfy.model_patcher import ModelPatcher

    made = sd_module.VAE.__init__

    def __init__(self, *args, **kwargs):
        dynamic = sd_module.get_model_patcher_class
        sd_module.get_model_patcher_class = lambda: ModelPatcher
        try:
            made(self, *args, **kwargs)
        finally:
            sd_module.get_model_patcher_class = dynamic

    sd_module.VAE.__init__ = __init__
    logging.info("the check puts core's VAE on the classic patcher (--vae-patcher classic)")


def start_fork(src: Path, base_dir: Path, flags: list[str], card_gib: float | None):
    """Import the fork as its ``comfyui`` command starts (``comfy.cmd.main:entrypoint``), with ``flags``; returns
    its ``comfy.cmd.execution`` module and its nodes (``ExportedNodes``).

    The command's steps, in its order: ``comfy.cmd.main_pre`` (environment, arguments parsed, ``cuda_malloc``,
    which loads comfy-aimdo's library under ``--fast dynamic_vram``, logging, the tracer), then
    ``_start_comfyui``: the configuration in an execution context (kept for the process), the manager's start
    (absent: nothing), the extra model paths, every node (``get_nodes()``: base, extras, the custom nodes) and
    the output folders, less the HTTP server, its queue and its database (the assets API's).

    Dynamic VRAM: the fork's ``comfy/aimdo_integration.py`` is upstream main.py's bring-up
    (``comfy_aimdo.control.init_device``, ``CoreModelPatcher = ModelPatcherDynamic``,
    ``memory_management.aimdo_allocator``), which nothing in the fork imports; it is imported where upstream's
    ``start_comfyui`` runs it, once model management is up and before any node loads. It does nothing without
    ``--fast dynamic_vram`` or where comfy-aimdo's library does not load (no CUDA driver). The emulated card
    (``emulate_card``) comes before model management reads the card's size, as on 0.3.75."""
    sys.argv = ["comfyui", *flags, "--cwd", str(base_dir), "--base-directory", str(base_dir),
                "--disable-auto-launch", "--disable-known-models", "--disable-requests-caching",
                "--database-url", f"sqlite:///{base_dir / 'comfy.db'}"]
    sys.path.insert(0, str(src))
    os.chdir(base_dir)
    stand_in = _StandIn(FORK_STAND_INS)
    sys.meta_path.insert(0, stand_in)
    try:
        importlib.import_module("comfy.cmd.main_pre")  # before torch: the allocator is chosen there
        import torch

        if "comfy.model_management" in sys.modules:
            raise RuntimeError("the fork's model management loaded before the emulated card was set up")
        if card_gib is not None:
            emulate_card(torch, card_gib)
        from comfy.cli_args import cli_args_configuration
        from comfy.execution_context import context_configuration

        context = context_configuration(cli_args_configuration())  # _start_comfyui's, for the whole process
        context.__enter__()
        import comfy.aimdo_integration  # noqa: F401  (dynamic VRAM: see above)
        from comfy.cli_args import args
        from comfy.cmd import execution, folder_paths, hook_breaker_ac10a0
        from comfy.cmd.extra_model_paths import load_extra_path_config
        from comfy.manager_integration import init_manager, prestartup
        from comfy.manager_model_cache import init_manager_model_cache
        from comfy.nodes_context import get_nodes

        init_manager(args)
        prestartup()
        init_manager_model_cache(refresh_from_github=args.refresh_manager_models)
        for config_path in args.extra_model_paths_config or []:
            load_extra_path_config(config_path)
        hook_breaker_ac10a0.save_functions()
        nodes = get_nodes()
        logging.info("the fork's nodes: %d", len(nodes.NODE_CLASS_MAPPINGS))  # imports them all (a lazy proxy)
        hook_breaker_ac10a0.restore_functions()
        for kind in ("checkpoints", "clip", "vae", "diffusion_models", "loras"):
            folder_paths.add_model_folder_path(kind, os.path.join(folder_paths.get_output_directory(), kind))
        folder_paths.create_directories()
    finally:
        stand_in.remove()
    # The fork logs its patcher's loads at DEBUG ("loaded completely ...", "Unloading X"): LogNotes counts them,
    # and the log shows them, but none of the other DEBUG lines there (one per layer at each partial load).
    for name in ("comfy.model_patcher", "comfy.model_management"):
        logging.getLogger(name).setLevel(logging.DEBUG)
        logging.getLogger(name).addFilter(_load_lines_only)
    return execution, nodes


def _load_lines_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.INFO or bool(LOADS.match(record.getMessage()))


def dynamic_vram_state() -> dict:
    """Whether the core streams models with dynamic VRAM (comfy-aimdo): upstream's ``aimdo_enabled``, the fork's
    ``aimdo_allocator``; and the class its loaders build models with (``CoreModelPatcher``)."""
    import comfy.model_patcher

    try:
        import comfy.memory_management as memory
    except ImportError:  # 0.3.75
        memory = None
    enabled = bool(getattr(memory, "aimdo_enabled", False) or getattr(memory, "aimdo_allocator", None) is not None)
    core = getattr(comfy.model_patcher, "CoreModelPatcher", comfy.model_patcher.ModelPatcher)
    return dict(dynamic_vram=enabled, core_patcher=core.__name__)


def loaded_patchers() -> dict[str, str]:
    """The models model management holds after a run: model class -> its patcher's class (the DiT is
    ``ErnieImageModel``; ``ModelPatcherDynamic`` streams it with dynamic VRAM)."""
    import comfy.model_management as mm

    held: dict[str, str] = {}
    for loaded in list(getattr(mm, "current_loaded_models", [])):
        patcher = getattr(loaded, "model", None)
        if patcher is not None:
            name = type(getattr(patcher, "model", patcher)).__name__
            held[name if name not in held else f"{name} #{len(held)}"] = type(patcher).__name__
    return held


PACK_MODELS = ("ErnieImageModel", "TextEncoderModule", "PromptEnhancerModule", "AutoencoderKL")


def alive_models() -> dict[str, int]:
    """How many of the pack's models (and core's VAE models) are alive after a garbage collection, loaded or not: more
    than the workflow's own shows a model kept by a reference it should not have (the first DiT of a process was,
    until 2026-12-05: ``tests/test_models_freed.py``)."""
    import torch

    gc.collect()
    alive: dict[str, int] = {}
    for thing in gc.get_objects():
        name = type(thing).__name__
        if name in PACK_MODELS and isinstance(thing, torch.nn.Module):
            alive[name] = alive.get(name, 0) + 1
    return alive


class NvmlPeak:
    """Device memory as NVML sees it, sampled every ``interval`` s in a thread while a run goes on: the whole
    device's (``used``: every process and allocator, comfy-aimdo's ``cuMemCreate`` too, which torch's peak
    statistics do not count) and this process's (where NVML lists processes); and, where comfy-aimdo is loaded,
    what it counts as its own (``get_total_vram_usage``: this process's weights it streams and what torch allocated
    through it). Nothing where NVML is missing (a CPU machine)."""

    def __init__(self, interval: float = 0.02):
        self.interval, self.handle, self.error, self.aimdo = interval, None, None, None
        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            self.nvml = pynvml
            try:
                uuid_ = str(torch.cuda.get_device_properties(0).uuid)
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(("GPU-" + uuid_).encode())
            except Exception:  # noqa: BLE001 - an older torch or driver: CUDA's first device is NVML's first too
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as error:  # noqa: BLE001 - no NVML: nothing sampled
            self.error = f"{type(error).__name__}: {error}"[:120]
        control = sys.modules.get("comfy_aimdo.control")
        if self.handle is not None and getattr(control, "lib", None) is not None:
            self.aimdo = control
        self.peak = self.before = self.process_peak = self.aimdo_peak = 0
        self._stop = threading.Event()
        self._thread = None

    def _sample(self) -> None:
        nvml, pid = self.nvml, os.getpid()
        while True:
            try:
                self.peak = max(self.peak, nvml.nvmlDeviceGetMemoryInfo(self.handle).used)
                if self.aimdo is not None:
                    self.aimdo_peak = max(self.aimdo_peak, self.aimdo.get_total_vram_usage())
                mine = [p.usedGpuMemory or 0 for p in nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
                        if p.pid == pid]
                self.process_peak = max(self.process_peak, *mine, 0)
            except Exception:  # noqa: BLE001 - processes not listed here: the device's figure stands
                pass
            if self._stop.wait(self.interval):
                return

    def __enter__(self):
        if self.handle is not None:
            self.before = self.peak = self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used
            self.process_peak = self.aimdo_peak = 0
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="nvml-peak", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def row(self) -> dict:
        if self.handle is None:
            return dict(nvml_error=self.error) if self.error else {}
        row = dict(nvml_peak_gib=round(self.peak / GIB, 2), nvml_before_gib=round(self.before / GIB, 2))
        if self.process_peak:
            row["nvml_process_peak_gib"] = round(self.process_peak / GIB, 2)
        if self.aimdo is not None:
            row["aimdo_peak_gib"] = round(self.aimdo_peak / GIB, 2)
        return row


class HostMemoryPeaks:
    """The process's peak anonymous, file-backed and shared resident memory so far (``/proc/self/status``, sampled
    every ``interval`` s from a thread; Linux only): which a host-RAM peak is, weights read into memory, pages of a
    memory-mapped file, or shared pages (where the driver's pinned host memory may count)."""

    FIELDS = {"RssAnon": "peak_rss_anon_gib", "RssFile": "peak_rss_file_gib", "RssShmem": "peak_rss_shmem_gib"}

    def __init__(self, interval: float = 0.2):
        self.interval, self.peaks = interval, dict.fromkeys(self.FIELDS, 0)
        if Path("/proc/self/status").is_file():
            threading.Thread(target=self._sample, name="host-memory-peaks", daemon=True).start()

    def _sample(self) -> None:
        while True:
            status = _memory_status()
            for field, peak in self.peaks.items():
                self.peaks[field] = max(peak, status.get(field, 0))
            time.sleep(self.interval)

    def row(self) -> dict:
        """The peaks so far, and the resident memory now (``rss_now_gib``: what a prompt left held, against its
        peak: a transient copy or a lasting one)."""
        row = {self.FIELDS[field]: round(peak / GIB, 1) for field, peak in self.peaks.items() if peak}
        now = _memory_status().get("VmRSS", 0)
        return {**row, "rss_now_gib": round(now / GIB, 1)} if now else row


def _memory_status() -> dict[str, int]:
    """The memory fields of ``/proc/self/status`` in bytes (none where there is no such file: not Linux)."""
    status = Path("/proc/self/status")
    fields = {}
    for line in status.read_text().splitlines() if status.is_file() else ():
        name, _, value = line.partition(":")
        if value.strip().endswith(" kB"):
            fields[name] = int(value.split()[0]) * 1024
    return fields


class _Server:
    """What the executor needs of ComfyUI's server, recording when each node starts (the executor announces nodes
    to a client only: each prompt names this one) and the peak GPU memory of the node before it (torch's peak
    statistics, reset at each start: which node a whole-run peak is). The GPU is synchronised first, so that a
    node's time includes its work."""

    client_id = "gpu-e2e-check"
    last_node_id = last_prompt_id = None
    receive_all_progress_notifications = False  # the fork's progress hooks read these two
    sockets_metadata: dict = {}  # no client connected: the fork's previews go in its newer format

    def __init__(self):
        self.started: list[tuple[str, float]] = []
        self.peaks: list[tuple[float, float, float]] = []  # segment_peak() at each start, then at the end
        self.unowned_at_start = 0.0  # GiB allocated as the prompt's first node started that no loaded model holds

    def send_sync(self, event, data, sid=None) -> None:
        if event == "executing" and data.get("node") is not None:
            _synchronize()
            self.peaks.append(segment_peak())
            if not self.started:
                self.unowned_at_start = self.peaks[-1][2] - loaded_models_gib()
            self.started.append((data["node"], time.perf_counter()))


def loaded_models_gib(device=None) -> float:
    """What the models core has loaded hold on ``device`` (ComfyUI's, by default), GiB: core's own count; a model
    whose patcher is gone counts nothing, as core counts it, nor one core placed elsewhere (a text encoder on the
    CPU)."""
    import comfy.model_management as mm

    device = device or mm.get_torch_device()
    return sum(float(loaded.model_loaded_memory()) for loaded in mm.current_loaded_models
               if loaded.model is not None and loaded.device == device) / GIB


def segment_peak() -> tuple[float, float, float]:
    """Torch's peak allocated and reserved GiB since the last reset and what is allocated now, then a reset; zeros
    without CUDA statistics."""
    import torch

    if not torch.cuda.is_available():
        return 0.0, 0.0, 0.0
    try:
        peak = (torch.cuda.max_memory_allocated() / GIB, torch.cuda.max_memory_reserved() / GIB,
                torch.cuda.memory_allocated() / GIB)
        torch.cuda.reset_peak_memory_stats()
    except RuntimeError:  # an allocator without peak statistics
        return 0.0, 0.0, 0.0
    return peak


def node_peaks(started: list[tuple[str, float]], peaks: list[tuple[float, float, float]], graph: dict) -> dict:
    """Each executed node's GPU memory, ``allocated at its start > peak allocated / peak reserved`` GiB, named
    ``id ClassType`` (``peaks``: one at the first start, then one as each node ends)."""
    return {f"{node} {graph.get(node, {}).get('class_type', '?')}": f"{at[2]:.2f} > {end[0]:.2f}/{end[1]:.2f}"
            for (node, _), at, end in zip(started, peaks[:-1], peaks[1:], strict=True)}


# Core's model-management calls whose host seconds each run records (``core_s``: calls and seconds per name, nested
# calls inside their callers' time): what a prompt spends loading and unloading models between the nodes' own work.
CORE_CALLS = (("comfy.model_management", "load_models_gpu"), ("comfy.model_management", "free_memory"),
              ("comfy.model_patcher", "ModelPatcher.load"), ("comfy.model_patcher", "ModelPatcher.partially_load"),
              ("comfy.model_patcher", "ModelPatcher.partially_unload"),
              ("comfy.model_patcher", "ModelPatcher.unpatch_model"), ("comfy.model_patcher", "ModelPatcher.detach"))


class CoreClock:
    """Times ``CORE_CALLS`` on the host (no synchronization added: a call's queued GPU work is not in it): per name,
    the calls and seconds since ``reset``; and the calls of 5 ms or more as ``[name, s after reset, s]``, in order."""

    def __init__(self):
        self.totals: dict[str, list] = {}
        self.calls: list[list] = []
        self.zero = time.perf_counter()
        for module_name, qualified in CORE_CALLS:
            owner = sys.modules.get(module_name)
            *outer, name = qualified.split(".")
            for part in outer:
                owner = getattr(owner, part, None)
            if owner is not None and callable(getattr(owner, name, None)):
                setattr(owner, name, self._timed(qualified, getattr(owner, name)))

    def _timed(self, name: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                total = self.totals.setdefault(name, [0, 0.0])
                total[0] += 1
                total[1] += seconds
                if seconds >= 0.005 and len(self.calls) < 200:
                    self.calls.append([name, round(start - self.zero, 3), round(seconds, 3)])
        return timed

    def reset(self) -> None:
        self.totals, self.calls, self.zero = {}, [], time.perf_counter()

    def row(self) -> dict:
        return dict(core_s={name: [n, round(s, 3)] for name, (n, s) in self.totals.items()}, core_calls=self.calls)


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


# Compile phases whose seconds a run's row lists (``compile_s``) when the run compiled anything: dynamo's frame
# compiles in all (and how many), its tracing, AOT autograd, inductor's lowering and code generation, the wait for
# its kernel compiles (Triton on CUDA) and loading the compiled modules. Where a first run's minutes go.
COMPILE_PHASES = ("_compile.compile_inner", "bytecode_tracing", "create_aot_dispatcher_function", "compile_fx_inner",
                  "GraphLowering.codegen", "async_compile.wait", "PyCodeCache.load_by_key_path", "build_guards")


def compile_phases() -> dict[str, tuple[int, float]]:
    """How many times and how many seconds in all each of ``COMPILE_PHASES`` ran in this process so far."""
    metrics = getattr(sys.modules.get("torch._dynamo.utils"), "compilation_time_metrics", {})
    return {phase: (len(metrics.get(phase, ())), sum(metrics.get(phase, ()))) for phase in COMPILE_PHASES}


def compile_seconds(before: dict[str, tuple[int, float]]) -> dict[str, list]:
    """The phases that ran since ``before``: ``[count, seconds]`` each."""
    return {phase: [count - before[phase][0], round(seconds - before[phase][1], 1)]
            for phase, (count, seconds) in compile_phases().items() if count > before[phase][0]}


def run_prompt(execution, executor, graph: dict, nvml: NvmlPeak | None = None, clock: CoreClock | None = None) -> dict:
    """Validate and execute ``graph``; its time, result, peak GPU memory (torch's, and NVML's with ``nvml``), the
    model loads logged, the patchers of the models held after it, core's model-management calls timed (``clock``),
    and log notes."""
    import contextlib

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
    executor.server.peaks.clear()
    executor.server.unowned_at_start = 0.0
    compiled_before = compile_phases()
    if clock is not None:
        clock.reset()
    start = time.perf_counter()
    try:
        prompt_id = uuid.uuid4().hex
        valid, error, outputs, node_errors = asyncio.run(execution.validate_prompt(prompt_id, graph, None))
        if not valid:
            return dict(ok=False, error=f"invalid: {error} {node_errors}"[:600], seconds=0.0, notes=notes.lines)
        with nvml if nvml is not None else contextlib.nullcontext():
            executor.execute(graph, prompt_id, {"client_id": _Server.client_id}, outputs)
            if cuda:
                torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        failure = next((data for kind, data in executor.status_messages if kind == "execution_error"), None)
        row = dict(ok=executor.success and failure is None, seconds=round(seconds, 2), notes=notes.lines,
                   plans=notes.plans, oom_retry_fallback=notes.trouble,
                   nodes_s=node_seconds(executor.server.started, start + seconds, graph),
                   peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 1))  # KiB
        if failure is not None:
            kind = str(failure.get("exception_type", "")).rsplit(".", 1)[-1]
            row["error"] = f"{failure.get('node_type')}: {kind}: {failure.get('exception_message', '')}"[:600]
        if cuda:
            peaks = executor.server.peaks
            peaks.append(segment_peak())  # the last node's
            row.update(peak_allocated_gib=round(max(p[0] for p in peaks), 2),
                       peak_reserved_gib=round(max(p[1] for p in peaks), 2),
                       nodes_peak_gib=node_peaks(executor.server.started, peaks, graph),
                       unowned_at_start_gib=round(executor.server.unowned_at_start, 2))
        row.update(nvml.row() if nvml is not None else {}, loads=dict(notes.loads), patchers=loaded_patchers())
        row.update(dict(compile_s=compiled) if (compiled := compile_seconds(compiled_before)) else {})
        row.update(clock.row() if clock is not None else {})
        return row
    finally:
        logging.getLogger().removeHandler(notes)


def copied_bytes(run, keep_trace: Path | None = None) -> tuple[dict, dict[str, int]]:
    """``run()``'s row, and the bytes CUDA copied between host and device while it ran, by direction (``HtoD``,
    ``DtoH``; ``DtoD`` apart), from the torch profiler's memcpy events (their ``bytes`` in the Kineto trace): every
    copy, weights and latents alike, whichever path made it (core's loads and casts, the pack's, torchao's). Beside
    them, per direction, the bytes that crossed from or to pageable host memory (``HtoD pageable``: CUDA stages
    those through a buffer of its own, and the copy blocks the host) and how many copies they were, and the copies'
    time on the GPU (``HtoD us``); and how long the GPU ran kernels or copies at all (``GPU busy us``). With
    ``keep_trace``, the profiler's trace is kept there, gzipped (chrome://tracing or Perfetto read it)."""
    import gzip
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        row = run()
    moved: dict[str, int] = Counter()
    with tempfile.NamedTemporaryFile(suffix=".json") as trace:
        profiler.export_chrome_trace(trace.name)
        text = Path(trace.name).read_text()
    if keep_trace is not None:
        keep_trace.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(keep_trace, "wt") as kept:
            kept.write(text)
    events = json.loads(text).get("traceEvents", [])
    busy = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e)
    moved["GPU busy us"] = _union_length(busy)  # beside the run's seconds: how much of it the GPU had work
    for event in events:
        if event.get("cat") == "gpu_memcpy":
            name = event.get("name", "")
            direction = next((d for d in ("HtoD", "DtoH", "DtoD") if d in name), "other")
            size = int(event.get("args", {}).get("bytes", 0))
            moved[direction] += size
            moved[f"{direction} us"] += int(event.get("dur", 0))
            if "Pageable" in name:  # Kineto's "Memcpy HtoD (Pageable -> Device)"
                moved[f"{direction} pageable"] += size
                moved[f"{direction} pageable copies"] += 1  # their mean size tells a LoRA factor from a layer
    return row, dict(moved)


def _union_length(intervals: list[tuple[float, float]]) -> int:
    """The length the sorted ``intervals`` cover together (overlaps once)."""
    covered, end = 0.0, float("-inf")
    for start, stop in intervals:
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return int(covered)


def allocations_at_peak(run, device: int = 0) -> tuple[object, dict]:
    """``run()``'s result, and what was allocated on the GPU when ``run()`` held the most: torch's memory history of the
    run (the native allocator's; an emulated card has it), read by ``live_at_peak``."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        row = run()
        trace = torch.cuda.memory._snapshot()["device_traces"][device]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return row, live_at_peak(trace)


def _where(frames: list[dict]) -> str:
    """The innermost two Python lines of an allocation outside torch (the layer or node that asked for it)."""
    outside = [f for f in frames if "/torch/" not in f["filename"] and f["filename"] != "??"]
    return " < ".join(f"{'/'.join(Path(f['filename']).parts[-2:])}:{f['line']} {f['name']}" for f in outside[:2])


def live_at_peak(trace: list[dict], top: int = 12) -> dict:
    """From a memory-history trace (``alloc`` / ``free_requested`` events, as torch's allocated statistic counts
    them; ``segment_alloc`` / ``segment_free``, its reserved memory; ``oom``, an allocation the allocator refused,
    which callers such as cuDNN's workspace search may catch): the most the blocks allocated during the trace held
    at once (blocks from before it are not in it), where the allocation that reached it came from, the live blocks
    then by the line that allocated them (the ``top`` largest), the most reserved above the start, and the refusals."""
    live: dict[int, int] = {}
    held = peak = peak_at = reserved = peak_reserved = 0
    ooms: list[int] = []
    for index, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event["size"]
            held += event["size"]
            if held > peak:
                peak, peak_at = held, index
        elif action == "free_requested" and event["addr"] in live:
            held -= live.pop(event["addr"])
        elif action in ("segment_alloc", "segment_free"):
            reserved += event["size"] if action == "segment_alloc" else -event["size"]
            peak_reserved = max(peak_reserved, reserved)
        elif action == "oom":
            ooms.append(round(event["size"] / 2**20))
    at_peak: dict[int, dict] = {}
    for event in trace[:peak_at + 1]:
        if event["action"] == "alloc":
            at_peak[event["addr"]] = event
        elif event["action"] == "free_requested":
            at_peak.pop(event["addr"], None)
    groups: dict[str, list[int]] = {}
    for event in at_peak.values():
        group = groups.setdefault(_where(event.get("frames", [])), [0, 0])
        group[0] += event["size"]
        group[1] += 1
    largest = sorted(groups.items(), key=lambda item: -item[1][0])[:top]
    return dict(peak_gib=round(peak / GIB, 3), reached_by=_where(trace[peak_at].get("frames", [])) if trace else "",
                live=[dict(where=where, mib=round(size / 2**20, 1), blocks=count) for where, (size, count) in largest],
                peak_reserved_gib=round(peak_reserved / GIB, 3), refused_mib=ooms[:20], refusals=len(ooms))


def free(executor, nvml: NvmlPeak | None = None) -> dict:
    """What the server's worker runs for ``POST /free`` (unload models, free memory); GPU memory before and after
    (torch's, and the device's as NVML sees it)."""
    import comfy.model_management as mm
    import torch

    def held() -> dict:
        if not torch.cuda.is_available():
            return {}
        state = dict(allocated_gib=round(torch.cuda.memory_allocated() / GIB, 2),
                     reserved_gib=round(torch.cuda.memory_reserved() / GIB, 2))
        if nvml is not None and nvml.handle is not None:
            state["nvml_gib"] = round(nvml.nvml.nvmlDeviceGetMemoryInfo(nvml.handle).used / GIB, 2)
        return state

    before = held()
    executor.reset()
    mm.unload_all_models()
    gc.collect()
    mm.soft_empty_cache()
    return dict(before=before, after=held())


class ServerCollection:
    """The garbage collection ComfyUI's server runs after a prompt (0.3.75 main.py ``prompt_worker``: ``gc.collect()``
    and ``soft_empty_cache()`` once at least 10 s passed since the last), which the check's in-process executor does
    not: without it a previous workflow's models, held only in reference cycles, stay loaded in this process as they
    would not in a server (likely why, on the H200, a 24 GB card loaded the next workflow's models again every
    prompt: 2026-12-05, session 27)."""

    INTERVAL_S = 10.0

    def __init__(self):
        self.last = 0.0

    def after_prompt(self) -> None:
        import comfy.model_management as mm

        if time.perf_counter() - self.last > self.INTERVAL_S:
            gc.collect()
            mm.soft_empty_cache()
            self.last = time.perf_counter()


# What a workflow may write to the machine's disk: a quantized DiT the pack saves (8.2 GB true size) and inductor's
# caches. On the H200 (64 GiB disk, 42 GB of the check's models) the saved DiTs of three sources filled it
# (2026-12-05: "No space left on device"); so did three modes at once, each keeping room for itself alone
# (2026-12-06): each worker keeps room for every mode running (``--modes-at-once``).
DISK_NEED = 12 * 10**9


def keep_disk_for_a_workflow(saved: Path, free=lambda path: shutil.disk_usage(path).free,
                             need: int = DISK_NEED) -> list[str]:
    """Remove the oldest quantized DiTs the pack saved under ``saved`` (``models/ernie_quantized``) until ``need``
    bytes are free on its disk; the names removed. A later workflow of the same DiT quantizes it again."""
    removed = []
    entries = sorted((p for p in saved.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime) \
        if saved.is_dir() else []
    while entries and free(saved) < need:
        oldest = entries.pop(0)
        shutil.rmtree(oldest, ignore_errors=True)
        removed.append(oldest.name)
    return removed


def detect_core(comfy_dir: Path) -> str:
    """``fork`` for the pip-installable fork's layout (``comfy/cmd/main_pre.py``), else ``0.3.75`` (``main.py``,
    ``execution.py`` and ``nodes.py`` at the top)."""
    return "fork" if (comfy_dir / "comfy" / "cmd" / "main_pre.py").is_file() else "0.3.75"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", type=Path, required=True)
    parser.add_argument("--core", choices=("auto", "0.3.75", "fork"), default="auto",
                        help="the core's layout (auto: by --comfyui's files)")
    parser.add_argument("--base", type=Path, required=True, help="ComfyUI's base directory (models/ linked inside)")
    parser.add_argument("--flags", default="", help="ComfyUI's command-line flags for this mode")
    parser.add_argument("--card-gib", type=float, help="emulate a card of this many GiB")
    parser.add_argument("--workflows", required=True, help="comma-separated API twins (paths)")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--pe-tokens", type=int, default=64)
    parser.add_argument("--size", type=int, help="image size instead of the workflows' own")
    parser.add_argument("--base-steps", type=int, help="at most this many sampling steps")
    parser.add_argument("--warm-runs", type=int, default=1, help="warm runs per workflow (each a new prompt)")
    parser.add_argument("--modes-at-once", type=int, default=1,
                        help="ComfyUI processes the check runs at once: each keeps disk room for all of them")
    parser.add_argument("--copies", action="store_true", help="one more warm run per workflow under the torch "
                        "profiler: the bytes copied host <-> GPU (its time is not a warm time)")
    parser.add_argument("--allocations", action="store_true", help="one more warm run per workflow under torch's "
                        "memory history: what was allocated at its peak, by the line that allocated it")
    parser.add_argument("--trace-dir", type=Path, help="with --copies: keep the profiled prompt's trace there, "
                        "<workflow>.json.gz")
    parser.add_argument("--vae-patcher", choices=("core", "classic"), default="core",
                        help="classic: core's VAE on the classic patcher (the fork only: classic_vae)")
    options = parser.parse_args()
    host = HostMemoryPeaks()  # from the start: reading the models is where a host-RAM peak may be
    core = detect_core(options.comfyui) if options.core == "auto" else options.core
    if core == "fork":  # the fork sets up logging itself (main_pre), to stderr
        execution, _ = start_fork(options.comfyui, options.base, options.flags.split(), options.card_gib)
        if options.vae_patcher == "classic":
            classic_vae(sys.modules["comfy.sd"])
    else:
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(levelname)s %(name)s: %(message)s")
        execution, _ = start_comfyui(options.comfyui, options.base, options.flags.split(), options.card_gib)
    import torch

    executor = execution.PromptExecutor(_Server(), cache_type=execution.CacheType.CLASSIC,
                                        cache_args={"lru": 0, "ram": 0})
    facts = dict(allocator=torch.cuda.get_allocator_backend() if torch.cuda.is_available() else "cpu",
                 torch=torch.__version__, core=core, **dynamic_vram_state())
    print(f"== core {core}: {facts}", flush=True)
    nvml = NvmlPeak()
    clock = CoreClock()
    out = options.json.open("a")

    def record(workflow: str, run: str, row: dict) -> None:
        row = {**row, **host.row()}
        out.write(json.dumps(dict(workflow=workflow, run=run, **facts, **row)) + "\n")
        out.flush()
        print(f"== {workflow} [{run}]: {row}", flush=True)

    turbo = None
    collection = ServerCollection()

    def prompt(graph: dict) -> dict:
        row = run_prompt(execution, executor, graph, nvml, clock)
        collection.after_prompt()
        return row

    for path in map(Path, options.workflows.split(",")):
        need = DISK_NEED * options.modes_at_once
        removed = keep_disk_for_a_workflow(options.base / "models" / "ernie_quantized", need=need)
        if removed:
            print(f"== disk: removed the saved quantized DiTs {removed} to keep {need / 1e9:.0f} GB free", flush=True)
        graph = json.loads(path.read_text())
        turbo = graph if path.stem == "ernie_image_turbo" else turbo
        labels = ["first", "warm", *(f"warm {n}" for n in range(2, options.warm_runs + 1))]
        for run, label in enumerate(labels):
            row = prompt(variant(graph, run, options.pe_tokens, options.size, options.base_steps))
            record(path.stem, label, row | (dict(alive=alive_models()) if run == len(labels) - 1 else {}))
        if options.copies and torch.cuda.is_available():
            profiled = variant(graph, len(labels) + 1, options.pe_tokens, options.size, options.base_steps)
            trace = options.trace_dir / f"{path.stem}.json.gz" if options.trace_dir else None
            row, moved = copied_bytes(functools.partial(run_prompt, execution, executor, profiled, clock=clock), trace)
            record(path.stem, "copies", dict(row, copied_bytes=moved))
            collection.after_prompt()
        if options.allocations and torch.cuda.is_available():
            traced = variant(graph, len(labels) + 2, options.pe_tokens, options.size, options.base_steps)
            row, peak = allocations_at_peak(functools.partial(run_prompt, execution, executor, traced))
            record(path.stem, "allocations", dict(row, allocations_at_peak=peak))
            collection.after_prompt()
        if path.stem == "ernie_image_pe_local":  # after the profiled prompts: theirs are warm, not a reload
            record(path.stem, "/free", dict(ok=True, **free(executor, nvml)))
            if turbo is not None:
                record("ernie_image_turbo", "after /free", prompt(variant(
                    turbo, len(labels), options.pe_tokens, options.size, options.base_steps)))


if __name__ == "__main__":
    main()
