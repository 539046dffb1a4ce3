"""Where the ranks of a parallel DiT meet (engine: no ComfyUI): a private folder, and sockets on the loopback.

The folder is the pool's own ``tempfile.mkdtemp`` (mode 0700: only this user may enter it). It holds the
``torch.distributed.FileStore`` the ranks meet in (0600), each worker's spec (JSON) and the payload the workers
build their DiT from, which is the one file that is unpickled (``torch.load``): this process wrote it there, and no
other user can write, replace or link anything in the folder. A TCPStore, which listens on every interface and has
no authentication, let any local or remote process hand the workers a pickle to run.

gloo and NCCL open sockets for the process group: ``loopback_sockets`` binds them to the loopback interface.

A process killed with SIGKILL leaves its folder behind; the next pool removes the folders whose owner (named in
the folder's ``owner.json``: pid and start time) is gone, and only those of this user.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil  # ComfyUI's own dependency (its model management imports it)
import torch.distributed as dist

from ..errors import ErnieImageError
from ..model_files import json_object

PREFIX = "ernie-image-parallel-"
OWNER, STORE = "owner.json", "store"
SOCKET_SETTINGS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOOPBACK = "127.0.0.1"


def make_folder() -> Path:
    """A new private folder for a pool, with its owner noted; the stale folders of earlier pools removed first."""
    remove_stale_folders()
    folder = Path(tempfile.mkdtemp(prefix=PREFIX))
    (folder / OWNER).write_text(json.dumps(_owner(os.getpid())))
    check_private(folder)
    return folder


def open_store(folder: Path) -> dist.FileStore:
    """The FileStore in ``folder`` (a private folder, ``check_private``); rank 0 creates it, 0600."""
    path = folder / STORE
    with contextlib.suppress(FileExistsError):
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    check_private(folder, path)
    return dist.FileStore(str(path), -1)  # -1: the store never deletes its file (the pool removes the folder)


def check_private(folder: Path, *files: Path) -> None:
    """Refuse, in words, a ``folder`` that is a link, not this user's or open to others, and ``files`` in it
    that are links, not this user's or that others may write."""
    _check(folder, stat.S_ISDIR, 0o077, "folder")
    for path in files:
        if path.parent != folder:
            raise ErnieImageError(f"ERNIE-Image Parallel: {path} is not inside the pool's folder {folder}.")
        _check(path, stat.S_ISREG, 0o022, "file")


def _check(path: Path, kind, others: int, what: str) -> None:
    info = os.lstat(path)
    if not kind(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & others:
        raise ErnieImageError(
            f"ERNIE-Image Parallel: the pool's {what} {path} must be a {what} of this user (uid {os.getuid()}) "
            f"that others cannot {'enter' if what == 'folder' else 'write'}; it has mode {stat.filemode(info.st_mode)} "
            f"and uid {info.st_uid}. Another process changed it: the workers are not started from it.")


def _owner(pid: int) -> dict:
    return {"pid": pid, "started": psutil.Process(pid).create_time()}


def _owner_alive(owner: dict) -> bool:
    """Whether the process that made a folder runs: its pid, started when it was (not a later process given the
    same pid)."""
    try:
        return abs(_owner(int(owner["pid"]))["started"] - float(owner["started"])) < 1.0
    except psutil.NoSuchProcess:
        return False


def remove_stale_folders() -> list[Path]:
    """Remove this user's pool folders in the temp folder whose owner process is gone; leave those of live
    processes (another ComfyUI's pool), of other users, and those without a readable owner (being made now, or
    from a version before ``owner.json``). The folders removed."""
    removed = []
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            info = os.lstat(folder)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            owner = json_object(folder / OWNER)
            if _owner_alive(owner):
                continue
        except (OSError, ValueError, KeyError, TypeError, psutil.Error):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def loopback_interface() -> str:
    """The name of the interface that holds 127.0.0.1 (``lo`` on Linux, ``lo0`` on macOS)."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address == LOOPBACK for address in addresses):
            return name
    raise ErnieImageError("ERNIE-Image Parallel: this machine has no interface with the address 127.0.0.1 for its "
                          "ranks to meet on; bring up the loopback interface.")


def loopback_environment() -> dict[str, str]:
    """What binds gloo's and NCCL's sockets to the loopback: every rank runs on this machine, so a value the user
    set for other work (another interface) is not used for the pack's ranks."""
    return dict.fromkeys(SOCKET_SETTINGS, loopback_interface())


@contextlib.contextmanager
def loopback_sockets() -> Iterator[None]:
    """While the block runs (rank 0 joining the group: gloo reads the setting when it makes its device, NCCL when
    it first starts), this process's gloo and NCCL sockets bind to the loopback; the environment is then as before."""
    before = {name: os.environ.get(name) for name in SOCKET_SETTINGS}
    os.environ.update(loopback_environment())
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
