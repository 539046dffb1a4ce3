"""The GPU end-to-end check: every shareable workflow through a real ComfyUI, in every VRAM mode, on true-size models.

    python checks/gpu/gpu_e2e.py                           # quick tier: default mode, every workflow (under 8 minutes)
    python checks/gpu/gpu_e2e.py --tier full               # + --lowvram, --novram, emulated 24 GB and 16 GB cards
    python checks/gpu/gpu_e2e.py --modes card24,fp8-unet --workflows ernie_image_low_vram
    python checks/gpu/gpu_e2e.py --tier full --parallel 2  # two modes at once (each its own ComfyUI process)
    python checks/gpu/gpu_e2e.py --tiny --cpu              # tiny models on the CPU (CI runs three workflows so)
    python checks/gpu/gpu_e2e.py --core fork               # on the 0.12.1 fork (.gpu-fork/src), dynamic VRAM on
    python checks/gpu/gpu_e2e.py --warm-runs 3 --pack ../old   # median of 3 warm runs; another checkout's pack
    python checks/gpu/gpu_e2e.py --modes card16 --fresh-process --copies  # per recipe: its own process, bytes moved
    python checks/gpu/gpu_e2e.py --modes card16 --fresh-process --cold-disk  # each process after a cold disk
    python checks/gpu/gpu_e2e.py --cards 6.5,10,11.2 --copies --workflows ernie_image_turbo_gguf  # the sweep table
    python checks/gpu/gpu_e2e.py --cards 10,12,8 --copies --workflows ernie_image_gguf_te_q4,ernie_image_gguf_te_q8

Writes true-size random-weight models in the real layouts once (``e2e_models.py``; about 42 GB under ``--work``, and
the GGUF text encoders, 2.1 and 3.6 GB, only when a twin that reads them runs: ``ernie_image_gguf_te_q4`` and
``ernie_image_gguf_te_q8``, the GGUF workflow with llama.cpp's Q4_K_M and Q8_0 text encoder),
then runs one ComfyUI process per mode (``e2e_worker.py``), each running the API twins of ``tests/workflows/`` that
ComfyUI 0.3.75 can run (the native-ERNIE twin needs ComfyUI >= 0.19; the remote-PE twin needs a server: both are
listed as not run). Prints a table (result or error, first-run and warm seconds, whole-run peak GPU memory, the
warnings, OOM retries and fallbacks ComfyUI logged) and writes it with every run's JSON under ``--out``.

``--core fork`` runs the pip-installable fork of ComfyUI (0.12.1, ``hiddenswitch/pip-and-uv-installable-ComfyUI``,
``scripts/newcore/gpu_carry.py`` carries it to the GPU machine) instead of 0.3.75, with ``--fast dynamic_vram``
(the fork's switch for dynamic VRAM, comfy-aimdo; ``--dynamic-vram off`` leaves it out) and upstream's VRAM reserve
(``--reserve-vram 0.4``; the fork reserves none by default). Each row says whether
dynamic VRAM was on and which patcher class held each model, the peak device memory NVML saw next to torch's
peaks, and the model loads the core logged (a warm run that loads again shows there).

``--cards 6.5,10,11.2`` emulates cards of any size (GiB), as the ``card<GiB>`` modes (``--modes card10.5``) do, each
in turn with five warm prompts unless ``--warm-runs`` says otherwise, and prints the sweep table (``e2e_sweep.py``,
also written to ``sweep.md``): per card size and workflow, the pack's logged plan and its predicted warm prompt next to
the measured median and spread, the first run, the bytes copied host <-> GPU in one warm prompt (``--copies``), the
peaks and host RAM, and how many lines about out-of-memory, retries or fallbacks were logged.

``held<GiB>`` modes (``--modes held8``) run on the whole GPU while another process holds all its free memory but
that many GiB (``ballast.py``): a display and other programs' memory as every reader of the device sees it, comfy-aimdo
included (an emulated card does not bound aimdo). They run one at a time (``--parallel 1``) and not with ``--cpu``.

``--parallel N`` runs N modes at once, to fit the whole matrix into a lease: each mode still has its own process,
memory limit and result (an emulated card counts this process's memory alone), but its times then include the other
modes' use of the GPU, the bus, the CPUs and the disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:  # as checks.gpu.gpu_e2e (the tests), or as a script and a sibling module (checks/gpu first on sys.path)
    from .e2e_sweep import gpu_peak, host_ram, sweep_table
    from .e2e_worker import CUDA_CONTEXT_GIB
except ImportError:
    from e2e_sweep import gpu_peak, host_ram, sweep_table
    from e2e_worker import CUDA_CONTEXT_GIB

REPO = Path(__file__).resolve().parents[2]
# Turbo first (run again after /free), the PE before the FP8 workflow: the order a user might meet them in.
WORKFLOWS = ("ernie_image_turbo", "ernie_image_turbo_single_files", "ernie_image_pe_local", "ernie_image_low_vram",
             "ernie_image_base", "ernie_image_cache_compile", "ernie_image_turbo_lora", "ernie_image_low_vram_lora",
             "ernie_image_turbo_gguf")
# Twins the check makes from another (name: (the twin, {node: what its inputs become: those of the same node in
# another twin, or these, a class_type among them putting another node in its place})), for recipes without a
# shared workflow of their own. A node the twin lacks is taken
# whole from the other twin and put after the model loader (a LoRA: it takes the MODEL the sampler took). The
# low-VRAM workflow's note gives three: its loader with the LoRA workflow's LoRA, the Turbo workflow with the fp8
# text encoder (24 GB, bf16 as released) and the PE workflow with its loader's settings; the GGUF workflow's note
# (it reads the Q4_K_M file e2e_models.py writes) its 8 and 12 GB settings before the memory plan (explicit values,
# which the plan keeps), a LoRA, the Q3_K_M file, core's tiled decode, and Base (the same random weights: the
# architecture is the same) at 50 steps, CFG 4.
DERIVED = {
    "ernie_image_low_vram_lora": ("ernie_image_turbo_lora", {"loader": "ernie_image_low_vram"}),
    "ernie_image_turbo_te_fp8": ("ernie_image_turbo", {"loader": {  # 24 GB, bf16 as released: the recipe's values
        "quantization": "none", "text_encoder_device": "default", "text_encoder_weight_dtype": "fp8_e4m3fn"}}),
    "ernie_image_gguf": ("ernie_image_turbo_gguf", {"te": {  # 8 GB before the plan: the TE on the CPU
        "device": "default", "weight_dtype": "default"}}),
    "ernie_image_gguf_te_fp8": ("ernie_image_turbo_gguf", {"te": {  # 12 GB before the plan: the TE in fp8
        "device": "default", "weight_dtype": "fp8_e4m3fn"}}),
    "ernie_image_turbo_gguf_lora": ("ernie_image_turbo_gguf", {"lora": "ernie_image_turbo_lora"}),
    "ernie_image_gguf_lora": ("ernie_image_gguf", {"lora": "ernie_image_turbo_lora"}),
    "ernie_image_gguf_q3": ("ernie_image_gguf", {
        "dit": {"model_name": "diffusion_models/ernie-image-turbo-Q3_K_M.gguf"}}),
    "ernie_image_gguf_tiled_decode": ("ernie_image_gguf", {"decode": {  # core's tiled decode, its defaults
        "class_type": "VAEDecodeTiled", "tile_size": 512, "overlap": 64, "temporal_size": 64, "temporal_overlap": 8}}),
    "ernie_image_base_gguf": ("ernie_image_turbo_gguf", {
        "positive": "ernie_image_base", "negative": "ernie_image_base", "sigmas": "ernie_image_base",
        "sampler": {"cfg": 4.0}}),
    # 10 and 12 GB (issue 44): the GGUF workflow with llama.cpp's Q4_K_M and Q8_0 text encoder (e2e_models.py writes
    # them only for these twins), its device and weight storage auto: the plan places it.
    "ernie_image_gguf_te_q4": ("ernie_image_turbo_gguf", {"te": {
        "model_name": "text_encoders/ernie-image-text-encoder-Q4_K_M.gguf"}}),
    "ernie_image_gguf_te_q8": ("ernie_image_turbo_gguf", {"te": {
        "model_name": "text_encoders/ernie-image-text-encoder-Q8_0.gguf"}}),
    # 16 and 24 GB: the PE workflow with the low-VRAM loader's settings and the PE in fp8 too.
    "ernie_image_pe_low_vram": ("ernie_image_pe_local", {"loader": {
        "quantization": "auto", "text_encoder_device": "default", "text_encoder_weight_dtype": "fp8_e4m3fn",
        "pe_weight_dtype": "fp8_e4m3fn"}}),
}
NOT_RUN = {"ernie_image_turbo_native": "needs ComfyUI >= 0.19 (native ERNIE loaders); the check runs {core}",
           "ernie_image_pe_remote": "needs an OpenAI-compatible server; CPU tests run it against transformers serve"}
CORES = {"0.3.75": "0.3.75", "fork": "the 0.12.1 fork"}
FORK_DIRS = (REPO / ".gpu-fork" / "src", Path(os.environ.get("ERNIE_NEWCORE_WORK", "/tmp/newcore")) / "src")
# name: ComfyUI flags, on the whole GPU.
MODES = {
    "default": "", "lowvram": "--lowvram", "novram": "--novram", "gpu-only": "--gpu-only", "highvram": "--highvram",
    "fp16-unet": "--fp16-unet", "fp8-unet": "--fp8_e4m3fn-unet", "bf16-unet": "--bf16-unet",
}
# ``card<GiB>`` modes (card24 … card8 the recipes' sizes, card6 and card4 below them, card10.5 any other) emulate a
# card of that size. They use torch's own allocator: its memory fraction is a hard limit there, as a real card's size
# is (ComfyUI's default, cudaMallocAsync, is kept in every other mode). On the fork with dynamic VRAM, comfy-aimdo maps
# the weights it streams outside torch's allocator: the NVML and aimdo columns say whether the card still bounds them.
CARD_MODE = re.compile(r"card(\d+(?:\.\d+)?)")
CARD_FLAGS = "--disable-cuda-malloc"
# ``held<GiB>`` modes: ComfyUI's default flags on the whole GPU, all its free memory but that many GiB held by another
# process (``ballast.py``).
HELD_MODE = re.compile(r"held(\d+(?:\.\d+)?)")
SWEEP_WARM_RUNS = 5  # issue 43: warm = the median of 5 new prompts, their spread printed
TIERS = {"quick": ["default"], "full": ["default", "lowvram", "novram", "card24", "card16"]}


def _card_gib(size: float) -> float:
    """``size`` if a card of that many GiB can be emulated (more than a CUDA context), else ValueError."""
    if not math.isfinite(size) or size <= CUDA_CONTEXT_GIB:
        raise ValueError(f"a card must be larger than the {CUDA_CONTEXT_GIB} GiB a CUDA context takes, got {size:g}")
    return size


def mode_settings(mode: str) -> tuple[str, float | None]:
    """A mode's ComfyUI flags and the card GiB it emulates or leaves free (None: the whole GPU); ValueError for an
    unknown mode."""
    if mode in MODES:
        return MODES[mode], None
    held = HELD_MODE.fullmatch(mode)
    if held is not None:
        return MODES["default"], _card_gib(float(held[1]))
    card = CARD_MODE.fullmatch(mode)
    if card is None:
        raise ValueError(f"unknown mode {mode[:40]!r}: one of {', '.join(MODES)}, card<GiB> (card8, card10.5) or "
                         "held<GiB> (held8)")
    return CARD_FLAGS, _card_gib(float(card[1]))


def held_gib(mode: str) -> float | None:
    """The GiB a ``held<GiB>`` mode leaves free (None: another mode)."""
    return mode_settings(mode)[1] if HELD_MODE.fullmatch(mode) else None


class BallastError(RuntimeError):
    """The process that was to hold the GPU's memory did not (no CUDA, less free than the mode leaves)."""


@contextlib.contextmanager
def ballast(keep_gib: float | None, log) -> Iterator[None]:
    """Another process holding all the GPU's free memory but ``keep_gib`` GiB while the block runs (None: nothing)."""
    if keep_gib is None:
        yield
        return
    holder = subprocess.Popen([sys.executable, str(REPO / "checks" / "gpu" / "ballast.py"), f"{keep_gib:g}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        said = holder.stdout.readline().strip()
        if not said.startswith("held"):
            raise BallastError(f"the ballast could not hold the GPU's memory: see {log.name}")
        log.write(f"ballast: {said}\n")
        log.flush()
        yield
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def card_mode(size: float) -> str:
    """The mode that emulates a card of ``size`` GiB: card8, card10.5 (at most three decimals)."""
    return "card" + f"{size:.3f}".rstrip("0").rstrip(".")


def card_sizes(text: str) -> list[float]:
    """``--cards``: comma-separated card sizes in GiB (6.5,10,11.2), each above a CUDA context."""
    try:
        return [_card_gib(float(part)) for part in text.split(",")]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--cards takes card sizes in GiB, comma-separated (6.5,10,11.2), each "
                                         f"larger than {CUDA_CONTEXT_GIB}; got {text[:80]!r}: {error}") from None


def prepare(work: Path, true_size: bool, gguf_text_encoders: Sequence[str] = ()) -> Path:
    """The models folder, written once (in a process of its own: the GPU memory goes back when it ends), with the
    GGUF text encoders ``gguf_text_encoders`` (``twin_files``)."""
    models = work / "models"
    start = time.perf_counter()
    # A module of the repository (it builds on scripts.tiny_models and bench.common), so run from its root.
    subprocess.run([sys.executable, "-m", "checks.gpu.e2e_models", str(models),
                    *(["--true-size"] if true_size else []), "--gguf-text-encoders", ",".join(gguf_text_encoders)],
                   check=True, cwd=REPO)
    print(f"models ready in {time.perf_counter() - start:.0f} s: {models}", flush=True)
    return models


def base_directory(work: Path, mode: str, models: Path, pack: Path) -> Path:
    """A fresh ComfyUI base directory per mode (its own PE cache), the pack under another folder name. The costs the
    pack measures once per machine (``host/probe.py``: ``user/ernie-image/``) are one folder for every process
    of the check, as in one user's ComfyUI: measured by the first, read by the others."""
    base = work / f"base-{mode}-{time.time_ns()}"
    (base / "custom_nodes").mkdir(parents=True)
    (base / "custom_nodes" / "comfyui-ernie-image").symlink_to(pack, target_is_directory=True)
    (base / "models").symlink_to(models, target_is_directory=True)
    costs = work / "costs"
    costs.mkdir(exist_ok=True)
    (base / "user").mkdir()
    (base / "user" / "ernie-image").symlink_to(costs, target_is_directory=True)
    return base


def evict_page_cache(models: Path) -> str:
    """Drop the model files' pages from the OS page cache (``posix_fadvise`` DONTNEED: no root needed), so that the
    next process reads them from the disk as after a reboot; what stayed cached, as util-linux's ``fincore`` counts
    it (a RAM-backed filesystem keeps everything)."""
    # One path per file: the models folder links one file under several names (the repack's and the snapshot's).
    sizes = {(stat.st_dev, stat.st_ino): (path, stat.st_size) for path in models.rglob("*")
             if path.is_file() and not path.is_symlink() for stat in (path.stat(),)}
    files = [path for path, _ in sizes.values()]
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    total = sum(size for _, size in sizes.values())
    try:
        counted = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                                 capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return f"page cache of {total / 1e9:.1f} GB of model files dropped (fincore absent: not counted)"
    return f"page cache dropped: {sum(map(int, counted)) / 1e9:.2f} of {total / 1e9:.1f} GB of model files still cached"


def twin_path(args, name: str) -> Path:
    """The API twin ``name``: the pack's ``tests/workflows/`` file, or a ``DERIVED`` one written under ``--work``."""
    if name not in DERIVED:
        return args.pack / "tests" / "workflows" / f"{name}.json"
    source, edits = DERIVED[name]
    graph = json.loads(twin_path(args, source).read_text())
    for node, inputs in edits.items():
        if node not in graph:  # a LoRA node: it takes the sampler's MODEL, and gives it to all that took it
            model = next(n for n in graph.values() if n["class_type"] == "SamplerCustom")["inputs"]["model"]
            for other in graph.values():
                if other["inputs"].get("model") == model:
                    other["inputs"]["model"] = [node, 0]
            graph[node] = json.loads(twin_path(args, inputs).read_text())[node]
            graph[node]["inputs"]["model"] = model
            continue
        if isinstance(inputs, str):  # its widgets' values; its links stay this twin's
            inputs = {key: value for key, value in json.loads(twin_path(args, inputs).read_text())[node]["inputs"]
                      .items() if not isinstance(value, list)}
        elif "class_type" in inputs:  # another node in its place (ComfyUI's tiled decode): its links stay
            inputs = dict(inputs)
            graph[node]["class_type"] = inputs.pop("class_type")
        graph[node]["inputs"].update(inputs)
    path = args.work / "derived" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(graph, indent=2))
    return path


def twin_files(args, suffix: str = ".gguf", folder: str = "text_encoders/") -> list[str]:
    """The files under ``folder`` with ``suffix`` that the twins to run name (the GGUF text encoders the models
    folder gets only for them; a twin that does not exist is the worker's to report)."""
    known = [name for name in args.workflows
             if name in DERIVED or (args.pack / "tests" / "workflows" / f"{name}.json").is_file()]
    names = [value for name in known for node in json.loads(twin_path(args, name).read_text()).values()
             for value in node["inputs"].values()
             if isinstance(value, str) and value.startswith(folder) and value.endswith(suffix)]
    return sorted(set(names))


def run_mode(mode: str, args, models: Path, deadline: float) -> list[dict]:
    """One mode's ComfyUI process over every workflow: its rows (its log in ``e2e-MODE.log`` under ``--out``)."""
    card = mode_settings(mode)[1]
    if time.time() > deadline - 30:
        return [dict(mode=mode, card_gib=card, workflow="(mode)", run="-", ok=False, error="not started: no time left")]
    start = time.perf_counter()
    # --fresh-process: one process per workflow, so its host RAM is that recipe's alone (first and warm runs).
    groups = [[w] for w in args.workflows] if args.fresh_process else [args.workflows]
    rows = []
    with (args.out / f"e2e-{mode}.log").open("w") as log:
        for workflows in groups:
            if rows and time.time() > deadline - 30:
                rows += [dict(mode=mode, card_gib=card, workflow=w, run="-", ok=False,
                              error="not started: no time left") for w in workflows]
                continue
            rows += _run_worker(mode, args, models, log, deadline, workflows)
    print(f"{mode}: {time.perf_counter() - start:.0f} s", flush=True)
    return rows


def _run_worker(mode: str, args, models: Path, log, deadline: float, workflows: list[str]) -> list[dict]:
    flags, card = mode_settings(mode)
    results = args.out / f"runs-{mode}.jsonl"
    results.unlink(missing_ok=True)
    base = base_directory(args.work, mode, models, args.pack)
    if args.core == "fork":
        # Upstream's reserve on Linux (comfy/cli_args.py @03294572: --reserve-vram None, model_management's 400 MB);
        # the fork's default is 0, which let a text encoder onto an 8 GB card that upstream keeps on the CPU.
        flags = (flags + " --reserve-vram 0.4").strip()
        if args.dynamic_vram == "on":
            flags += " --fast dynamic_vram"  # the fork's switch for dynamic VRAM (comfy-aimdo)
    command = [sys.executable, str(REPO / "checks" / "gpu" / "e2e_worker.py"), "--comfyui", str(args.comfyui),
               "--core", args.core, "--base", str(base), "--flags=" + flags + (" --cpu" if args.cpu else ""),
               "--workflows", ",".join(str(twin_path(args, w)) for w in workflows),
               "--json", str(results), "--pe-tokens", str(args.pe_tokens), "--warm-runs", str(args.warm_runs)]
    command += ["--modes-at-once", str(args.parallel)]
    command += ["--card-gib", str(card)] if card and held_gib(mode) is None else []
    command += ["--size", "256"] if args.tiny else []
    command += ["--base-steps", str(args.base_steps)] if args.base_steps else []
    command += ["--copies"] if args.copies else []
    command += ["--allocations"] if args.allocations else []
    command += ["--trace-dir", str(args.out / f"trace-{mode}")] if args.trace else []
    command += ["--vae-patcher", args.vae_patcher] if args.core == "fork" else []
    if args.cold_disk:
        evicted = evict_page_cache(models)
        print(f"{mode} {','.join(workflows)}: {evicted}", flush=True)
        log.write(evicted + "\n")
    log.write(f"\n===== {mode}: {' '.join(command)}\n")
    log.flush()
    timed_out = False
    try:
        with ballast(held_gib(mode), log):
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:
        timed_out = True
    except BallastError as error:
        return [dict(mode=mode, card_gib=card, workflow="(process)", run="start", ok=False, error=str(error))]
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.is_file() else []
    results.unlink(missing_ok=True)  # the rows go into e2e.jsonl (few files come back from a lent machine)
    if timed_out or not rows:
        rows.append(dict(workflow="(process)", run="end", ok=False,
                         error="timed out (the check's deadline)" if timed_out else "the process died: see the log"))
    return [dict(mode=mode, card_gib=card, **row) for row in rows]


def _peak(runs: list[dict]) -> str:
    ram = host_ram(runs)
    return gpu_peak(runs) + (f"; {ram}" if ram else "")


def _patchers(runs: list[dict]) -> str:
    """Dynamic VRAM on or off, and the DiT's patcher class (the other models' where no DiT was held)."""
    dynamic = next((r["dynamic_vram"] for r in runs if "dynamic_vram" in r), None)
    held = {name: patcher for r in runs for name, patcher in r.get("patchers", {}).items()}
    dit = [patcher for name, patcher in held.items() if name.startswith("ErnieImageModel")]
    shown = ", ".join(sorted(set(dit))) if dit else ", ".join(f"{n}: {p}" for n, p in sorted(held.items())) or "-"
    if dynamic is None and not held:
        return "-"
    return ("-" if dynamic is None else "on" if dynamic else "off") + f": {shown}"


def _loads(runs: list[dict]) -> str:
    """The model loads each run logged (first, warm, after /free), short: ``load X`` (0.3.75's "Requested to load
    X": X was not loaded), ``dynamic X`` (staged for dynamic VRAM), ``unload X``, and how many times the patchers
    loaded completely or partially. A warm run that loads again shows here."""
    short = (("Requested to load ", "load "), ("Model ", "dynamic "), ("Unloading ", "unload "))
    parts = []
    for r in runs:
        if "loads" not in r:
            continue
        items = []
        for line, n in r["loads"].items():
            for prefix, word in short:
                if line.startswith(prefix):
                    line = word + line[len(prefix):].removesuffix(" prepared for dynamic VRAM loading")
                    break
            items.append(f"{line} ×{n}" if n > 1 else line)
        parts.append(f"{r['run']}: {', '.join(items) or 'none'}")
    return "loads " + "; ".join(parts) if parts else ""


# What a prompt may find allocated that no loaded model holds and is no earlier workflow's model (latents,
# conditionings, compiled kernels' workspaces).
LEFT_OVER_GIB = 0.5


def table(rows: list[dict], core: str = "0.3.75") -> str:
    """One line per mode and workflow: result, first-run and warm seconds, peak GiB (torch's allocated and
    reserved, NVML's whole device (this process), comfy-aimdo's own count), dynamic VRAM and the DiT's patcher,
    notes from ComfyUI's log (the model loads of each run first)."""
    lines = ["| mode | workflow | result | first run s | warm s | peak GiB alloc / reserved / NVML device (process) / "
             "aimdo; host RAM (peak anonymous, file-backed) | dynamic VRAM: DiT patcher | log notes |",
             "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["mode"], row["workflow"]), []).append(row)
    for (mode, workflow), runs in groups.items():
        by_run = {r["run"]: r for r in runs}
        failed = [r for r in runs if not r["ok"]]
        error = " ".join(failed[0].get("error", "?").split())[:160] if failed else ""  # one line: a table cell
        result = f"**{failed[0]['run']}: {error}**" if failed else "ok"
        if "/free" in by_run:
            held = by_run["/free"]
            result += "; /free: " + " → ".join(
                f"{state.get('allocated_gib', '-')} / {state.get('reserved_gib', '-')} GiB" for state in
                (held["before"], held["after"]))
        seconds = {run: f"{r['seconds']:.1f}" if r.get("seconds") else "-" for run, r in by_run.items()}
        warm = [r["seconds"] for run, r in by_run.items() if run.startswith("warm") and r.get("seconds")]
        if len(warm) > 1:  # --warm-runs: the median, and each run's time
            seconds["warm"] = f"{statistics.median(warm):.2f} (median of {' '.join(f'{w:.2f}' for w in warm)})"
        notes = [n.replace("|", "/")[:200] for n in sorted({note for r in runs for note in r.get("notes", [])})]
        if _loads(runs):
            notes.insert(0, _loads(runs)[:400])
        moved = by_run.get("copies", {}).get("copied_bytes")
        if moved is not None:  # --copies: one more warm prompt, profiled
            notes.insert(0, "copied per warm prompt: " + ", ".join(
                f"{d} {moved.get(d, 0) / 1e6:,.0f} MB" for d in ("HtoD", "DtoH", "DtoD")))
        peak = by_run.get("allocations", {}).get("allocations_at_peak")
        if peak:  # --allocations: one more warm prompt under torch's memory history
            notes.insert(0, f"allocated during a prompt at its peak: {peak['peak_gib']} GiB, reached by "
                         f"{peak['reached_by']}; largest: " + "; ".join(
                             f"{b['where']} {b['mib']} MiB" for b in peak["live"][:3]))
        left = by_run.get("first", {}).get("unowned_at_start_gib", 0.0)
        if left > LEFT_OVER_GIB:  # an earlier workflow's model ComfyUI dropped, held until a collection (a cycle)
            notes.insert(0, f"first prompt began with {left:.2f} GiB allocated that no loaded model holds")
        extra = {name: n for r in runs for name, n in r.get("alive", {}).items() if n > 1}
        if extra:  # more of a kind alive after a collection than one workflow uses: a model kept that should go
            notes.insert(0, "alive after a collection: " + ", ".join(
                f"{n} {name}" for name, n in sorted(extra.items())))
        slowest = list(by_run.get("warm", {}).get("nodes_s", {}).items())[:3]
        if slowest:  # where a warm prompt's time goes (model moves land in the node that needs the model)
            notes.insert(0, "warm: " + ", ".join(f"{node.split(' ', 1)[-1]} {s:.1f} s" for node, s in slowest))
        first = seconds.get("first", "-") + (f" (after /free {seconds['after /free']})" if "after /free" in seconds
                                             else "")
        lines.append(f"| {mode} | {workflow} | {result} | {first} | {seconds.get('warm', '-')} | {_peak(runs)} | "
                     f"{_patchers(runs)} | {'<br>'.join(notes[:7]) or '-'} |")
    lines += [f"| - | {name} | not run: {why.format(core=CORES[core])} | | | | | |" for name, why in NOT_RUN.items()]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The check's options; ``modes`` the modes to run (``--modes``, then ``--cards``' emulated cards, or the
    tier's), ``warm_runs`` 5 for a sweep unless given."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=list(TIERS), default="quick")
    parser.add_argument("--modes", help=f"comma-separated, instead of the tier's ({', '.join(MODES)}, card<GiB>: "
                        "an emulated card, card8, card10.5, or held<GiB>: the GPU with all but that much held by "
                        "another process, held8)")
    parser.add_argument("--cards", type=card_sizes, default=[], help="emulated cards of these GiB, comma-separated "
                        "(6.5,10,11.2), run after --modes' modes (instead of the tier's), with the sweep table")
    parser.add_argument("--workflows", default=",".join(WORKFLOWS), help="comma-separated twin names")
    parser.add_argument("--tiny", action="store_true", help="tiny models (256² images) instead of true-size ones")
    parser.add_argument("--cpu", action="store_true", help="ComfyUI on the CPU (--cpu)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/ernie-e2e"), help="models and ComfyUI folders")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "out" / "e2e")))
    parser.add_argument("--core", choices=("auto", *CORES), default="auto",
                        help="0.3.75, or the 0.12.1 fork (auto: by --comfyui's layout; 0.3.75 without --comfyui)")
    parser.add_argument("--comfyui", type=Path, help="the core's folder (default: .gpu/comfyui or .cache/comfyui; "
                        "for the fork .gpu-fork/src or $ERNIE_NEWCORE_WORK/src)")
    parser.add_argument("--vae-patcher", choices=("core", "classic"), default="core",
                        help="the fork only: classic puts core's VAE on the classic patcher, as the fork does for a "
                        "VAE it must not offload (does the decode get past the fork's dynamic patcher so?)")
    parser.add_argument("--dynamic-vram", choices=("on", "off"), default="on",
                        help="the fork's --fast dynamic_vram (off: the fork's classic patcher)")
    parser.add_argument("--pe-tokens", type=int, default=64, help="the PE's max_new_tokens (the workflows: 2048)")
    parser.add_argument("--base-steps", type=int, help="cap the Base workflows' 50 steps (said in the table)")
    parser.add_argument("--deadline-s", type=float, default=560.0, help="stop starting modes after this")
    parser.add_argument("--parallel", type=int, default=1, help="modes run at once (their times then overlap)")
    parser.add_argument("--warm-runs", type=int, help="warm runs per workflow, each a new prompt; the tables give the "
                        f"median (default 1, with --cards {SWEEP_WARM_RUNS})")
    parser.add_argument("--fresh-process", action="store_true", help="one ComfyUI process per workflow (each "
                        "recipe's host RAM alone), instead of one per mode")
    parser.add_argument("--copies", action="store_true", help="one more warm run per workflow under the torch "
                        "profiler: bytes copied host <-> GPU per warm prompt")
    parser.add_argument("--allocations", action="store_true", help="one more warm run per workflow under torch's "
                        "memory history: what was allocated at its peak (the native allocator: emulated cards)")
    parser.add_argument("--trace", action="store_true", help="with --copies: keep the profiled prompt's torch "
                        "trace, OUT/trace-<mode>/<workflow>.json.gz")
    parser.add_argument("--cold-disk", action="store_true", help="drop the model files from the page cache before "
                        "each process (first runs as after a reboot)")
    parser.add_argument("--pack", type=Path, default=REPO, help="the pack to install, and its tests/workflows twins "
                        "(another checkout: the same check on older code, e.g. to compare times)")
    args = parser.parse_args(argv)
    if args.comfyui is None:
        fork = args.core == "fork"
        candidates = FORK_DIRS if fork else (REPO / ".gpu" / "comfyui", REPO / ".cache" / "comfyui")
        args.comfyui = next((p for p in candidates if (p / ("comfy/cmd/main_pre.py" if fork else "main.py")).is_file()),
                            None)
        if args.comfyui is None:
            parser.error(f"no core found in {', '.join(map(str, candidates))}: pass --comfyui")
    args.pack = args.pack.resolve()
    if args.core == "auto":
        args.core = "fork" if (args.comfyui / "comfy" / "cmd" / "main_pre.py").is_file() else "0.3.75"
    args.workflows = args.workflows.split(",")
    named = args.modes.split(",") if args.modes else [] if args.cards else TIERS[args.tier]
    args.modes = list(dict.fromkeys([*named, *map(card_mode, args.cards)]))
    for mode in args.modes:
        try:
            mode_settings(mode)
        except ValueError as error:
            parser.error(f"--modes: {error}")
    held = [mode for mode in args.modes if held_gib(mode) is not None]
    if held and (args.parallel > 1 or args.cpu):
        parser.error(f"--modes {','.join(held)}: another process holds the GPU's memory in these modes, so they run "
                     "on a GPU (not --cpu) and one mode at a time (--parallel 1)")
    if args.warm_runs is None:
        args.warm_runs = SWEEP_WARM_RUNS if args.cards else 1
    elif args.warm_runs < 1:
        parser.error(f"--warm-runs must be 1 or more, got {args.warm_runs}")
    return args


def main() -> None:
    args = parse_args()
    modes = args.modes
    deadline = time.time() + args.deadline_s
    args.out.mkdir(parents=True, exist_ok=True)
    models = prepare(args.work, true_size=not args.tiny, gguf_text_encoders=twin_files(args))
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = [row for mode_rows in pool.map(lambda mode: run_mode(mode, args, models, deadline), modes)
                for row in mode_rows]
    with (args.out / "e2e.log").open("a") as log:
        for mode in modes:
            mode_log = args.out / f"e2e-{mode}.log"
            if mode_log.is_file():
                log.write(mode_log.read_text())
                mode_log.unlink()
    report = table(rows, args.core)
    sweep = sweep_table(rows)
    if args.parallel > 1:
        overlap = f"\n\n(modes ran {args.parallel} at a time: each time includes the others' load on the machine)"
        report, sweep = report + overlap, sweep + overlap
    (args.out / "e2e.md").write_text(report + "\n")
    (args.out / "sweep.md").write_text(sweep + "\n")
    (args.out / "e2e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(report)
    if any(r.get("card_gib") for r in rows):  # emulated cards: the sweep too
        print("\n" + sweep)
    if args.base_steps:
        print(f"(Base workflows capped at {args.base_steps} steps; the PE at {args.pe_tokens} new tokens)")
    sys.exit(0 if all(r["ok"] for r in rows) else 1)


if __name__ == "__main__":
    main()
