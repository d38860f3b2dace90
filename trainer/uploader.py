"""Every committed checkpoint in the artifact store, uploaded beside training and committed by a manifest.

After a local save (every rank wrote its files; barrier) the first process of each node uploads the files its
node's ranks wrote to `jobs/<job id>/checkpoints/.attempt-N/step-K/<path>` from a thread of its own, so the next
training step does not wait; the bytes move in a child process kept for the trainer's life, `python -m store.push`
(why: its docstring). Every node but the first then writes its part list `…/parts/node-R.json`. Rank 0's thread
(node 0's uploader) waits for the other nodes' part lists, checks the job's fence in the store (an attempt that was
superseded commits nothing), writes the manifest `jobs/<job id>/checkpoints/step-K.attempt-N.json` and only then
emits the `checkpoint` event, with what the save cost (`waited_s` for the previous upload, `save_s` for the local
save) and how long the upload and commit took (`upload_s`). A failing store delays the commit (retried with backoff
until the job ends) and never fails a step; at most one checkpoint is in flight, so the next save first waits for
the previous upload.

Which node owns a file: the lowest node rank that sees it in its staging folder. On a disk all nodes share
(one host) node 0 sees every file and uploads them all; on hosts of their own each node sees only what its
ranks wrote.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
from obstore.exceptions import BaseError

from contract.codes import EventKind
from contract.spec import RunSpec
from store import checkpoints as stored
from store import layout, push
from store.objects import Store, error_line
from trainer import fence
from trainer.events import emit

T = TypeVar("T")
# How long the trainer waits for a pending commit before it exits: after its last step (the export ran beside
# the upload), and after a SIGTERM, when the worker kills it once its grace (30 s by default) is over.
FINAL_WAIT_SECONDS = 600.0
STOP_WAIT_SECONDS = 20.0
PUSH_TRIES = 3  # upload processes one checkpoint may use up: one that keeps dying will not be helped by more


@dataclass(frozen=True)
class Pending:
    tag: str
    step: int
    state: dict[str, Any]
    source: Path  # the folder this node's files are read from
    files: list[str]  # paths relative to `source` this node uploads
    keep_last: int
    local_tag_dir: str  # what the `checkpoint` event names as its path, as the local commit did
    timing: dict[str, float] = field(default_factory=dict)  # the save's own, for the `checkpoint` event


class Uploads:
    """One attempt's uploads, in every rank (only each node's first process runs a thread)."""

    def __init__(self, store: Store, job_id: str, attempt: int, *, rank: int, local_rank: int, node_rank: int,
                 num_nodes: int) -> None:
        self.store, self.job_id, self.attempt = store, job_id, attempt
        self.rank, self.local_rank, self.node_rank, self.num_nodes = rank, local_rank, node_rank, num_nodes
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._failing = threading.Event()  # the store's last call failed (set until one succeeds)
        self._lock = threading.Lock()
        self._child: subprocess.Popen[str] | None = None  # `store.push`, kept from the first upload to `finish`

    @classmethod
    def for_run(cls, run_spec: RunSpec, rank: int) -> Uploads | None:
        ref = run_spec.paths.store
        if ref is None:
            return None  # run by hand: checkpoints stay on this disk, committed there as before
        placement = run_spec.placement
        return cls(Store(ref.config), ref.job_id, run_spec.attempt, rank=rank,
                   local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                   node_rank=placement.node_rank if placement else 0,
                   num_nodes=placement.num_nodes if placement else 1)

    @property
    def uploader(self) -> bool:
        return self.local_rank == 0

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait_previous(self) -> None:
        """At most one checkpoint in flight: the next save waits for the previous upload and commit."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def claim(self, staged: Path) -> list[str]:
        """Collective: the files of `staged` this node uploads (see the module's docstring); [] for all but
        each node's first process."""
        seen = _listing(staged) if self.uploader else None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            views: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(views, (self.node_rank, seen))
        else:
            views = [(self.node_rank, seen)]
        if not self.uploader:
            return []
        owner: dict[str, int] = {}
        for node, listing in views:
            for rel in listing or []:
                owner[rel] = min(owner.get(rel, node), node)
        return sorted(rel for rel, node in owner.items() if node == self.node_rank)

    def start(self, pending: Pending) -> None:
        if not self.uploader:
            return
        self._thread = threading.Thread(target=self._run, args=(pending,), name=f"upload-{pending.tag}",
                                        daemon=True)
        self._thread.start()

    def finish(self, timeout: float) -> bool:
        """Before the process exits: the pending commit, waited for at most `timeout` seconds. True when nothing
        is left pending; otherwise that checkpoint is simply not committed."""
        if self._thread is None:
            self._end_pusher(kill=False)
            return True
        end = time.monotonic() + timeout
        # A store that is failing now gets no more of the job's time: this checkpoint only matters to a resume,
        # and the job's end (its export, which the worker retries on its own) must not wait out an outage.
        while self._thread.is_alive() and time.monotonic() < end and not self._failing.is_set():
            self._thread.join(min(1.0, max(0.0, end - time.monotonic())))
        if self._thread.is_alive():
            self._stop.set()
            self._end_pusher(kill=True)
            why = "the store is failing" if self._failing.is_set() else f"it did not finish within {timeout:.0f} s"
            _say(f"the upload of a checkpoint was given up at the trainer's end ({why}); it is not committed")
            return False
        self._end_pusher(kill=False)
        return True

    # -- the thread ------------------------------------------------------------------------------------------
    def _run(self, pending: Pending) -> None:
        started = time.monotonic()
        try:
            files = self._upload(pending)
            if self.rank == 0:
                self._commit(pending, files, started)
        except _Stopped:
            pass
        except fence.Superseded as exc:
            _say(str(exc))
        except Exception:  # noqa: BLE001  # a checkpoint left uncommitted must never fail training
            _say(f"checkpoint {pending.tag} was not committed to the store:\n{traceback.format_exc()}")

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        """`call` until it succeeds: the store client already retried for minutes; this waits out longer
        outages for as long as the job lives."""
        tries = 0
        while True:
            if self._stop.is_set():
                raise _Stopped
            try:
                done = call()
                self._failing.clear()
                return done
            except (OSError, BaseError) as exc:  # a bucket that is not there (yet) is retried too
                self._failing.set()
                tries += 1
                if tries == 1 or tries % 10 == 0:
                    _say(f"store: {what} failed ({error_line(exc)}); retrying")
                stored.sleep_backoff(tries, self._stop)

    def _upload(self, p: Pending) -> list[stored.ManifestFile]:
        prefix = layout.checkpoint_staging_prefix(self.job_id, self.attempt, p.tag)
        files = self._push(prefix, p) if p.files else []
        if self.node_rank == 0:
            return files  # this thread is rank 0's, which commits: its own list needs no trip through the store
        part = json.dumps({"node_rank": self.node_rank, "files": [asdict(f) for f in files]}).encode()
        key = layout.checkpoint_part_key(self.job_id, self.attempt, p.tag, self.node_rank)
        self._retry("writing the part list", lambda: self.store.put_bytes(key, part))
        if p.files:
            # A host of its own: the store holds this node's files now, and only node 0's disk commits locally.
            shutil.rmtree(p.source, ignore_errors=True)
        return files

    def _push(self, prefix: str, p: Pending) -> list[stored.ManifestFile]:
        """This node's files, uploaded by `python -m store.push`, out of the training process's interpreter (why:
        store/push.py). Its reports keep `_failing` current; `finish` ends it. A process that dies mid-request
        (the OOM killer, an operator) is replaced and the request sent again, a few times."""
        for tries in range(1, PUSH_TRIES + 1):
            child = self._pusher()
            files, code = self._request(child, prefix, p)
            if self._stop.is_set():
                raise _Stopped
            if code == push.FILE_GONE:
                # Removed under us (the local keep_last never reaches the newest tag): waiting cannot bring it back.
                raise FileNotFoundError(f"a file of {p.source} is gone before it was uploaded")
            if code == push.DONE and len(files) == len(p.files):
                return files
            status = self._drop(child)
            _say(f"the upload process ended (exit status {status}) after {len(files)} of {len(p.files)} files of "
                 f"{p.tag}" + ("; starting another" if tries < PUSH_TRIES else ""))
            stored.sleep_backoff(tries, self._stop)
        raise RuntimeError(f"the upload process ended {PUSH_TRIES} times before {p.tag} was uploaded")

    def _request(self, child: subprocess.Popen[str], prefix: str,
                 p: Pending) -> tuple[list[stored.ManifestFile], int | None]:
        """One request to `child`: the files it stored and its `done` code (None: it ended without one)."""
        assert child.stdin is not None and child.stdout is not None
        files: list[stored.ManifestFile] = []
        failures = 0
        try:
            child.stdin.write(json.dumps({"prefix": prefix, "source": str(p.source), "files": p.files}) + "\n")
            child.stdin.flush()
            for line in child.stdout:
                row = json.loads(line)
                if "done" in row:
                    return files, int(row["done"])
                if "failing" in row:
                    self._failing.set()
                    failures += 1
                    if failures == 1 or failures % 10 == 0:
                        _say(f"store: uploading a file of {p.tag} failed ({row['failing']}); retrying")
                    continue
                self._failing.clear()
                files.append(stored.ManifestFile.from_json(row))
        except OSError:
            pass  # it was ended (by `finish`) or died
        return files, None

    def _drop(self, child: subprocess.Popen[str]) -> int:
        """Forget an upload process that ended (or would not answer); its exit status."""
        with self._lock:
            if self._child is child:
                self._child = None
        return _reap(child)

    def _pusher(self) -> subprocess.Popen[str]:
        """The upload process, started at the first upload and kept for the next ones (started again if it died)."""
        with self._lock:
            if self._stop.is_set():
                raise _Stopped
            if self._child is None or self._child.poll() is not None:
                self._child = push.start(self.store)
            return self._child

    def _end_pusher(self, *, kill: bool) -> None:
        with self._lock:
            child, self._child = self._child, None
        if child is None:
            return
        if kill:
            child.kill()
        elif child.stdin is not None:
            child.stdin.close()  # its end of the protocol: it exits at once
        _reap(child)

    def _commit(self, p: Pending, own: list[stored.ManifestFile], started: float) -> None:
        files = list(own)
        if self.num_nodes > 1:
            files += self._other_nodes_files(p)
        self._retry("reading the fence",
                    lambda: fence.check_store(self.store, self.job_id, self.attempt, f"checkpoint {p.tag}"))
        key = layout.checkpoint_manifest_key(self.job_id, p.tag, self.attempt)
        manifest = stored.Manifest(key, p.step, self.attempt, p.tag, stored.now(), files, p.state)
        # Superseded between the check and this write, the manifest lands past this attempt's cut: readers
        # never trust it (store/checkpoints.py).
        self._retry("writing the manifest", lambda: stored.commit(self.store, manifest))
        removed = self._retry("pruning old checkpoints", lambda: self._prune(manifest, p.keep_last))
        # The same shape as the local commit's event; `removed` names old checkpoints as their events did.
        parent = Path(p.local_tag_dir).parent
        emit(EventKind.CHECKPOINT, step=p.step, path=p.local_tag_dir, committed=True, key=key,
             bytes=manifest.bytes, files=len(files), removed=[str(parent / m.tag) for m in removed], **p.timing,
             upload_s=round(time.monotonic() - started, 3))

    def _other_nodes_files(self, p: Pending) -> list[stored.ManifestFile]:
        """Waits for the part list of every node but this one, then reads them."""
        parts_prefix = layout.checkpoint_part_key(self.job_id, self.attempt, p.tag, 0).rsplit("/", 1)[0] + "/"
        tries = 0
        while True:
            listed = self._retry("listing the part lists", lambda: self.store.list(parts_prefix))
            if len(listed) >= self.num_nodes - 1:
                break
            tries += 1
            stored.sleep_backoff(min(tries, 3), self._stop)  # another node still uploading: poll every few s
            if self._stop.is_set():
                raise _Stopped
        files: list[stored.ManifestFile] = []
        for item in sorted(listed, key=lambda i: i.key):
            body = json.loads(self._retry("reading a part list", lambda k=item.key: self.store.get_bytes(k)))
            files += [stored.ManifestFile.from_json(f) for f in body["files"]]
        return files

    def _prune(self, newest: stored.Manifest, keep_last: int) -> list[stored.Manifest]:
        """Keep the `keep_last` newest manifests and the objects they name; delete the rest: older manifests
        (first, so none is left naming deleted objects), then objects no kept manifest names, of this attempt
        or an older one, at an earlier step than the one just committed (never another node's next upload)."""
        manifests, _ = stored.read_all(self.store, self.job_id)
        kept, old = manifests[:keep_last], manifests[keep_last:]
        if newest.key not in {m.key for m in kept}:
            return []  # a newer attempt committed meanwhile: its own commit prunes
        self.store.delete_many([m.key for m in old])
        named = {f.key for m in kept for f in m.files}
        doomed = []
        for item in self.store.list(layout.checkpoints_prefix(self.job_id)):
            where = _staged_at(self.job_id, item.key)
            if where is None or item.key in named:
                continue
            attempt, step = where
            if attempt <= self.attempt and step < newest.step:
                doomed.append(item.key)
        self.store.delete_many(doomed)
        return old


class _Stopped(Exception):
    """The process is exiting: the pending checkpoint stays uncommitted."""


def _reap(child: subprocess.Popen[str]) -> int:
    """The exit status of an upload process that was ended or is ending; killed if it takes longer than 5 s."""
    try:
        return child.wait(timeout=5)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def _staged_at(job_id: str, key: str) -> tuple[int, int] | None:
    """(attempt, step) of a staged object's key, None for anything else."""
    rest = key.removeprefix(layout.checkpoints_prefix(job_id))
    parts = rest.split("/")
    if len(parts) < 3 or not parts[0].startswith(".attempt-") or not parts[1].startswith("step-"):
        return None
    try:
        return int(parts[0].removeprefix(".attempt-")), int(parts[1].removeprefix("step-"))
    except ValueError:
        return None


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []



def _say(line: str) -> None:
    # stderr: the rank's log, which the worker turns into log lines; stdout is the event stream.
    print(f"[uploader] {line}", file=sys.stderr, flush=True)
