"""Reading a job's committed checkpoints from the artifact store for the API; a store that cannot be reached is
the API's 503, like a database that cannot."""

from __future__ import annotations

from obstore.exceptions import BaseError

from api.errors import RETRY_AFTER_SECONDS, ApiError, ErrorCode
from store import checkpoints as stored
from store.objects import Store, error_line


async def list_for(*, store: Store, job_id: str) -> list[stored.Manifest]:
    try:
        return await stored.read_all_async(store, job_id)
    except (OSError, BaseError) as exc:
        raise _unavailable(exc) from exc


async def get(*, store: Store, job_id: str, step: int) -> stored.Manifest | None:
    try:
        return await stored.read_async(store, job_id, step)
    except (OSError, BaseError) as exc:
        raise _unavailable(exc) from exc



def _unavailable(exc: BaseException) -> ApiError:
    return ApiError(503, ErrorCode.UNAVAILABLE, f"the artifact store could not be read: {error_line(exc)}",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
