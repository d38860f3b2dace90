"""Moves events from the Redis stream into Postgres: job state, progress, checkpoints, durable log.

Reads through a consumer group and acknowledges only after the Postgres commit, so a crash or an
outage re-reads what was not stored: after any failure the ingester reads its own pending entries
again (from "0") before anything new. Each entry's stream id is unique in Postgres, so a re-read
is never stored twice. Events of an attempt that is no longer current are dropped (fencing); events
of the current attempt that arrive after the job ended are kept in the log, but the job's final
state and its row no longer change.
"""

from __future__ import annotations

import json
import logging

import redis
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from contract.codes import EventKind
from contract.protocol import EVENTS_STREAM, INGEST_GROUP
from db.engine import session_scope
from db.ingest import store

log = logging.getLogger(__name__)

def first_line(exc: BaseException) -> str:
    """The error without the statement and parameters a driver's message repeats on its next lines."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def transient(exc: BaseException) -> bool:
    """An error of the connection (Postgres or Redis away), not of the data: retrying the same batch helps."""
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OperationalError, InterfaceError, OSError)):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


class Ingester:
    def __init__(self, client: redis.Redis, *, consumer: str = "ingester", batch: int = 500) -> None:
        self.r = client
        self.consumer = consumer
        self.batch = batch
        # Whether this consumer's pending list was read to its end since the last failure. Until then
        # every read is from "0": entries read but not acknowledged come first, in stream order.
        self._pending_done = False
        # True only after a read of new entries that found fewer than a batch: the stream is read up to
        # now. The reaper waits for it, since a terminal state still in the stream is not a lost worker.
        self.caught_up = False
        # The stream ids the last step stored (each id's first part is when Redis took the event): ingest lag.
        self.last_stored: list[str] = []

    def ensure_group(self) -> None:
        try:
            # From "0", not "$": after Redis lost its data, workers may have written to the new stream
            # before the group existed again, and those entries are to be ingested too.
            self.r.xgroup_create(EVENTS_STREAM, INGEST_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def restart(self) -> None:
        """Read from this consumer's pending entries again, as after a failure."""
        self._pending_done = False
        self.caught_up = False

    def _read(self, block_ms: int) -> list[tuple[str, dict[str, str]]]:
        start = ">" if self._pending_done else "0"
        try:
            reply = self.r.xreadgroup(INGEST_GROUP, self.consumer, {EVENTS_STREAM: start}, count=self.batch,
                                      block=None if start == "0" else block_ms)
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            log.warning("the consumer group %s of %s is gone (Redis lost its data?); creating it again",
                        INGEST_GROUP, EVENTS_STREAM)
            self.ensure_group()
            self.restart()
            return []
        entries = [(eid.decode(), {k.decode(): v.decode("utf-8", "replace") for k, v in (fields or {}).items()})
                   for _, msgs in reply or [] for eid, fields in msgs]
        if start == "0" and not entries:
            self._pending_done = True
        self.caught_up = start == ">" and len(entries) < self.batch
        return entries

    def step(self, block_ms: int = 500) -> int:
        """Ingest one batch; returns how many entries it read (0 when caught up or only starting over)."""
        self.caught_up = False
        self.last_stored = []
        entries = self._read(block_ms)
        if not entries:
            return 0
        try:
            self._store(entries)
            ids = [eid for eid, _ in entries]
            self.r.xack(EVENTS_STREAM, INGEST_GROUP, *ids)
            # Acknowledged entries are in Postgres: drop them so the live stream holds only what is in flight.
            self.r.xdel(EVENTS_STREAM, *ids)
            self.last_stored = ids
        except BaseException:
            # Stored or not, these entries are still pending (nothing was acknowledged): read them again,
            # before anything newer, once Postgres and Redis answer. A ">" read would never return them.
            self.restart()
            raise
        return len(entries)

    def _store(self, entries: list[tuple[str, dict[str, str]]]) -> None:
        try:
            with session_scope() as session:
                store(session, entries)
            return
        except Exception as exc:
            if transient(exc):
                raise
            log.warning("a batch of %d events could not be stored (%s); storing them one by one",
                        len(entries), first_line(exc))
        # Something in the batch itself fails: find it, so the others are stored and it cannot stall ingestion.
        for eid, fields in entries:
            try:
                with session_scope() as session:
                    store(session, [(eid, fields)])
                continue
            except Exception as exc:
                if transient(exc):
                    raise
                error = first_line(exc)[:500]
            log.error("event %s of job %s cannot be stored as it came (%s); storing what can be kept of it",
                      eid, fields.get("job_id"), error)
            kept = {**fields, "type": EventKind.UNREADABLE,
                    "data": json.dumps({"type": fields.get("type"), "raw": (fields.get("data") or "")[:20000],
                                        "error": error})}
            try:
                with session_scope() as session:
                    store(session, [(eid, kept)])
            except Exception as exc:
                if transient(exc):
                    raise
                # Not even the text can be stored (the job row itself is refused): keep ingesting the others.
                log.error("event %s is dropped (%s): %s", eid, first_line(exc), kept["data"][:2000])
