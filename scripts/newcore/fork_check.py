#!/usr/bin/env python3
"""Starts the 0.12.1 fork of ComfyUI in-process as the GPU end-to-end check's worker does (``checks/gpu/e2e_worker.py``:
``start_fork``, the pack under another folder name in a scratch base directory, ``--fast dynamic_vram``) and says,
in a few lines, whether the check can run there: the versions it found, whether dynamic VRAM came on, the node
modules that failed to import, and whether every node the check's twins use is registered. Exit 1 when the start
fails or a node is missing. A failure here costs seconds, before the check writes its models.

    PYTHONPATH=/tmp/site python3 scripts/newcore/fork_check.py [--comfyui .gpu-fork/src] [--cpu]
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import logging
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "checks" / "gpu"))  # the check's worker and workflow list, as the check runs them

VERSIONS = ("torch", "transformers", "diffusers", "numpy", "protobuf", "wrapt", "aiohttp", "comfy-aimdo",
            "comfy_kitchen", "torchao", "cache-dit", "opentelemetry-api", "nvidia-ml-py")


class Failures(logging.Handler):
    """The node modules the fork logged as failed to import."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.modules: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.endswith(" import failed"):
            cause = record.exc_info[1] if record.exc_info else None
            self.modules.append(f"{message.removesuffix(' import failed')}: {type(cause).__name__}: {cause}"[:160])


def version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--comfyui", type=Path, default=REPO / ".gpu-fork" / "src")
    parser.add_argument("--cpu", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    print("versions: " + ", ".join(f"{name} {version(name)}" for name in VERSIONS), flush=True)
    import e2e_worker
    import gpu_e2e

    base = Path(tempfile.mkdtemp(prefix="fork-check-"))
    (base / "custom_nodes").mkdir()
    (base / "custom_nodes" / "comfyui-ernie-image").symlink_to(REPO, target_is_directory=True)
    failures = Failures()
    logging.getLogger().addHandler(failures)
    flags = ["--fast", "dynamic_vram", *(["--cpu"] if args.cpu else [])]
    try:
        _, nodes = e2e_worker.start_fork(args.comfyui.resolve(), base, flags, None)
    except BaseException:  # noqa: BLE001 - said, then exit 1
        print("FORK START FAILED:\n" + traceback.format_exc()[-4000:], flush=True)
        return 1
    finally:
        logging.getLogger().removeHandler(failures)
    import torch

    state = e2e_worker.dynamic_vram_state()
    mappings = nodes.NODE_CLASS_MAPPINGS
    needed = {node["class_type"] for name in gpu_e2e.WORKFLOWS if name not in gpu_e2e.DERIVED  # made of the others
              for node in json.loads((gpu_e2e.REPO / "tests" / "workflows" / f"{name}.json").read_text()).values()}
    missing = sorted(needed - set(mappings))
    print(f"fork started in {time.perf_counter() - start:.0f} s: {len(mappings)} nodes, "
          f"{sum(1 for n in mappings if n.startswith('ErnieImage'))} of them the pack's; device "
          f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}; "
          f"dynamic VRAM {'ON' if state['dynamic_vram'] else 'off'} (CoreModelPatcher {state['core_patcher']})",
          flush=True)
    print(f"node modules that failed to import: {len(failures.modules)}")
    for line in failures.modules:
        print("  " + line)
    print(f"the twins' nodes: {len(needed)}, missing: {', '.join(missing) or 'none'}", flush=True)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
