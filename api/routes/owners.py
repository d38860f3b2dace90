"""Quotas per owner. Admin only."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

from api.access import Scope
from api.deps import CallerDep, SettingsDep, scoped
from api.errors import responses
from api.guards import StrictJSONRoute
from api.schemas import OWNER_PATTERN, Quota, QuotaSet
from api.settings import quota_defaults
from db import quotas as service

router = APIRouter(prefix="/owners", tags=["owners"], route_class=StrictJSONRoute,
                   responses=responses(401, 403, 413, 422, 503))
Owner = Annotated[str, Path(pattern=OWNER_PATTERN, description="A team or project name, as keys name it")]


@router.put("/{owner}/quota", response_model=Quota, openapi_extra=scoped(Scope.ADMIN))
async def set_quota(owner: Owner, body: QuotaSet, settings: SettingsDep, caller: CallerDep) -> dict[str, Any]:
    """Replaces the owner's quota (a null or missing field takes the service default); applies to the next
    submit. Lowering it below the current use ends no job; it refuses new ones until use falls below it."""
    return await service.put(owner=owner, max_active_jobs=body.max_active_jobs, max_gpus=body.max_gpus,
                             max_stored_bytes=body.max_stored_bytes, actor=caller.actor(),
                             defaults=quota_defaults(settings), stored_default=settings.quota_max_stored_bytes)


@router.get("/{owner}/quota", response_model=Quota, openapi_extra=scoped(Scope.ADMIN))
async def get_quota(owner: Owner, settings: SettingsDep) -> dict[str, Any]:
    """The quota in effect for the owner and its current use."""
    return await service.get(owner=owner, defaults=quota_defaults(settings),
                             stored_default=settings.quota_max_stored_bytes)
