"""The data layer's own errors. db/ never answers HTTP: api/errors.py maps each of these to its response."""

from __future__ import annotations


class DbError(Exception):
    """Anything db/ refuses, with a message for the caller and the request field at fault (or None)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message, self.field = message, field


class NotFound(DbError):
    """No such row, or (for a caller's read) not the caller's owner's: never told apart."""


class Conflict(DbError):
    """The row's state does not allow the change (a cancel of an ended job)."""


class IdempotencyConflict(Conflict):
    """The Idempotency-Key is in use, or was used with another body."""


class FileInUse(Conflict):
    """A job that has not ended names the file as its data."""


class Invalid(DbError):
    """An argument names nothing usable (a page cursor that is no row, an expiry in the past)."""


class Unavailable(DbError):
    """Postgres is unreachable or restarting: retry shortly."""

    def __init__(self, message: str = "the database is unreachable; retry shortly") -> None:
        super().__init__(message)


class QuotaExceeded(DbError):
    """A submit would pass the owner's quota: the limits in effect, the owner's use and what the submit asked for."""

    def __init__(self, owner: str, limits: tuple[int | None, int | None], used: tuple[int, int], gpus: int) -> None:
        super().__init__(f"quota exceeded for owner {owner!r}")
        self.owner, self.limits, self.used, self.gpus = owner, limits, used, gpus


class StoredBytesExceeded(DbError):
    """An upload would pass the owner's quota of stored bytes: the limit, the owner's use and the upload's size
    (None: an upload cut off once it passed the room left, its size unknown)."""

    def __init__(self, owner: str, limit: int, used: int, size: int | None) -> None:
        super().__init__(f"stored-bytes quota exceeded for owner {owner!r}", "max_stored_bytes")
        self.owner, self.limit, self.used, self.size = owner, limit, used, size
