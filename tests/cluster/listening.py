"""Listening TCP sockets of a process tree, read from /proc (Linux): which address and port each
process of a server (and its local Ray) listens on. Used by the exposure test."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

LISTEN_STATE = "0A"


@dataclass(frozen=True)
class Listener:
    host: str
    port: int
    pid: int
    command: str

    @property
    def is_loopback(self) -> bool:
        address = ipaddress.ip_address(self.host)
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
        return (mapped or address).is_loopback


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def process_tree(root_pid: int) -> list[int]:
    """`root_pid` and every descendant alive now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _decode(hex_address: str, is_v6: bool) -> tuple[str, int]:
    host_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(host_hex)
    if is_v6:  # four little-endian 32-bit words
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
        return socket.inet_ntop(socket.AF_INET6, raw), int(port_hex, 16)
    return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port_hex, 16)


def _listening_by_inode() -> dict[int, tuple[str, int]]:
    found = {}
    for name, is_v6 in (("tcp", False), ("tcp6", True)):
        lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            if fields[3] == LISTEN_STATE:
                found[int(fields[9])] = _decode(fields[1], is_v6)
    return found


def listeners(root_pid: int) -> list[Listener]:
    """Every listening TCP socket held by `root_pid` or its descendants."""
    listening = _listening_by_inode()
    found = set()
    for pid in process_tree(root_pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        for inode in _socket_inodes(pid) & listening.keys():
            host, port = listening[inode]
            found.add(Listener(host, port, pid, command.strip()))
    return sorted(found, key=lambda item: (item.port, item.pid))
