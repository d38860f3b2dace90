"""Webhooks: an owner's default URL and signing secret, and a job's deliveries."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query
from fastapi.responses import Response

from api.access import Scope
from api.deps import CallerDep, JobId, SettingsDep, owner_of, scoped
from api.errors import responses
from api.guards import StrictJSONRoute
from api.routes.jobs import COMMON, MAX_SEQ, JSONBytes
from api.schemas import OWNER_PATTERN, DeliveryPage, OwnerWebhook, OwnerWebhookSet
from api.services import webhooks as service
from db import webhooks as store

router = APIRouter(tags=["webhooks"], route_class=StrictJSONRoute, responses=responses(*COMMON))
Owner = Annotated[str, Path(pattern=OWNER_PATTERN, description="A team or project name, as keys name it")]


@router.get("/owners/{owner}/webhook", response_model=OwnerWebhook, responses=responses(404),
            openapi_extra=scoped(Scope.JOBS_READ))
async def get_owner_webhook(owner: Owner, caller: CallerDep) -> dict[str, Any]:
    """The owner's default webhook URL and when its secret was made or rotated (never the secret)."""
    return await service.get_owner(owner=owner, caller=caller)


@router.put("/owners/{owner}/webhook", response_model=OwnerWebhook, openapi_extra=scoped(Scope.JOBS_WRITE))
async def put_owner_webhook(owner: Owner, body: OwnerWebhookSet, caller: CallerDep,
                            settings: SettingsDep) -> dict[str, Any]:
    """Sets the owner's default URL (for its jobs that name none; null: none). The first call makes the owner's
    signing secret, and `rotate_secret` replaces it: only that answer holds `secret`."""
    return await service.put_owner(owner=owner, url=body.url, rotate=body.rotate_secret, caller=caller,
                                   settings=settings)


@router.get("/jobs/{job_id}/deliveries", response_model=DeliveryPage, responses=responses(404),
            openapi_extra=scoped(Scope.JOBS_READ))
async def job_deliveries(job_id: JobId, caller: CallerDep,
                         after: Annotated[int, Query(ge=0, le=MAX_SEQ, description="After this event id")] = 0,
                         limit: Annotated[int, Query(ge=1, le=200)] = 100) -> Response:
    """The job's webhook deliveries in event order: status, attempts, the last HTTP status or error, and when
    the next attempt is due."""
    return JSONBytes(await store.deliveries(job_id=job_id, owner=owner_of(caller), after=after, limit=limit))
