"""The JSON of recently read jobs, per API process, dropped the moment Postgres says the row changed.

Dashboards poll `GET /jobs/{id}` for the same few jobs all day; each poll used to cost a query whose
answer had not changed. Migration 0008's trigger notifies `ft_jobs` with the id of every job row a
statement changed, at its commit; this process's one LISTEN connection (db.pool) drops that entry.

Before a hit is served, the process makes sure it has been told of every change committed before the
request came (pg.caught_up: one round trip on the listening connection, shared by the requests that arrive
together), so a reader never sees an older row than one it could have read from Postgres itself.
Correctness rests on the notifications alone, so the cache is used only while they flow: while the
listener is down every read goes to Postgres, and each (re)connection empties the cache (what changed
while nobody listened was notified to no one). A read that started before an invalidation does not
store what it read (it may be the row as it was before), which the generation counter decides.
Entries also age out after MAX_AGE_SECONDS, a bound on a notification lost on a connection that
looked alive until its next ping.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from db import pool as pg

CHANNEL = "ft_jobs"
MAX_AGE_SECONDS = 30.0


class JobCache:
    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[str, tuple[float, str, bytes]] = OrderedDict()  # id -> (read at, owner, json)
        self.generation = 0
        self.subscribed = False

    def forget(self, job_id: str | None = None) -> None:
        self.generation += 1
        if job_id is None:
            self.entries.clear()
        else:
            self.entries.pop(job_id, None)

    async def get(self, job_id: str, owner: str | None,
                  read: Callable[[str], Awaitable[tuple[str, bytes] | None]]) -> bytes | None:
        """The job's JSON for `owner` (None: any owner), from the cache or `read(job_id)` -> (owner, json)."""
        if self.size <= 0:
            found = await read(job_id)
            return _visible(found, owner)
        if not self.subscribed:
            # Lazily, from the first request: pg.subscribe needs the running event loop.
            self.subscribed = True
            pg.subscribe(CHANNEL, self.forget, on_connect=self.forget)
        if not pg.listening(CHANNEL):
            self.entries.clear()
            return _visible(await read(job_id), owner)
        now = time.monotonic()
        if job_id in self.entries and await pg.caught_up():
            # Every change committed before this request has been notified by now, and dropped its entry:
            # what is left is what the row is (a client that changed it through another process, or straight
            # in the database, reads its own write).
            hit = self.entries.get(job_id)
            if hit is not None and now - hit[0] < MAX_AGE_SECONDS:
                self.entries.move_to_end(job_id)
                return hit[2] if owner is None or owner == hit[1] else None
        generation = self.generation
        found = await read(job_id)
        if found is not None and generation == self.generation and pg.listening(CHANNEL):
            self.entries[job_id] = (now, found[0], found[1])
            self.entries.move_to_end(job_id)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return _visible(found, owner)


def _visible(found: tuple[str, bytes] | None, owner: str | None) -> bytes | None:
    if found is None or (owner is not None and owner != found[0]):
        return None
    return found[1]
