"""The audit log: who submitted, cancelled, created or revoked what. Each entry is written in the transaction of
the change it records, so there is no change without its entry and no entry without its change.

`INSERT` is the one text of an entry's insert: `record` runs it with values, and the submit's statement
(db/jobs.py) composes it with a SELECT from the job it inserts. `actor` is who did it ({"key_id", "owner"}, as
events name them); None is the operator's CLI.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import asyncpg
import orjson

from contract.codes import AuditAction
from db import jsonw
from db import pool as pg

INSERT = "INSERT INTO audit_log (at, key_id, owner, action, subject, data)"
RECORD = INSERT + " VALUES (now(), $1, $2, $3, $4, $5::jsonb)"
PAGE = ("SELECT seq, at, key_id, owner, action, subject, data::text FROM audit_log WHERE seq > $1 "
        "ORDER BY seq LIMIT $2")

Actor = Mapping[str, str | None] | None


async def record(conn: asyncpg.Connection, actor: Actor, action: AuditAction, subject: str,
                 data: dict[str, Any]) -> None:
    """Within the caller's transaction on `conn`."""
    await conn.execute(RECORD, actor["key_id"] if actor else None, actor["owner"] if actor else None, str(action),
                       subject, jsonw.dumps(data))


async def page(*, after: int, limit: int) -> dict[str, Any]:
    rows = await pg.fetch(PAGE, after, limit + 1)
    entries = [{"id": r[0], "at": r[1], "actor": {"key_id": r[2], "owner": r[3]}, "action": r[4], "subject": r[5],
                "data": orjson.loads(r[6])} for r in rows[:limit]]
    return {"data": entries, "has_more": len(rows) > limit, "next_after": entries[-1]["id"] if entries else after}
