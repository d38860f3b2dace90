"""Reading a job's committed checkpoints from the artifact store for the API; a store that cannot be reached is
the API's 503, like a database that cannot."""

from __future__ import annotations

from api.errors import store_unavailable
from store import checkpoints as stored
from store.objects import Store, StoreError


async def list_for(*, store: Store, job_id: str) -> list[stored.Manifest]:
    try:
        return await stored.read_all_async(store, job_id)
    except StoreError as exc:
        raise store_unavailable(exc) from exc


async def get(*, store: Store, job_id: str, step: int) -> stored.Manifest | None:
    try:
        return await stored.read_async(store, job_id, step)
    except StoreError as exc:
        raise store_unavailable(exc) from exc
