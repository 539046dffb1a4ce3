"""The worker processes of a parallel DiT and their process group (engine: torch.distributed, no ComfyUI).

Rank 0 is ComfyUI's own process; each other rank is a worker process started here, one per extra CUDA GPU (CPU
workers only where ``CPU_WORKERS`` allows them: the tests). A worker is a fresh Python that imports the pack as
ComfyUI did (``BOOTSTRAP``), then runs ``worker.serve``: not multiprocessing's spawn, which would run ComfyUI's
``main.py`` again in each worker.

The ranks meet in a FileStore in the pool's private folder (``rendezvous.py``), where each worker also says that it
is ready, or leaves its last error. Each job reaches a worker as a line of JSON on its standard input, a pipe only
rank 0 holds (``messages.py``): a worker waits there between jobs, where a collective would time out, and leaves
when the pipe closes (rank 0's process ended). The tensors go through the process group (gloo on the CPU, NCCL on
CUDA GPUs), on the loopback. A job is the same on every rank: rank 0 broadcasts the inputs and each rank runs its
share of the forward (``split.py``).

A worker that exits is noticed before each job and, on gloo, by the collective it leaves (its connection closes):
the pool stops, and the error names the rank, its device and how it exited, with the worker's own error where it
had one. The next run starts a new pool.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ErnieImageError
from .messages import FORWARD, MAX_JOB_BYTES, STOP, encode, read_job
from .rendezvous import check_private, loopback_environment, loopback_sockets, make_folder, open_store

POLL_S = 0.05
STOP_WAIT_S = 30.0  # a worker told to stop leaves at once; one that does not in this time is killed
EXIT_WAIT_S = 2.0  # a closed connection can come before the exit status of the worker that closed it
# A collective that waits this long has lost a rank (the inputs of a step are sent just before its collectives).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)
PACK_DIR = Path(__file__).resolve().parents[2]
PACK_NAME = __name__.rsplit(".nodes.", 1)[0]  # the name ComfyUI imported the pack under
# Each CPU worker holds a whole DiT in the machine's memory (an 8B DiT in fp32: 32 GB): only where this is "1", and
# at most MAX_CPU_WORKERS of them (the tests run the same code as GPUs on gloo).
CPU_WORKERS, MAX_CPU_WORKERS = "ERNIE_IMAGE_PARALLEL_CPU_WORKERS", 2

# argv: the core's folder, the pack's folder and name, the spec file (JSON). The core's arguments go in first
# (``host/worker_core.py``, loaded by its file: the host package imports model management, which reads them); then
# the pack's nodes as ComfyUI imports them (each feature registers the per-run changes the workers may make).
BOOTSTRAP = """
import asyncio, importlib, importlib.util, json, sys
core, pack_dir, pack, spec_path = sys.argv[1:5]
sys.path.insert(0, core)
def load(name, path, **options):
    spec = importlib.util.spec_from_file_location(name, path, **options)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
with open(spec_path) as file:
    worker_spec = json.load(file)
load("ernie_image_worker_core", pack_dir + "/nodes/host/worker_core.py").configure_core(worker_spec["core"])
load(pack, pack_dir + "/__init__.py", submodule_search_locations=[pack_dir])
async def node_list():
    return await (await sys.modules[pack].comfy_entrypoint()).get_node_list()
asyncio.run(node_list())
importlib.import_module(pack + ".nodes.parallel.worker").serve(worker_spec)
"""


def worker_gpus(device: torch.device, world: int, visible: int) -> list[int | None]:
    """The GPU of each worker rank (1 … world - 1): the ``visible`` CUDA GPUs other than rank 0's ``device``, in
    order; None for CPU processes, where ComfyUI runs on the CPU and ``CPU_WORKERS`` allows them."""
    if device.type != "cuda":
        if os.environ.get(CPU_WORKERS) != "1":
            raise ErnieImageError(
                f"ERNIE-Image Parallel runs a worker on each extra CUDA GPU, each with its own copy of the DiT, and "
                f"this ComfyUI runs the DiT on {device.type.upper()} ({visible} CUDA GPUs visible to it). Remove the "
                f"node, or run ComfyUI on a CUDA GPU with {world - 1} more. (Workers on the CPU, each holding a "
                f"whole DiT in this machine's memory, are for tests: {CPU_WORKERS}=1 allows up to "
                f"{MAX_CPU_WORKERS}.)")
        if world - 1 > MAX_CPU_WORKERS:
            raise ErnieImageError(
                f"ERNIE-Image Parallel with {CPU_WORKERS}=1 runs at most {MAX_CPU_WORKERS} workers on the CPU, each "
                f"holding a whole DiT in this machine's memory: use gpus {MAX_CPU_WORKERS + 1} or fewer.")
        return [None] * (world - 1)
    others = [i for i in range(visible) if i != (device.index or 0)]
    if len(others) < world - 1:
        raise ErnieImageError(
            f"ERNIE-Image Parallel asks for {world} GPUs, and this ComfyUI sees {visible}. Lower gpus, or give "
            "ComfyUI more GPUs (CUDA_VISIBLE_DEVICES and ComfyUI's --cuda-device limit what it sees)."
        )
    return others[: world - 1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _join(store: dist.Store, backend: str, rank: int, world: int, device: torch.device) -> None:
    options = {"device_id": device} if device.type == "cuda" else {}  # NCCL: the communicator binds to the GPU
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT, **options)


def _cpu_share(world: int) -> int:
    return max(1, (os.cpu_count() or 1) // world)


def _how_it_ended(code: int) -> str:
    return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"


class WorkerPool:
    """Ranks 1 … ``world`` - 1 as worker processes, rank 0 this process on ``device``; ``gpus``: each worker's GPU
    (``worker_gpus``). ``core``: what a worker needs to start this process's ComfyUI core (JSON); ``payload``: what
    it builds its DiT from (pickled, functions by reference: the worker imports the pack under the same name, and
    reads the file only from the pool's private folder)."""

    def __init__(self, world: int, device: torch.device, gpus: list[int | None], core: dict, payload: dict):
        self.world, self.device, self.gpus = world, device, gpus
        self._core, self._payload = core, payload
        self.folder = make_folder()
        self.processes: dict[int, subprocess.Popen] = {}  # by rank
        self._store: dist.FileStore | None = None
        self._threads = torch.get_num_threads()
        self.stopped = False

    def start(self, should_stop: Callable[[], bool]) -> bool:
        """Start the workers and wait until each has built its DiT and joined the group. False when
        ``should_stop()`` said so first (the pool is stopped then); an error when a worker exits."""
        try:
            return self._start(should_stop)
        except BaseException:
            self.stop(kill=True)
            raise

    def _start(self, should_stop: Callable[[], bool]) -> bool:
        if self.device.type == "cpu":  # the ranks share the cores: threads of one that spin while it waits in a
            torch.set_num_threads(_cpu_share(self.world))  # collective would starve the others (8x slower steps)
        self._store = open_store(self.folder)
        payload = self.folder / "payload.pt"
        torch.save(self._payload, payload)
        for rank, gpu in enumerate(self.gpus, start=1):
            spec = {"rank": rank, "world": self.world, "backend": _backend(self.device), "folder": str(self.folder),
                    "core": self._core}
            spec_path = self.folder / f"rank{rank}.json"
            spec_path.write_text(json.dumps(spec))
            argv = [sys.executable, "-c", BOOTSTRAP, self._core["folder"], str(PACK_DIR), PACK_NAME, str(spec_path)]
            self.processes[rank] = subprocess.Popen(argv, env=self._environment(gpu), stdin=subprocess.PIPE)
        while not all(self._store.check([f"ready/{rank}"]) for rank in self.processes):
            self._raise_if_exited("while it loaded the DiT")
            if should_stop():
                self.stop()
                return False
            time.sleep(POLL_S)
        with loopback_sockets():
            _join(self._store, _backend(self.device), 0, self.world, self.device)
        return True

    def _environment(self, gpu: int | None) -> dict[str, str]:
        env = {**os.environ, **loopback_environment()}
        if gpu is None:
            env["OMP_NUM_THREADS"] = str(_cpu_share(self.world))
        else:  # the worker sees its own GPU alone, as its cuda:0
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[gpu] if visible else str(gpu)
        return env

    @property
    def alive(self) -> bool:
        return not self.stopped and all(p.poll() is None for p in self.processes.values())

    def share(self, job: bytes, tensors: list[torch.Tensor]) -> None:
        """Send every worker ``job`` (``messages.encode``), then broadcast ``tensors`` (which the job must describe,
        so that the workers can receive them)."""
        self._raise_if_exited("before this step")
        for process in self.processes.values():
            try:
                process.stdin.write(job)
                process.stdin.flush()
            except OSError:  # the worker exited since the check above
                self._raise_if_exited("before this step")
                raise
        for tensor in tensors:
            dist.broadcast(tensor.contiguous(), src=0)

    def failure(self) -> ErnieImageError | None:
        """After an error in a job: the pool is stopped, its workers killed (the ranks' collectives are out of step
        now), and the error to raise when a worker ended the job (None: the error was this process's own)."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while self.alive and time.monotonic() < deadline:
            time.sleep(POLL_S)
        words = self.exits("during this step")
        self.stop(kill=True)
        return ErnieImageError(words) if words else None

    def _raise_if_exited(self, when: str) -> None:
        words = self.exits(when)
        if words:
            self.stop()
            raise ErnieImageError(words)

    def exits(self, when: str) -> str:
        """In words, which workers exited (``when``: since when) and how; empty when none did, or the pool stopped
        them."""
        ended = [(rank, p.poll()) for rank, p in self.processes.items() if p.poll() is not None]
        if not ended or self.stopped:
            return ""
        lines = []
        for rank, code in ended:
            where = "the CPU" if self.gpus[rank - 1] is None else f"GPU {self.gpus[rank - 1]}"
            line = f"ERNIE-Image Parallel: the worker of rank {rank} (on {where}) {_how_it_ended(code)} {when}"
            said = self._store.get(f"error/{rank}").decode() if self._store.check([f"error/{rank}"]) else ""
            lines.append(f"{line}: {said}" if said else f"{line}.")
        return "\n".join(lines) + "\nThe workers are stopped; the next run starts them again."

    def stop(self, kill: bool = False) -> None:
        """Stop every worker and leave the process group; safe to call again. ``kill``: at once, for workers that
        may be inside a collective that will never complete."""
        if self.stopped:
            return
        self.stopped = True
        for process in self.processes.values():
            if kill:
                process.kill()
            elif process.poll() is None:
                try:
                    process.stdin.write(encode({"kind": STOP}))
                except OSError:
                    pass  # it exited meanwhile
            try:
                process.stdin.close()  # a worker also leaves when its pipe closes
            except OSError:
                pass
        deadline = time.monotonic() + STOP_WAIT_S
        for process in self.processes.values():
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(self._threads)
        shutil.rmtree(self.folder, ignore_errors=True)


class WorkerChannel:
    """A worker's side of the pool: the store it met rank 0 in, the group, and the jobs rank 0 sends on its
    standard input."""

    def __init__(self, spec: dict):
        self.rank, self.world, self.backend = spec["rank"], spec["world"], spec["backend"]
        self.folder = Path(spec["folder"])
        self._store = open_store(self.folder)
        self._jobs = sys.stdin.buffer

    def payload(self) -> dict:
        """What rank 0 saved to build the DiT from: read only from the pool's private folder, which no other user
        can write (``rendezvous.check_private``)."""
        path = self.folder / "payload.pt"
        check_private(self.folder, path)
        return torch.load(path, weights_only=False)

    def join(self, device: torch.device) -> None:
        """Say that this worker is ready, and join the group (rank 0 joins once every worker is ready)."""
        self._store.set(f"ready/{self.rank}", b"1")
        _join(self._store, self.backend, self.rank, self.world, device)

    def jobs(self, device: torch.device) -> Iterator[tuple[dict, list[torch.Tensor]]]:
        """Each job (``messages.read_job``) and its tensors (received on ``device``), until rank 0 says stop or its
        process ends (the pipe closes)."""
        while True:
            line = self._jobs.readline(MAX_JOB_BYTES + 1)
            if not line:
                return
            job = read_job(line)
            if job["kind"] == STOP:
                return
            tensors = []
            if job["kind"] == FORWARD:
                tensors = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in job["tensors"]]
            for tensor in tensors:
                dist.broadcast(tensor, src=0)
            yield job, tensors

    def fail(self, error: BaseException) -> None:
        """Leave ``error``'s last words where rank 0 reads them when this process has exited."""
        self._store.set(f"error/{self.rank}", "".join(traceback.format_exception_only(error)).strip())

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

