"""API keys: create (the secret shown once), list, revoke. Admin only."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path, Query

from api import access
from api.access import CACHE, Scope
from api.deps import CallerDep, scoped
from api.errors import responses
from api.guards import StrictJSONRoute
from api.schemas import OWNER_PATTERN, Key, KeyCreate, KeyCreated, KeyList
from db import keys as service

router = APIRouter(prefix="/keys", tags=["keys"], route_class=StrictJSONRoute,
                   responses=responses(401, 403, 413, 422, 503))
KEY_ID = r"^[A-Za-z0-9_-]{1,40}$"
# What `POST /keys` makes (db/keys.py new_id): a list cursor of another form is a 422, one of no key a 404.
KEY_ID_PATTERN = r"^key_[0-9a-f]{16}$"
ADMIN = scoped(Scope.ADMIN)


@router.post("", status_code=201, response_model=KeyCreated, openapi_extra=ADMIN)
async def create_key(body: KeyCreate, caller: CallerDep) -> dict[str, Any]:
    """A new key for `owner` with `scopes`; the answer's `key` is the secret, shown this once."""
    key, secret = await access.create_key(owner=body.owner, scopes=list(body.scopes), name=body.name,
                                          expires_at=body.expires_at, actor=caller.actor())
    return {**key, "key": secret}


@router.get("", response_model=KeyList, responses=responses(404), openapi_extra=ADMIN)
async def list_keys(owner: Annotated[str | None, Query(pattern=OWNER_PATTERN)] = None,
              limit: Annotated[int, Query(ge=1, le=200)] = 50,
              after: Annotated[str | None, Query(pattern=KEY_ID_PATTERN, description=(
                  "The last id of the previous page (a key id of no key is a 404)"))] = None) -> dict[str, Any]:
    """Every key (revoked ones too), newest first, without secrets."""
    return await service.listing(owner=owner, limit=limit, after=after)


@router.delete("/{key_id}", response_model=Key, responses=responses(404), openapi_extra=ADMIN)
async def revoke_key(key_id: Annotated[str, Path(pattern=KEY_ID)], caller: CallerDep) -> dict[str, Any]:
    """Revokes the key: from this answer on it gets 401 from every API process. Revoking twice changes nothing."""
    key, secret_hash = await service.revoke(key_id=key_id, actor=caller.actor())
    # This process forgets it itself, before it answers: its own next request must not pass on the cache while
    # the notification is on its way.
    CACHE.forget(secret_hash)
    return key
