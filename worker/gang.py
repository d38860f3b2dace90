"""The multi-node (gang) protocol of one attempt, as one node's part plays it.

Every node of a multi-node attempt supervises its own part. Node 0 publishes where the ranks meet and every
part writes the same hostfile (rendezvous); the first part to fail claims the gang's stop key, so the other
parts stop their ranks and leave the job's report to it; a part that ends without reporting marks itself done,
so its lapsing lease does not read as a lost node; and a part whose ranks failed first checks whether a peer
was lost, which is the control plane's to requeue, not a failure of the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import redis

from contract.protocol import gang_stop_key, gang_term_key, lease_key, part_done_key, rendezvous_key
from contract.spec import NodeShare
from worker.lease import KEEP_SECONDS, Lease
from worker.process import GangLaunch, free_port
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def hostfile_text(parts: list[tuple[str, int]]) -> str:
    """`name slots=N` per node, in node-rank order. Names are labels only: with --no_ssh nothing resolves them."""
    return "".join(f"{name} slots={slots}\n" for name, slots in parts)


class GangPart:
    """This node's part (node rank `part` of `parts`) of an attempt; a single-node attempt is a gang of one."""

    def __init__(self, *, client: redis.Redis, job_id: str, attempt: int, part: int, parts: int, node: str,
                 lease: Lease, settings: WorkerSettings) -> None:
        self.r, self.job_id, self.attempt = client, job_id, attempt
        self.part, self.parts = part, parts
        self.lease, self.settings = lease, settings
        self.stop_key = gang_stop_key(job_id, attempt)
        # What this part writes in the gang's stop key when its failure stops the others; None until it tried.
        self.stop_mark = f"{node or 'node'}#{part}"
        self.failure_claimed: bool | None = None

    @property
    def multi(self) -> bool:
        return self.parts > 1

    def stopped_by_another(self, stop_value: bytes | None) -> bool:
        """Whether the stop key's value (as read) says another node's part failed: this one's ranks cannot go on
        alone."""
        return stop_value is not None and self.multi and stop_value.decode() != self.stop_mark

    def rendezvous(self, share: NodeShare, hostfile: Path, stopped: Callable[[], bool]) -> GangLaunch | None:
        """Node 0 picks its port and publishes it; the other nodes wait for it (watching `stopped`, cancel and
        the attempt key, meanwhile). None: the attempt was stopped while waiting."""
        key = rendezvous_key(self.job_id, self.attempt)
        if self.part == 0:
            where = f"{share.master_addr}:{share.master_port or free_port()}"
            self.r.set(key, where, ex=KEEP_SECONDS)
        else:
            where = ""
            while not where:
                self.lease.renew(self.settings.lease_ttl_seconds)
                if stopped():
                    return None
                raw = self.r.get(key)
                where = raw.decode() if raw else ""
                if not where:
                    time.sleep(self.settings.poll_seconds)
        addr, port = where.rsplit(":", 1)
        parts = share.gang
        hostfile.write_text(hostfile_text([(p.node, len(p.devices)) for p in parts]))
        include = "" if share.kind == "cpu" else "@".join(f"{p.node}:{','.join(p.devices)}" for p in parts)
        return GangLaunch(hostfile, self.part, addr, int(port), include)

    def claim_failure(self) -> bool:
        """Whether this part owns the multi-node attempt's failure. The first part to fail sets the gang's stop
        key (every other part then stops its ranks) and reports the job's error; a part whose ranks failed
        after it, on the connections the first one's dead ranks broke, only followed it and reports nothing.
        Claimed as early as the part knows it failed: when a rank reports an error, before its ranks exit."""
        if self.failure_claimed is None:
            try:
                self.failure_claimed = bool(self.r.set(self.stop_key, self.stop_mark, nx=True, ex=KEEP_SECONDS))
            except redis.RedisError as exc:
                # Unknown: report the failure (should two parts report, the job takes the first).
                log.warning("could not claim the gang's failure: %s", exc)
                return True
        return self.failure_claimed

    def stop_others(self) -> None:
        """One state for the gang: every other node's part stops its ranks now (a failure claimed the key
        already, in claim_failure)."""
        try:
            self.r.set(self.stop_key, self.stop_mark, ex=KEEP_SECONDS)
        except redis.RedisError as exc:
            log.warning("could not stop the other parts (their guards end them when the attempt moves on): %s", exc)

    def say_term(self, why: str) -> None:
        """Before this part sends its ranks SIGTERM: why, for the parts whose ranks stop with them (`term_why`); a
        single-node attempt has no such parts."""
        if not self.multi:
            return
        try:
            self.r.set(gang_term_key(self.job_id, self.attempt), why, ex=KEEP_SECONDS)
        except redis.RedisError as exc:
            log.warning("could not say why the gang stops (the other parts report their ranks' stop): %s", exc)

    def term_why(self) -> str | None:
        """Why another part sent its ranks SIGTERM, when this part's ranks stopped with them; None: no part said."""
        try:
            raw = self.r.get(gang_term_key(self.job_id, self.attempt))
        except redis.RedisError:
            return None
        return raw.decode() if raw is not None else None

    def part_over(self) -> None:
        """This part ended and leaves the job's report to another part: its lease may lapse without the part
        counting as a lost node (to the control plane, or to the part that reports the gang's failure)."""
        try:
            self.r.set(part_done_key(self.job_id, self.attempt, self.part), "1", ex=KEEP_SECONDS)
        except redis.RedisError as exc:
            log.warning("could not mark part %d over (its lease stays until the report window): %s", self.part, exc)

    def peer_lost(self) -> bool:
        """Whether another node of this multi-node attempt is gone (its lease lapsed, its part not done). Its
        ranks' death makes this node's ranks fail too; that is a lost node, which the control plane requeues
        as one new attempt, not a failure of the job. A dead peer's lease lapses within one TTL: wait that."""
        peers = [p for p in range(self.parts) if p != self.part]
        end = time.monotonic() + self.settings.lease_ttl_seconds + 1.0
        while True:
            self.lease.renew(self.settings.lease_ttl_seconds)  # this part is alive while it looks at the others
            try:
                pipe = self.r.pipeline(transaction=False)
                for p in peers:
                    pipe.exists(lease_key(self.job_id, self.attempt, p), part_done_key(self.job_id, self.attempt, p))
                if not all(pipe.execute()):
                    return True
            except redis.RedisError:
                pass
            if time.monotonic() > end:
                return False
            time.sleep(0.5)
