"""Read-only queries of the system of record for operators' tools (the soak's checks, soak/checks.py): the jobs'
ends, their stored events and their webhook deliveries, as plain rows. They take a connection string of their own,
since a tool holds no pool of the service's."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

JOBS = """SELECT id, status, attempt, error, finished_at, request->'notifications'->>'webhook_url' AS webhook_url
FROM jobs ORDER BY seq"""
EVENTS = "SELECT job_id, seq, attempt, type, data FROM job_events WHERE job_id = ANY($1) ORDER BY job_id, seq"
DELIVERIES = """SELECT id, job_id, event_seq, event, status, attempts, last_status_code, last_error
FROM webhook_deliveries ORDER BY created_at, id"""


def _rows(dsn: str, sql: str, *args: Any) -> list[dict[str, Any]]:
    with psycopg.connect(dsn, connect_timeout=10) as conn, psycopg.RawCursor(conn, row_factory=dict_row) as cursor:
        cursor.execute(sql, args)
        return list(cursor.fetchall())


def jobs(dsn: str) -> list[dict[str, Any]]:
    return _rows(dsn, JOBS)


def events(dsn: str, job_ids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Each job's stored events in order: seq, attempt, type, data."""
    out: dict[str, list[dict[str, Any]]] = {j: [] for j in job_ids}
    for row in _rows(dsn, EVENTS, job_ids):
        out[row.pop("job_id")].append(row)
    return out


def deliveries(dsn: str) -> list[dict[str, Any]]:
    return _rows(dsn, DELIVERIES)
