"""The audit log: submits, cancels, key and quota changes, with who made them. Admin only."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from api.access import Scope
from api.deps import scoped
from api.errors import responses
from api.schemas import AuditPage
from db import audit as service

router = APIRouter(prefix="/audit", tags=["audit"], responses=responses(401, 403, 413, 422, 503))


@router.get("", response_model=AuditPage, openapi_extra=scoped(Scope.ADMIN))
async def audit_log(after: Annotated[int, Query(ge=0, le=2**63 - 1,
                                                description="Entries after this id (0: from the start)")] = 0,
                    limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> dict[str, Any]:
    """Oldest first, after the cursor: what was done, to what, by which key of which owner."""
    return await service.page(after=after, limit=limit)
