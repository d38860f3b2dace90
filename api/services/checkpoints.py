"""Reading a job's committed checkpoints from the artifact store for the API; a store that cannot be reached is
the API's 503, like a database that cannot."""

from __future__ import annotations

from functools import lru_cache

from obstore.exceptions import BaseError

from api.errors import RETRY_AFTER_SECONDS, ApiError, ErrorCode
from api.settings import ApiSettings
from store import checkpoints as stored
from store.objects import Store, error_line


@lru_cache(maxsize=4)
def _store(url: str, endpoint: str | None) -> Store:
    return Store(url, endpoint)


def store_of(settings: ApiSettings) -> Store:
    return _store(settings.store_url, settings.s3_endpoint_url)


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
