"""Nodes: the cluster as the control plane sees it (announced by the workers, controlplane/scheduler.py)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from api.access import Scope
from api.deps import SettingsDep, scoped
from api.errors import responses
from api.guards import StrictJSONRoute
from api.routes.jobs import JSONBytes
from api.schemas import NodeList
from db import reads

router = APIRouter(prefix="/nodes", tags=["nodes"], route_class=StrictJSONRoute, responses=responses(401, 403, 503))


@router.get("", response_model=NodeList, openapi_extra=scoped(Scope.JOBS_READ))
async def list_nodes(settings: SettingsDep) -> Response:
    """Every node ever seen: kind, queues, slots (total, free), its placed jobs, last heartbeat, the room left on its
    disk, state (`lost`: stopped heartbeating, receives nothing; `draining`: its worker is shutting down;
    `disk_full`: its disk has less room than its threshold, receives nothing until it has)."""
    return JSONBytes(await reads.nodes(settings.lease_grace_seconds))
