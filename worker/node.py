"""The node this worker runs on: what it offers (name, device kind, slots, queues) and its heartbeat.

The worker announces its node in Redis (`ft:node:<name>`, JSON, with a TTL of one lease that a thread
renews every heartbeat) and never touches Postgres: the control plane copies the announcements into its
`nodes` table and places jobs on them (controlplane/scheduler.py). A node whose key expired is lost and receives
nothing. Each announcement also says how much room the filesystem of the node's job folders has left: a node whose
disk is full is placed on no more until an announcement finds room again. The worker consumes only its node's own
Celery queue (`node.<name>`); the queues given with `-Q` are what it announces it serves, so a node joins with the
same command line as before.

A node's name belongs to one worker process at a time: everything downstream (its queue, its slots, the
placements and multi-node hostfiles that name it) takes the name for one worker. The worker claims the name
(`ft:node:<name>:holder`, its own instance id, with the same TTL) before it consumes anything; a second worker
that finds the name held by a live one refuses to start. Only the holder renews the claim and writes the
announcement, both in one script, so a worker that lost its name (frozen past the TTL while another took it)
can never announce over the new holder.
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
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from contract.protocol import NODES_SET, node_holder_key, node_key, node_queue

log = logging.getLogger(__name__)

CPU_SLOTS_DEFAULT = 2  # CPU processes a CPU-only node offers unless FT_NODE_SLOTS says otherwise
# Why not 0: a node with a few KiB left would take an attempt that starts and then fails in its first writes (its
# spec, DeepSpeed config, rank logs) as disk_full, a failure of the job that is the node's fault. Several times what
# an attempt writes before its first checkpoint, and nothing beside a real disk; a job's checkpoints are its own to
# fit (one that fills the disk fails its job as disk_full).
MIN_FREE_BYTES_DEFAULT = 32 * 1024**2


class NodeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FT_NODE_", extra="ignore")

    name: str = Field(default_factory=socket.gethostname, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    slots: int | None = Field(default=None, ge=1, le=1024)  # default: the GPUs it sees, else CPU_SLOTS_DEFAULT
    kind: str | None = Field(default=None, pattern=r"^[a-z0-9_.-]{1,32}$")  # default: from the GPU's name, or cpu
    # Where the other nodes of a multi-node job reach this one (node 0's ranks listen there).
    addr: str = Field(default_factory=lambda: default_addr(), max_length=200)
    # Below this much room on the filesystem of the node's job folders, the node announces its disk full.
    min_free_bytes: int = Field(default=MIN_FREE_BYTES_DEFAULT, ge=0)


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


def disk_state(folder: Path, min_free_bytes: int) -> dict[str, Any]:
    """What the node announces of the filesystem that holds `folder` (its job folders): `disk_free_bytes`, the room an
    unprivileged write still has there, and `disk_full`, whether that is below `min_free_bytes` or no inode is left
    (either way an attempt's first write fails with ENOSPC). One statvfs per heartbeat; unknown (None, not full) where
    it fails, so a disk that cannot be read does not stop the node's work, nor its heartbeat."""
    for where in (folder, *folder.parents):
        try:
            st = os.statvfs(where)
        except FileNotFoundError:
            continue  # made by the node's first job: until then, the filesystem it will be made on
        except OSError as exc:
            log.warning("cannot read the room left on the disk of %s: %s", where, exc)
            break
        free = st.f_bavail * st.f_frsize  # f_bavail, not f_bfree: a worker not running as root cannot use the rest
        no_inodes = st.f_files > 0 and st.f_favail == 0  # f_files 0: a filesystem that does not count inodes
        return {"disk_free_bytes": free, "disk_full": free < min_free_bytes or no_inodes}
    return {"disk_free_bytes": None, "disk_full": False}


def instance_id() -> str:
    """This worker process, told apart from an earlier process that had the same pid (host:pid:random)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


# Take or renew the claim (absent: taken, e.g. after Redis lost its data or a freeze outlived the TTL; ours:
# renewed) and, while announcing, write the announcement in the same step. Returns the holder when another
# process holds the name, nil otherwise. One script, so two workers claiming at once cannot both win.
_BEAT = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return holder end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[2])
  redis.call('SADD', KEYS[3], ARGV[4])
end
return false
"""
# Let go of the claim only if it is still ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class NameTaken(Exception):
    """Another live worker holds the node's name."""

    def __init__(self, name: str, holder: str, ttl: float) -> None:
        self.name, self.holder, self.ttl = name, holder, ttl
        super().__init__(
            f"node name {name!r} is held by a live worker ({holder}): a second worker under the same name would "
            f"share its queue and slots, so this one does not start. Give this worker a name of its own, e.g. "
            f"FT_NODE_NAME={name}-2 make worker (or python -m worker). If that worker is gone (killed), its claim "
            f"lapses {ttl:g} s (FT_LEASE_TTL_SECONDS) after its last heartbeat: start this one again then.")


class Announcer:
    """Holds the node's name for this process (`claim`), then renews its key every heartbeat, with the room left on
    its disk as `disk` reads it at that beat and its warm trainer's state as `warm` does; on shutdown announces it as
    draining (placed on no more) and, once the worker has stopped, lets the name go."""

    def __init__(self, client: redis.Redis, record: dict[str, Any], *, heartbeat: float, ttl: float,
                 on_lost: Callable[[str], None] | None = None,
                 disk: Callable[[], dict[str, Any]] | None = None,
                 warm: Callable[[], dict[str, Any]] | None = None) -> None:
        self.r, self.record, self.heartbeat, self.ttl = client, record, heartbeat, ttl
        self.disk, self.warm = disk, warm
        self.instance = instance_id()
        # Called once, from the heartbeat thread, with the holder's id when another process took the name.
        self.on_lost = on_lost
        self.lost: str | None = None
        self._lost_lock = threading.Lock()  # drain() beats from Celery's thread beside the heartbeat's
        self._announcing = False
        self._released = False
        self._beat = client.register_script(_BEAT)
        self._release = client.register_script(_RELEASE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-heartbeat", daemon=True)

    @property
    def name(self) -> str:
        return str(self.record["name"])

    def claim(self) -> None:
        """Take the name, or raise NameTaken; from here on the heartbeat keeps it (nothing is announced yet).
        Redis errors propagate: the caller decides whether to wait for Redis."""
        holder = self._renew()
        if holder is not None:
            raise NameTaken(self.name, holder, self.ttl)
        self._thread.start()

    def start(self) -> None:
        """Announce the node (after `claim`): from now on the control plane may place jobs on it."""
        self._announcing = True
        self.beat()

    def drain(self) -> None:
        self.record = {**self.record, "draining": True}
        self.beat()

    def beat(self) -> None:
        if self._released:
            return  # a beat now would take the name again
        try:
            holder = self._renew()
        except redis.RedisError as exc:
            log.warning("node heartbeat failed: %s", exc)
            return
        if holder is None:
            return
        with self._lost_lock:
            if self.lost is not None:
                return
            self.lost = holder
        self._stop.set()
        log.error("node name %r was taken by another worker (%s) while this one's claim had lapsed: this "
                  "worker no longer announces the node", self.name, holder)
        if self.on_lost is not None:
            self.on_lost(holder)

    def release(self) -> None:
        """Stop renewing and let the name go, if still ours: a worker restarted under it need not wait a TTL."""
        self._released = True
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.heartbeat + 5)
        try:
            self._release(keys=[node_holder_key(self.name)], args=[self.instance])
        except redis.RedisError as exc:
            log.warning("could not release node name %r (it lapses in %g s): %s", self.name, self.ttl, exc)

    def _renew(self) -> str | None:
        if self.lost is not None:
            return self.lost
        # Read into this beat's copy only: drain() replaces the record from another thread.
        record = json.dumps({**self.record, **(self.disk() if self.disk else {}),
                             **(self.warm() if self.warm else {})}) if self._announcing else ""
        holder = self._beat(keys=[node_holder_key(self.name), node_key(self.name), NODES_SET],
                            args=[self.instance, int(self.ttl * 1000), record, self.name])
        return None if holder is None else holder.decode() if isinstance(holder, bytes) else str(holder)

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

