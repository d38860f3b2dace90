"""The control plane's file validator in the database (controlplane/validator.py): lease the oldest unchecked
upload, keep the lease while it is read, and record the verdict. Each runs in the validator's session."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from contract.files import FileStatus
from db import jsonw
from db.engine import run

# The oldest unchecked file nobody holds a lease on, leased for $1 seconds (committed with the session).
CLAIM = f"""
UPDATE files SET claimed_until = now() + make_interval(secs => $1::float8)
WHERE id = (SELECT id FROM files WHERE status = '{FileStatus.UPLOADED.value}'
                AND (claimed_until IS NULL OR claimed_until < now())
            ORDER BY created_at LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, format"""
RENEW = f"""
UPDATE files SET claimed_until = now() + make_interval(secs => $2::float8)
WHERE id = $1 AND status = '{FileStatus.UPLOADED.value}'"""
# A file deleted meanwhile, or already decided, is left as it is.
FINISH = f"""
UPDATE files SET status = $2, format = coalesce(format, $3), stats = $4::jsonb, errors = $5::jsonb,
    claimed_until = NULL, updated_at = now()
WHERE id = $1 AND status = '{FileStatus.UPLOADED.value}'"""


@dataclass(frozen=True)
class Claimed:
    id: str
    format: str | None


def claim(session: Session, *, lease_seconds: float) -> Claimed | None:
    row = run(session, CLAIM, lease_seconds).fetchone()
    return None if row is None else Claimed(row[0], row[1])


def renew(session: Session, *, file_id: str, lease_seconds: float) -> None:
    run(session, RENEW, file_id, lease_seconds)


def finish(session: Session, *, file_id: str, status: FileStatus, fmt: str | None, stats: dict[str, Any] | None,
           errors: list[dict[str, Any]] | None) -> None:
    run(session, FINISH, file_id, status.value, fmt, None if stats is None else jsonw.dumps(stats),
        None if errors is None else jsonw.dumps(errors))
