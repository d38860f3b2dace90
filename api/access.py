"""Who is calling: API keys, their scopes, and the in-process cache that keeps a key check off the database.

A key is `ftk_` and 43 characters of URL-safe base64 (32 random bytes). The prefix makes a leaked key
recognisable (secret scanners, logs); the rest is the secret. Postgres stores only its SHA-256.

Why SHA-256 and not a slow password hash (bcrypt, scrypt, argon2): those exist to make guessing a
low-entropy password from its hash expensive. A key has 256 random bits; nobody can guess it from
its hash at any speed, so a slow hash would only cost every cache miss tens of milliseconds of CPU.

A request must not cost a database round trip for its key: each API process keeps hash -> principal
(owner, scopes, key id, expiry) for `FT_KEY_CACHE_SECONDS`. A revoked or changed key is announced by a
trigger on `ft_keys` (migration 0004), and every process drops it at once; the revoking process drops it
itself before it answers. If the listening connection was down, every cached key is dropped when it
comes back (what was announced meanwhile reached nobody), and the TTL bounds what a lost notification
can cost. Expiry is checked on every request against the cached time, so a cache never extends a key.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import Enum
from typing import Any

from api.settings import get_settings
from db import keys as store
from db import pool as pg

log = logging.getLogger(__name__)

KEY_PREFIX = "ftk_"
KEY_LENGTH = len(KEY_PREFIX) + 43
SHOWN_PREFIX = 12  # "ftk_" and 8 characters of the secret: enough to tell keys apart in a list, useless to guess
NOTIFY_CHANNEL = "ft_keys"
TOUCH_SECONDS = 60.0  # last_used_at is written at most this often per key and process
CACHE_MAX = 10_000  # entries; beyond it the oldest go (a flood of made-up keys must not grow memory)


class Scope(str, Enum):
    JOBS_READ = "jobs:read"  # list, read, events, logs
    JOBS_WRITE = "jobs:write"  # submit, cancel; implies jobs:read
    ADMIN = "admin"  # everything, every owner, keys, quotas, the audit log


IMPLIED: dict[str, frozenset[str]] = {
    Scope.ADMIN.value: frozenset(s.value for s in Scope),
    Scope.JOBS_WRITE.value: frozenset({Scope.JOBS_WRITE.value, Scope.JOBS_READ.value}),
    Scope.JOBS_READ.value: frozenset({Scope.JOBS_READ.value}),
}


@dataclass(frozen=True, slots=True)
class Principal:
    key_id: str | None  # None: the development-only anonymous caller
    owner: str
    scopes: frozenset[str]  # as granted
    expires_at: float | None  # Unix time
    granted: frozenset[str]  # with what each scope implies

    @property
    def admin(self) -> bool:
        return Scope.ADMIN.value in self.granted

    def allows(self, scope: str) -> bool:
        return scope in self.granted

    def actor(self) -> dict[str, str | None]:
        """How an event or the audit log names who did it."""
        return {"key_id": self.key_id, "owner": self.owner}


def principal(key_id: str | None, owner: str, scopes: Iterable[str], expires_at: datetime | None) -> Principal:
    given = frozenset(scopes)
    granted = frozenset().union(*(IMPLIED.get(s, frozenset()) for s in given))
    return Principal(key_id, owner, given, expires_at.timestamp() if expires_at else None, granted)


ANONYMOUS = principal(None, "default", [Scope.ADMIN.value], None)


def new_key() -> str:
    return KEY_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode()


def digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def looks_like_a_key(key: bytes) -> bool:
    """Cheap shape check: a header that cannot be a key costs no hashing and no database look-up."""
    return len(key) == KEY_LENGTH and key.startswith(KEY_PREFIX.encode())


async def create_key(*, owner: str, scopes: list[str], name: str = "", expires_at: datetime | None = None,
                     actor: dict[str, str | None] | None) -> tuple[dict[str, Any], str]:
    """A new key (the Key schema's fields) and its secret, which exists only in the return value (and the
    caller's answer); Postgres keeps its hash. `actor` None is the operator's CLI."""
    secret = new_key()
    key = await store.create(owner=owner, scopes=scopes, name=name, expires_at=expires_at, actor=actor,
                             secret_hash=digest(secret.encode()), prefix=secret[:SHOWN_PREFIX])
    return key, secret


class KeyCache:
    """hash -> (when read, principal or None for an unknown or revoked key), bounded, per process."""

    def __init__(self) -> None:
        self.entries: dict[bytes, tuple[float, Principal | None]] = {}
        self.pending: dict[bytes, asyncio.Task[Principal | None]] = {}
        # Bumped by every invalidation: a look-up that started before one does not store what it read,
        # which may be the row as it was before the revocation.
        self.generation = 0
        self.touched: dict[str, float] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.subscribed = False

    def forget(self, hashed: bytes | None = None) -> None:
        """Drop one key (or all): the next request with it reads the database again."""
        self.generation += 1
        if hashed is None:
            self.entries.clear()
        else:
            self.entries.pop(hashed, None)

    def on_notify(self, payload: str) -> None:
        try:
            self.forget(bytes.fromhex(payload))
        except ValueError:
            self.forget()

    def _subscribe(self) -> None:
        # Lazily, from the first request: pg.subscribe needs the running event loop.
        self.subscribed = True
        pg.subscribe(NOTIFY_CHANNEL, self.on_notify, on_connect=self.forget)

    async def lookup(self, key: bytes) -> Principal | None:
        """The key's principal, or None for a key that is unknown, revoked or expired."""
        if not self.subscribed:
            self._subscribe()
        hashed = digest(key)
        now = time.monotonic()
        hit = self.entries.get(hashed)
        if hit is not None and now - hit[0] < get_settings().key_cache_seconds:
            found = hit[1]
        else:
            found = await self._read(hashed)
        if found is None or (found.expires_at is not None and time.time() >= found.expires_at):
            return None
        if found.key_id is not None and now - self.touched.get(found.key_id, -TOUCH_SECONDS) >= TOUCH_SECONDS:
            self.touched[found.key_id] = now
            task = asyncio.get_running_loop().create_task(self._touch(found.key_id))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return found

    async def _read(self, hashed: bytes) -> Principal | None:
        # Concurrent requests with the same uncached key share one query. It runs as a task of its own, so a
        # request that is cancelled (its client left) cancels nobody else's look-up.
        task = self.pending.get(hashed)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._fetch(hashed))
            self.pending[hashed] = task
            task.add_done_callback(lambda done: self._settled(hashed, done))
        return await asyncio.shield(task)

    def _settled(self, hashed: bytes, task: asyncio.Task[Principal | None]) -> None:
        self.pending.pop(hashed, None)
        if not task.cancelled():
            task.exception()  # retrieved: a failure every waiter left before seeing is not an unhandled one

    async def _fetch(self, hashed: bytes) -> Principal | None:
        generation = self.generation
        r = await store.lookup(hashed)
        found = None
        # The index found the row by its hash; the comparison in constant time is the rule for secrets, kept
        # although what it compares is a hash the caller cannot choose.
        if r is not None and hmac.compare_digest(bytes(r["secret_hash"]), hashed):
            found = principal(r["id"], r["owner"], r["scopes"], r["expires_at"])
        if generation == self.generation:
            if len(self.entries) >= CACHE_MAX:
                del self.entries[next(iter(self.entries))]
            self.entries[hashed] = (time.monotonic(), found)
        return found

    async def _touch(self, key_id: str) -> None:
        try:
            await store.touch(key_id)
        except Exception as exc:  # last_used_at is a hint; a request never fails for it
            log.warning("could not record the use of key %s: %s", key_id, type(exc).__name__)


CACHE = KeyCache()
