"""OpenAI's models: the base models this deployment offers (FT_BASE_MODELS) and the caller's fine-tuned models
(its succeeded jobs, named `ft:<base>:<owner>:<suffix>:<job id>`). The SDK puts a model's id in the path
percent-encoded, `/` included (a hub id: `org/name`), which arrives decoded: the id is the rest of the path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fastapi import APIRouter

from api.access import Scope
from api.deps import CallerDep, SettingsDep, owner_of, scoped
from api.errors import ApiError, ErrorCode
from api.settings import ApiSettings
from api.v1 import names, service
from api.v1.errors import PREFIX, responses
from api.v1.job_schemas import Model, ModelList
from db import finetuning as store
from db.errors import NotFound

router = APIRouter(prefix=f"{PREFIX}/models", tags=["openai: models"], responses=responses(400, 401, 403, 404, 503))
READ = scoped(Scope.JOBS_READ)
# Who a base model belongs to, as OpenAI names its own.
SYSTEM = "system"


def _created(settings: ApiSettings, name: str) -> int:
    """When a base model under the model root was put there; 0 for a hub id or a model not found."""
    try:
        return int(os.stat(Path(settings.model_root) / name).st_mtime)
    except (OSError, ValueError):
        return 0


def base_models(settings: ApiSettings) -> list[dict[str, Any]]:
    return [{"id": name, "object": "model", "created": _created(settings, name), "owned_by": SYSTEM}
            for name in settings.base_model_names]


@router.get("", response_model=ModelList, openapi_extra=READ)
async def list_models(settings: SettingsDep, caller: CallerDep) -> dict[str, Any]:
    """The base models, then the caller's owner's fine-tuned models newest first (an admin's: every owner's; at
    most db/finetuning.py MAX_MODELS)."""
    rows = await store.succeeded(owner_of(caller))
    found = await store.lineage([r[0] for r in rows])
    tuned = [{"id": names.fine_tuned_model(base=found[r[0]].base if r[0] in found else "", owner=r[2], suffix=r[1],
                                           job_id=r[0]),
              "object": "model", "created": service.seconds(r[3]) or 0, "owned_by": r[2]} for r in rows]
    return {"object": "list", "data": base_models(settings) + tuned}


@router.get("/{model_id:path}", response_model=Model, openapi_extra=READ)
async def get_model(model_id: str, settings: SettingsDep, caller: CallerDep) -> dict[str, Any]:
    for model in base_models(settings):
        if model["id"] == model_id:
            return model
    try:
        job = await service.fine_tuned_job(model_id, owner_of(caller))
    except NotFound:
        raise ApiError(404, ErrorCode.NOT_FOUND, f"the model {model_id!r} does not exist or is not yours",
                       "model") from None
    return {"id": model_id, "object": "model", "created": service.seconds(job.get("finished_at")) or 0,
            "owned_by": job["owner"]}
