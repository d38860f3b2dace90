"""Hosts without a shared network stack, on this one machine: each "host" is a network namespace with its own
address on a bridge, so a worker in it reaches Redis, the artifact store and the other hosts' ranks only over the
network, as on a cluster. (Their filesystems are this machine's; each host's worker is given folders of its own.)
"""

from __future__ import annotations

import subprocess
import uuid
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str | None:
    """Why namespaces cannot be made here, or None where they can."""
    name = f"ftp{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"`ip netns add` failed ({exc}); these tests need root and iproute2"
    _ip("netns", "del", name)
    return None


@dataclass
class Host:
    name: str  # the namespace
    addr: str

    def prefix(self) -> list[str]:
        """What runs a command on this host."""
        return ["ip", "netns", "exec", self.name]


class Network:
    """A bridge on this machine (the "switch", with the address the host's own services listen on) and
    namespaces plugged into it."""

    def __init__(self, subnet: int) -> None:
        self.tag = uuid.uuid4().hex[:5]
        self.net = f"10.{200 + subnet % 50}.{uuid.uuid4().int % 250}"
        self.bridge = f"ftb{self.tag}"
        self.gateway = f"{self.net}.1"
        self.hosts: list[Host] = []
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def host(self) -> Host:
        n = len(self.hosts) + 1
        ns, outside = f"ft{self.tag}h{n}", f"ftv{self.tag}{n}"
        addr = f"{self.net}.{10 + n}"
        _ip("netns", "add", ns)
        self.hosts.append(Host(ns, addr))
        _ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", outside, "master", self.bridge)
        _ip("link", "set", outside, "up")
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return self.hosts[-1]

    def close(self) -> None:
        for h in self.hosts:
            subprocess.run(["ip", "netns", "del", h.name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
