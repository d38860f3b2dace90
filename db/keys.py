"""API keys: create (the secret is returned once), list, revoke. The API's /keys routes and the operator's
CLI (`python -m api.keys`) both call these."""

from __future__ import annotations

import secrets
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from api import access
from api.errors import ApiError, ErrorCode, invalid
from contract.problems import FieldError
from db import audit
from db.models import ApiKey

MAX_DAYS = 100 * 366  # a farther expiry means none; the bound keeps dates near Python's year 9999 out


def new_id() -> str:
    return "key_" + secrets.token_hex(8)


def view(key: ApiKey) -> dict[str, Any]:
    """The key's fields without its secret (the Key schema)."""
    return {"id": key.id, "prefix": key.prefix, "owner": key.owner, "scopes": list(key.scopes), "name": key.name,
            "created_at": key.created_at, "created_by": key.created_by, "expires_at": key.expires_at,
            "last_used_at": key.last_used_at, "revoked": key.revoked_at is not None, "revoked_at": key.revoked_at}


def create(*, session: Session, owner: str, scopes: list[str], name: str = "", expires_at: datetime | None = None,
           actor: access.Principal | None) -> tuple[ApiKey, str]:
    """A new key and its secret; the secret exists only in the return value (and the caller's answer)."""
    if expires_at is not None:
        if expires_at.tzinfo is None:
            raise invalid([FieldError("expires_at", "needs a time zone (say, 2027-01-01T00:00:00Z)")])
        now = datetime.now(timezone.utc)
        if expires_at <= now:
            raise invalid([FieldError("expires_at", "is in the past; give a future time or null for no expiry")])
        if expires_at.year >= 9000 or (expires_at - now).days > MAX_DAYS:
            raise invalid([FieldError("expires_at", f"is more than {MAX_DAYS} days away; give null for no expiry")])
    secret = access.new_key()
    key = ApiKey(id=new_id(), secret_hash=access.digest(secret.encode()), prefix=secret[:access.SHOWN_PREFIX],
                 owner=owner, scopes=sorted(set(scopes)), name=name, expires_at=expires_at,
                 created_by=actor.key_id if actor else None)
    session.add(key)
    session.flush()
    audit.record(session, actor, "key.create", key.id, {"owner": owner, "scopes": key.scopes, "name": name,
                                                        "expires_at": expires_at.isoformat() if expires_at else None})
    session.commit()
    session.refresh(key)
    return key, secret


def listing(*, session: Session, owner: str | None, limit: int, after: str | None) -> dict[str, Any]:
    q = select(ApiKey).order_by(ApiKey.created_at.desc(), ApiKey.id.desc())
    if owner is not None:
        q = q.where(ApiKey.owner == owner)
    if after is not None:
        cursor = session.get(ApiKey, after)
        if cursor is None:
            raise invalid([FieldError("after", f"{after!r} is not a key id; pass the last id of the previous page")])
        q = q.where(text("(api_keys.created_at, api_keys.id) < (:at, :id)").bindparams(at=cursor.created_at,
                                                                                     id=cursor.id))
    rows = session.scalars(q.limit(limit + 1)).all()
    return {"data": [view(k) for k in rows[:limit]], "has_more": len(rows) > limit}


def revoke(*, session: Session, key_id: str, actor: access.Principal | None) -> ApiKey:
    """Revoked from the commit on; every API process drops it from its cache (the table's trigger notifies),
    the revoking one before it answers (api/routes/keys.py)."""
    key = session.scalars(select(ApiKey).where(ApiKey.id == key_id).with_for_update()).one_or_none()
    if key is None:
        raise ApiError(404, ErrorCode.NOT_FOUND, f"no key with id {key_id!r}", "id")
    if key.revoked_at is None:
        key.revoked_at = datetime.now(timezone.utc)
        audit.record(session, actor, "key.revoke", key.id, {"owner": key.owner})
        session.commit()
    return key
