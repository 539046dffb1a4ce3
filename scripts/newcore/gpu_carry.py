#!/usr/bin/env python3
"""Assembles ``.gpu-fork/`` (git-ignored) for the GPU end-to-end check on the 0.12.1 fork of ComfyUI
(``hiddenswitch/pip-and-uv-installable-ComfyUI``, ``checks/gpu/gpu_e2e.py --core fork``) on a machine without a package
index: the GPU machine's image (Python 3.12, torch 2.11, transformers 5.17, ...; the device README's KINDS.md lists
its packages) plus what travels with the repository (64 MiB a call):

- ``src/``: the fork's source tree, extracted from its fetched snapshot and patched (``shared/newcore``: the two
  patches), less what neither the core nor the executor imports (tests, docs, ``comfy_api_nodes``, blueprints, the
  Docker files, the example folders);
- ``wheels/``: cp312 manylinux x86_64 (or pure-Python) wheels of ``WHEELS``: the pack's own additions
  (diffusers, cache-dit, torchao, ...), comfy-aimdo and comfy_kitchen, and every module the fork imports on its way
  to a running executor that the image lacks (each of them is imported there: its configuration parser, the
  tracer ``main_pre`` makes and its instrumentors, and ``comfy.cmd.server``, which the vanilla environment for
  custom nodes imports, with its assets database and API: SQLAlchemy, alembic and pydantic define their classes at
  import, so an empty stand-in does not do). ``checks/gpu/e2e_worker.py`` stands in for two (``FORK_STAND_INS``): ``av``
  (as on 0.3.75) and ``opentelemetry.exporter`` (the OTLP exporters, made only for an endpoint; they would bring
  protobuf-generated code for a protobuf the image has at an unknown version). Node modules that fail to import
  for want of a package (kornia, openai, spandrel, vtracer) are the fork's optional nodes, logged and skipped.

Carry ``.gpu-fork`` (``run``'s ``carry``), and there run ``GPU_CALL`` (``--print-call`` prints it): the wheels
installed into /tmp/site, the fork's start checked (``fork_check.py``: a failure costs seconds and says why), then
the quick tier on the fork with dynamic VRAM, in the default mode and on an emulated 16 GB card side by side.
(``scripts/newcore/rehearse_gpu_call.sh`` runs that here, on the CPU, in a Python 3.12 venv of the image's
packages, without network.)

    python3 scripts/newcore/gpu_carry.py [--git-dir DIR] [--shared DIR] [--src PATCHED_TREE] [--no-wheels]

Prints what it carries and its size (and the repository's own files beside it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / ".gpu-fork"
DEFAULT_GIT_DIR = "/work/.mirror/hiddenswitch+pip-and-uv-installable-ComfyUI/repo"
LIMIT_MIB = 55  # of the 64 MiB a call carries, with the repository's own files

# The fork's tree: these top-level entries only (the core, its API, the executor, the built-in nodes, the
# vanilla-compatibility shims; its licence and pyproject for the record).
KEEP = ("comfy", "comfy_api", "comfy_execution", "comfy_extras", "comfy_compatibility", "comfy_config",
        "LICENSE", "pyproject.toml")
DROP_INSIDE = ("comfy/comfyui.db",)  # an empty database file committed in the snapshot
# Marks that the patches of shared/newcore are in (a tree given with --src must have them).
PATCHED = {"comfy/model_management.py": "from .interruption import InterruptProcessingException",
           "comfy/model_base.py": "    model_management.archive_model_dtypes(self.diffusion_model)\n        else:"}

# The device call (``run``, carry [".gpu-fork"]): its files come back from $OUT (fork-check.log, run.log, e2e.md,
# e2e.jsonl, e2e.log).
GPU_CALL = (
    "set -o pipefail; export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1; "
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
    ".gpu-fork/wheels/*.whl && export PYTHONPATH=/tmp/site || exit 1; "
    "nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader; "
    "timeout 300 python3 scripts/newcore/fork_check.py 2>$OUT/fork-check.log "
    "|| { tail -c 4000 $OUT/fork-check.log; exit 1; }; "
    "python3 checks/gpu/gpu_e2e.py --core fork --modes default,card16 --parallel 2 --base-steps 20 --work /tmp/e2e "
    "--out $OUT --deadline-s 520 2>&1 | tee $OUT/run.log | tail -c 10000"
)

# name==version: why. Versions: the fork's CPU venv (shared/newcore recipe) where it has them.
WHEELS = {
    # What scripts/gpu_carry.sh carries for 0.3.75: the pack's requirements and the core's extra samplers.
    "diffusers==0.42.1": "the pack",
    "cache-dit==1.5.3": "the pack (Cache-DiT node)",
    "torchao==0.17.0": "the pack (fp8/int8 quantization)",
    "importlib_metadata==8.7.0": "diffusers; opentelemetry-api",
    "torchsde==0.2.6": "the core's samplers",
    "trampoline==0.1.2": "torchsde",
    # The fork's own.
    "comfy-aimdo==0.1.8": "dynamic VRAM (model_management, ops, model_patcher import it)",
    "comfy_kitchen==0.2.7": "the core's quantized ops (quant_ops); 0.2.40 is 68 MB",
    "ConfigArgParse==1.8.0": "cli_args",
    "gguf==0.19.0": "comfy.gguf (model_patcher imports it)",
    "natsort==8.4.0": "model_patcher, base_nodes",
    "frozendict==2.4.7": "comfy_execution.graph_types",
    "lazy-object-proxy==1.12.0": "nodes_context (the node mappings)",
    "can_ada==3.0.0": "model_downloader_types (loaders' file lists)",
    "requests-cache==1.3.0": "model_downloader, node_requests_caching (the executor)",
    "cattrs==25.1.1": "requests-cache (25.1: attrs >= 24.3, where 26 wants 25.4)",
    "url-normalize==2.2.1": "requests-cache",
    "platformdirs==4.12.2": "requests-cache",
    "Pebble==5.2.0": "hf_hub_download_with_disable_xet (model_downloader)",
    # comfy.cmd.server, which the vanilla environment (``folder_paths``, ``server``, ``nodes`` as top-level modules for
    # custom nodes) imports: its assets API and database (not started here: no server runs).
    "SQLAlchemy==2.1.1": "server: app.assets, app.database",
    "alembic==1.20.0": "server: app.database.db",
    "Mako==1.4.3": "alembic",
    "pydantic==2.13.5": "server: app.assets.api",
    "pydantic_core==2.46.5": "pydantic (its exact pin)",
    "annotated-types==0.8.0": "pydantic",
    "typing-inspection==0.4.4": "pydantic",
    # The tracer main_pre makes, which the executor's spans use (no exporter endpoint: nothing leaves).
    "opentelemetry-api==1.39.1": "main_pre's tracer, the executor's spans",
    "opentelemetry-sdk==1.39.1": "main_pre's tracer provider",
    "opentelemetry-semantic-conventions==0.60b1": "main_pre",
    "opentelemetry-instrumentation==0.60b1": "main_pre's instrumentors",
    "opentelemetry-instrumentation-aio-pika==0.60b1": "main_pre",
    "aio-pika==9.5.8": "main_pre's aio-pika instrumentor imports it (the distributed queue's client)",
    "aiormq==6.9.2": "aio-pika",
    "pamqp==3.3.0": "aiormq",
    "opentelemetry-instrumentation-requests==0.60b1": "main_pre",
    "opentelemetry-instrumentation-urllib3==0.60b1": "main_pre",
    "opentelemetry-instrumentation-aiohttp-server==0.60b1": "main_pre",
    "opentelemetry-instrumentation-aiohttp-client==0.60b1": "main_pre",
    "opentelemetry-util-http==0.60b1": "the http instrumentors",
    "opentelemetry-processor-baggage==0.60b1": "main_pre",
}
PIP_DOWNLOAD = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                "--python-version", "3.12", "--implementation", "cp",
                *(f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                                              "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
                                              "manylinux_2_5_x86_64"))]


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def tracked_size() -> int:
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((REPO / f.decode()).stat().st_size for f in files if f and (REPO / f.decode()).is_file())


def extract(git_dir: Path, shared: Path, work: Path) -> Path:
    """The snapshot's tree, patched (shared/newcore's extract_snapshot.py and its two patches)."""
    src = work / "src"
    subprocess.run([sys.executable, str(shared / "extract_snapshot.py"), str(git_dir), str(src)], check=True,
                   stdout=subprocess.DEVNULL)
    for patch in sorted(shared.glob("0*.patch")):
        subprocess.run(["patch", "-p1", "--forward", "--quiet", "-i", str(patch)], cwd=src, check=True)
    return src


def check_patched(src: Path) -> None:
    for path, mark in PATCHED.items():
        if mark not in (src / path).read_text():
            raise SystemExit(f"{src / path} lacks shared/newcore's patch ({mark.strip()!r})")


def copy_tree(src: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "tests", "tests-unit")
    for name in KEEP:
        if (src / name).is_dir():
            shutil.copytree(src / name, target / name, ignore=ignore, symlinks=True)
        else:
            shutil.copy2(src / name, target / name)
    for name in DROP_INSIDE:
        (target / name).unlink(missing_ok=True)


def download_wheels(target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    done = subprocess.run([*PIP_DOWNLOAD, "-d", str(target), *WHEELS], capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write("\n".join(line for line in done.stderr.splitlines() if "is ignored: it is" not in line))
        raise SystemExit(f"pip download failed ({done.returncode})")
    names = {}
    for wheel in target.glob("*.whl"):
        names.setdefault(wheel.name.split("-")[0].lower().replace("_", "-"), []).append(wheel.name)
    twice = {n: w for n, w in names.items() if len(w) > 1}
    if twice:  # two versions of one package stop pip install --no-deps
        raise SystemExit(f"two wheels of one package: {twice}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--git-dir", type=Path, default=Path(os.environ.get("ERNIE_NEWCORE_GIT_DIR", DEFAULT_GIT_DIR)),
                        help="the fork's fetched git snapshot (default %(default)s)")
    parser.add_argument("--shared", type=Path,
                        default=Path(os.environ.get("ERNIE_NEWCORE_SHARED", REPO.parent / "shared" / "newcore")),
                        help="shared/newcore: extract_snapshot.py and the patches")
    parser.add_argument("--src", type=Path, help="an extracted and patched tree instead (e.g. /tmp/newcore/src)")
    parser.add_argument("--no-wheels", action="store_true", help="keep .gpu-fork/wheels as it is")
    parser.add_argument("--print-call", action="store_true", help="print the device command (GPU_CALL) and stop")
    args = parser.parse_args()
    if args.print_call:
        print(GPU_CALL)
        return 0
    ignored = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", f"{OUT}/"]).returncode == 0
    if not ignored:
        raise SystemExit(f"{OUT} is not git-ignored: add /.gpu-fork/ to .gitignore")
    with tempfile.TemporaryDirectory(prefix="gpu-fork-") as work:
        src = args.src.resolve() if args.src else extract(args.git_dir.resolve(), args.shared.resolve(), Path(work))
        check_patched(src)
        copy_tree(src, OUT / "src")
    if not args.no_wheels:
        download_wheels(OUT / "wheels")
    wheels = sorted((OUT / "wheels").glob("*.whl"))
    mib = 2**20
    print(f"{OUT / 'src'}: {size(OUT / 'src') / mib:.1f} MiB ({', '.join(KEEP)})")
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / mib:6.2f} MiB  {wheel.name}")
    total, repo = size(OUT), tracked_size()
    print(f"{OUT}: {total / mib:.1f} MiB ({len(wheels)} wheels, {size(OUT / 'wheels') / mib:.1f} MiB); "
          f"the repository's own files {repo / mib:.1f} MiB; together {(total + repo) / mib:.1f} MiB "
          f"(limit {LIMIT_MIB} of the call's 64)")
    print(f"the device call ({len(GPU_CALL)} characters; carry [\".gpu-fork\"]):\n{GPU_CALL}")
    return 0 if total + repo <= LIMIT_MIB * mib else 1


if __name__ == "__main__":
    sys.exit(main())
