"""The audit log: who submitted, cancelled, created or revoked what. Each entry is written in the transaction of
the change it records, so there is no change without its entry and no entry without its change."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from api.access import Principal
from db.models import AuditEntry


def record(session: Session, actor: Principal | None, action: str, subject: str, data: dict[str, Any]) -> None:
    """Add an entry to the session's transaction; `actor` None is the operator's CLI."""
    session.add(AuditEntry(key_id=actor.key_id if actor else None, owner=actor.owner if actor else None,
                           action=action, subject=subject, data=data))


def page(*, session: Session, after: int, limit: int) -> dict[str, Any]:
    rows = session.scalars(select(AuditEntry).where(AuditEntry.seq > after).order_by(AuditEntry.seq)
                           .limit(limit + 1)).all()
    entries = [{"id": r.seq, "at": r.at, "actor": {"key_id": r.key_id, "owner": r.owner}, "action": r.action,
                "subject": r.subject, "data": r.data} for r in rows[:limit]]
    return {"data": entries, "has_more": len(rows) > limit, "next_after": entries[-1]["id"] if entries else after}
