"""The node this worker runs on: what it offers (name, device kind, slots, queues) and its heartbeat.

The worker announces its node in Redis (`ft:node:<name>`, JSON, with a TTL of one lease that a thread
renews every heartbeat) and never touches Postgres: the control plane copies the announcements into its
`nodes` table and places jobs on them (api/scheduler.py). A node whose key expired is lost and receives
nothing. The worker consumes only its node's own Celery queue (`node.<name>`); the queues given with
`-Q` are what it announces it serves, so a node joins with the same command line as before.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

import redis
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainer.names import NODES_SET, node_key, node_queue

log = logging.getLogger(__name__)

CPU_SLOTS_DEFAULT = 2  # CPU processes a CPU-only node offers unless FT_NODE_SLOTS says otherwise


class NodeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FT_NODE_", extra="ignore")

    name: str = Field(default_factory=socket.gethostname, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    slots: int | None = Field(default=None, ge=1, le=1024)  # default: the GPUs it sees, else CPU_SLOTS_DEFAULT
    kind: str | None = Field(default=None, pattern=r"^[a-z0-9_.-]{1,32}$")  # default: from the GPU's name, or cpu
    # Where the other nodes of a multi-node job reach this one (node 0's ranks listen there).
    addr: str = Field(default_factory=lambda: default_addr(), max_length=200)


def default_addr() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def visible_gpus() -> list[str]:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES where set, else every /dev/nvidiaN (no torch
    import: a worker must start in a second)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    found = [p.name.removeprefix("nvidia") for p in Path("/dev").glob("nvidia[0-9]*")]
    return sorted(found, key=int)


def gpu_kind() -> str:
    """e.g. 'h200' from 'NVIDIA H200'; 'gpu' where nvidia-smi cannot say."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10).stdout.splitlines()
        except (OSError, subprocess.SubprocessError):
            out = []
        words = [w for w in (out[0].lower().split() if out else []) if re.search(r"\d", w)]
        if words:
            return re.sub(r"[^a-z0-9_.-]", "", words[0])[:32] or "gpu"
    return "gpu"


def describe(settings: NodeSettings, queues: list[str], jobs_max: int) -> dict[str, Any]:
    """What the node announces. `devices` are the ids a placement hands out (GPU ids as this node numbers
    them, or 0..slots-1 for CPU processes); `jobs_max` is how many jobs its worker runs at once."""
    gpus = visible_gpus()
    if gpus:
        slots = min(settings.slots or len(gpus), len(gpus))
        devices: list[str] = gpus[:slots]
        kind = settings.kind or gpu_kind()
    else:
        slots = settings.slots or CPU_SLOTS_DEFAULT
        devices = [str(i) for i in range(slots)]
        kind = settings.kind or "cpu"
    return {"name": settings.name, "kind": kind, "slots": slots, "devices": devices, "queues": queues,
            "jobs_max": jobs_max, "worker": f"{socket.gethostname()}:{os.getpid()}", "draining": False,
            "addr": settings.addr}


class Announcer:
    """Renews the node's key every heartbeat; on shutdown announces it as draining (placed on no more)."""

    def __init__(self, client: redis.Redis, record: dict[str, Any], *, heartbeat: float, ttl: float) -> None:
        self.r, self.record, self.heartbeat, self.ttl = client, record, heartbeat, ttl
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-heartbeat", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def drain(self) -> None:
        self.record = {**self.record, "draining": True}
        self.beat()

    def beat(self) -> None:
        try:
            name = self.record["name"]
            (self.r.pipeline(transaction=False).set(node_key(name), json.dumps(self.record), px=int(self.ttl * 1000))
             .sadd(NODES_SET, name).execute())
        except redis.RedisError as exc:
            log.warning("node heartbeat failed: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat):
            self.beat()


def own_queue_only(app_queues: Any, name: str) -> list[str]:
    """Switch the worker's consumption from the queues given with -Q to the node's own queue; returns the
    queues it had, which the node announces as served (the control plane routes their jobs here)."""
    served = sorted(app_queues.consume_from) or ["default"]
    for q in served:
        app_queues.deselect(q)
    app_queues.select_add(node_queue(name))
    return served

