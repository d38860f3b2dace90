"""Quotas per owner: how many unfinished jobs, and how many GPUs among them, one owner may hold.

An admin sets them (`PUT /owners/{owner}/quota`); an owner without a row, or a null field, takes the
service's default. They are enforced in the submit's own transaction (api/services/jobs.py), under a lock
per owner, so two submits cannot both take the last slot.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.access import Principal
from api.settings import ApiSettings
from contract.codes import UNFINISHED_STATUSES
from db import audit
from db.models import Job, OwnerQuota


def effective(row: OwnerQuota | None, settings: ApiSettings) -> tuple[int | None, int | None]:
    jobs = row.max_active_jobs if row and row.max_active_jobs is not None else settings.quota_max_active_jobs
    gpus = row.max_gpus if row and row.max_gpus is not None else settings.quota_max_gpus
    return jobs, gpus


def get(*, session: Session, owner: str, settings: ApiSettings) -> dict[str, Any]:
    row = session.get(OwnerQuota, owner)
    jobs, gpus = effective(row, settings)
    count, used = session.execute(select(func.count(), func.coalesce(func.sum(Job.gpus), 0))
                                  .where(Job.owner == owner, Job.status.in_(UNFINISHED_STATUSES))).one()
    return {"owner": owner, "max_active_jobs": jobs, "max_gpus": gpus,
            "set": {"max_active_jobs": row.max_active_jobs if row else None, "max_gpus": row.max_gpus if row else None},
            "usage": {"active_jobs": int(count), "gpus": int(used)}}


def put(*, session: Session, owner: str, max_active_jobs: int | None, max_gpus: int | None, actor: Principal,
        settings: ApiSettings) -> dict[str, Any]:
    """Replace the owner's quota. Lowering it below the current use refuses new submits; it ends no job."""
    row = session.get(OwnerQuota, owner, with_for_update=True)
    if row is None:
        row = OwnerQuota(owner=owner)
        session.add(row)
    row.max_active_jobs, row.max_gpus, row.updated_at = max_active_jobs, max_gpus, datetime.now(timezone.utc)
    audit.record(session, actor, "quota.set", owner, {"max_active_jobs": max_active_jobs, "max_gpus": max_gpus})
    session.commit()
    return get(session=session, owner=owner, settings=settings)
