"""ERNIE-Image Parallel against the other users and processes of the machine (issue 41: finding 1, and the stale
folder of finding 15).

The old pool met in a TCPStore that listened on every interface with no authentication, and its idle workers
unpickled what was SET there: any process could run a command as the ComfyUI user. Now the ranks meet in a
FileStore in the pool's private folder, the jobs reach the workers as JSON on a pipe only rank 0 holds, and gloo
listens on the loopback. These tests run a real pool (rank 0 this process, one CPU worker on gloo) and attack it as
another user would: where the tests run as root the attacker runs as nobody (uid 65534); the socket checks and the
checks that nothing is unpickled run as any user.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pickle
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from comfyui_ernie_image.nodes.accel.cache import CacheRun
from comfyui_ernie_image.nodes.accel.patching import CACHE_KEY
from comfyui_ernie_image.nodes.errors import ErnieImageError
from comfyui_ernie_image.nodes.host.sampling import make_mirrored_run
from comfyui_ernie_image.nodes.loaders import ErnieImageDiTLoader
from comfyui_ernie_image.nodes.parallel import patching
from comfyui_ernie_image.nodes.parallel.messages import encode, forward_job, read_job
from comfyui_ernie_image.nodes.parallel.patching import apply_parallel, stop_workers
from comfyui_ernie_image.nodes.parallel.pool import WorkerPool
from helpers.accel import sample
from helpers.parallel import NOBODY, attack, beyond_loopback, can_open_as_another_user, listening

pytestmark = pytest.mark.usefixtures("cpu_workers")
ROOT = os.getuid() == 0
MARKER_WAIT_S = 3.0  # the old worker ran the attacker's pickle within milliseconds of the SET


class Touch:
    """A pickle that runs ``touch path`` where it is loaded: the attack's payload."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


@pytest.fixture(scope="module")
def model(tiny_models, comfy_paths):
    yield ErnieImageDiTLoader.execute("diffusion_models/ernie-image-turbo-tiny.safetensors").result[0]
    stop_workers()  # the other test files sample without workers in this process


def idle_pool(model):
    """A parallel MODEL that sampled once (its pool waits for the next job: keep the MODEL, or the pool stops with
    it), and the pids of rank 0 and the worker."""
    parallel = apply_parallel(model, "sequence", 2)
    sample(parallel, cfg=1.0, steps=1)
    return parallel, [os.getpid(), *(p.pid for p in patching._current.pool.processes.values())]


def appears(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists()


def test_an_idle_pool_listens_on_the_loopback_only_even_where_gloo_is_told_another_interface(model, monkeypatch):
    others = [name for name, addresses in psutil.net_if_addrs().items()
              if any(a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
                     for a in addresses)]
    if others:  # a user's setting for other work: the pack's ranks all run on this machine, on the loopback
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", others[0])
    stop_workers()
    parallel, pids = idle_pool(model)
    sockets = listening(pids)
    assert sockets, "gloo listens for its connections"
    assert beyond_loopback(sockets) == []
    if others:
        assert os.environ["GLOO_SOCKET_IFNAME"] == others[0]  # ComfyUI's own environment is left as it was


def test_the_old_attack_on_every_port_the_pool_listens_on_runs_nothing_and_the_pool_still_samples(model, tmp_path):
    parallel, pids = idle_pool(model)
    expected = sample(parallel, cfg=1.0, steps=1)
    marker = tmp_path / "attacker-ran-this"
    said = attack(listening(pids), marker)
    assert "sent" in said, said  # the attack reached the sockets
    assert not appears(marker, MARKER_WAIT_S)
    assert patching._current.pool.alive
    assert torch.equal(sample(parallel, cfg=1.0, steps=1), expected)


def test_the_pool_folder_and_its_store_are_this_users_alone(model):
    parallel, pids = idle_pool(model)
    worker = pids[1]
    folder = Path(psutil.Process(worker).cmdline()[-1]).parent  # the worker's spec file lies there
    store = folder / "store"
    assert stat.S_IMODE(folder.lstat().st_mode) == 0o700 and folder.lstat().st_uid == os.getuid()
    assert stat.S_ISREG(store.lstat().st_mode) and stat.S_IMODE(store.lstat().st_mode) == 0o600
    if ROOT:  # another user cannot read or write the store, nor write a job into the worker's pipe
        assert not can_open_as_another_user(str(store), "rb")
        assert not can_open_as_another_user(str(store), "ab")
        assert not can_open_as_another_user(f"/proc/{worker}/fd/0", "wb")


@pytest.mark.parametrize("case", ["a pickle", "an unknown per-run change"])
def test_a_job_that_is_not_the_expected_message_is_refused_by_the_worker_in_words__written_by_a_stub(
        model, tmp_path, case):
    """Only rank 0 can write into a worker's pipe, and it writes JSON: a stub writes what it never would."""
    parallel, _ = idle_pool(model)
    pool = patching._current.pool
    marker = tmp_path / "unpickled"
    if case == "a pickle":  # the old attack's value
        pool.share(pickle.dumps(Touch(marker)) + b"\n", [])
        words = "a job from rank 0 is not the expected JSON message: it is not JSON"
    else:
        tensors = [torch.zeros(1), torch.zeros(1), torch.zeros(1)]
        pool.share(forward_job("sequence", tensors, [1], 99, {"no-such-change": {}}, None), tensors)
        words = "rank 0 asked for the per-run change 'no-such-change', which no feature registered in this worker"
    (worker,) = pool.processes.values()
    assert worker.wait(timeout=120) == 1
    said = pool.exits("after the stub's job")
    assert "the worker of rank 1 (on the CPU) exited with code 1 after the stub's job" in said
    assert words in said, said
    assert not marker.exists()
    stop_workers()


@pytest.mark.parametrize("line, why", [
    (pickle.dumps({"kind": "stop"}) + b"\n", "it is not JSON"),
    (b'{"kind": "run this"}\n', '"kind" is not one of'),
    (encode({"kind": "stop", "then": "more"}), "a stop job has only a kind"),
    (b'{"kind": "forward"}\n', "a forward job has the keys"),
    (b"[" * 100_000 + b"\n", "it is not JSON (NestedTooDeeply)"),
    (b'{"kind": "stop"}', "it is not one line of at most"),  # cut short: no end of line
    (b" " * (1 << 20) + b'{"kind": "stop"}\n', "it is not one line of at most 1048576 bytes"),
])
def test_the_worker_reads_only_the_messages_rank_0_writes(line, why):
    with pytest.raises(ErnieImageError, match="a job from rank 0 is not the expected JSON message") as error:
        read_job(line)
    assert why in str(error.value) and len(str(error.value)) < 600  # the line quoted cut short


def _forward(**change) -> bytes:
    tensors = [torch.zeros(2, 128, 8, 8), torch.zeros(2), torch.zeros(2, 7, 32)]
    job = json.loads(forward_job("cfg", tensors, [7, 3], 1, {}, ((0, 1), 3)))
    return encode({**job, **change})


@pytest.mark.parametrize("change, why", [
    ({"mode": "all"}, '"mode" is not one of'),
    ({"tensors": [{"shape": [2], "dtype": "float32"}]}, '"tensors" is not a list of 3'),
    ({"tensors": [{"shape": [2], "dtype": "object"}] * 3}, "a tensor is not"),
    ({"tensors": [{"shape": [-1], "dtype": "float32"}] * 3}, "a tensor is not"),
    ({"tensors": [{"shape": [1] * 9, "dtype": "float32"}] * 3}, "a tensor is not"),
    ({"text_lens": [True]}, '"text_lens" is not a list of counts'),
    ({"runs": {"cache": "CacheRun"}}, '"runs" is not an object of named arguments'),
    ({"call": [[0, 1], "3"]}, '"call" is not null or'),
])
def test_a_forward_job_is_checked_key_by_key_before_anything_is_allocated(change, why):
    assert read_job(_forward())["tensors"][0] == ([2, 128, 8, 8], torch.float32)
    with pytest.raises(ErnieImageError, match="not the expected JSON message") as error:
        read_job(_forward(**change))
    assert why in str(error.value)


SETTINGS = {"Fn_compute_blocks": 4, "Bn_compute_blocks": 0, "residual_diff_threshold": 0.5, "max_warmup_steps": 2,
            "max_cached_steps": -1, "max_continuous_cached_steps": -1, "taylorseer_order": 1, "steps_mask": "off",
            "steps_mask_cache": "dynamic"}


@pytest.mark.parametrize("arguments", [
    {"settings": SETTINGS},  # no step count
    {"settings": SETTINGS, "steps": 8, "make": "os.system"},
    {"settings": {**SETTINGS, "Fn_compute_blocks": "4"}, "steps": 8},
    {"settings": {**SETTINGS, "taylorseer_order": True}, "steps": 8},
    {"settings": {**SETTINGS, "__class__": "CacheRun"}, "steps": 8},
    {"settings": SETTINGS, "steps": 0},
])
def test_the_cache_run_a_worker_makes_takes_only_cache_settings_by_name_and_type(model, arguments):
    holder = model.model.diffusion_model
    assert isinstance(make_mirrored_run(CACHE_KEY, holder, "layers", {"settings": SETTINGS, "steps": 8}), CacheRun)
    with pytest.raises(ErnieImageError, match="the Cache-DiT settings from rank 0 are not CacheSettings' fields"):
        make_mirrored_run(CACHE_KEY, holder, "layers", arguments)


def _pool_folder(parent: Path, name: str, owner: dict | None = None) -> str:
    folder = parent / f"ernie-image-parallel-{name}"
    folder.mkdir(mode=0o700)
    (folder / "store").write_bytes(b"")
    if owner is not None:
        (folder / "owner.json").write_text(json.dumps(owner))
    return folder.name


def test_a_new_pool_removes_the_folders_of_pools_whose_process_is_gone_and_keeps_the_others(tmp_path, monkeypatch):
    """What a ComfyUI killed with SIGKILL left behind goes with the next pool; another ComfyUI's live pool, another
    user's folder and anything not made by a pool stay."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = {"pid": ended.pid, "started": psutil.Process(ended.pid).create_time()}
    ended.kill()
    ended.wait()
    this = {"pid": os.getpid(), "started": psutil.Process().create_time()}
    removed = {_pool_folder(tmp_path, "killed", gone),
               _pool_folder(tmp_path, "pid-given-again", {**this, "started": this["started"] - 1000})}
    kept = {_pool_folder(tmp_path, "live", this), _pool_folder(tmp_path, "being-made")}  # no owner.json yet
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "ernie-image-parallel-link").symlink_to(elsewhere)
    kept.add("ernie-image-parallel-link")
    if ROOT:
        others = _pool_folder(tmp_path, "of-another-user", gone)
        os.chown(tmp_path / others, NOBODY, NOBODY)
        kept.add(others)
    before = {p.name for p in tmp_path.glob("ernie-image-parallel-*")}
    WorkerPool(2, torch.device("cpu"), [None], {}, {})  # its own folder is made, nothing started
    left = {p.name for p in tmp_path.glob("ernie-image-parallel-*")}
    assert left - before and not (left - before) & kept  # the new pool's folder
    assert left & before == kept and not left & removed
    assert elsewhere.is_dir()
