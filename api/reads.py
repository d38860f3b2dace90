"""A job's JSON through this process's cache (api/jobcache.py); every other read is db/reads.py's."""

from __future__ import annotations

from api.jobcache import JobCache
from api.services.paths import server_paths
from api.settings import get_settings
from db import reads

_cache: JobCache | None = None


async def job_cached(job_id: str, owner: str | None = None) -> bytes:
    """`db.reads.job` with the service's roots shown relative to them (api/services/paths.py), served from this
    process's cache while Postgres notifies changes (api/jobcache.py). Only for
    plain reads: a route that has just written the job reads it with `db.reads.job`, its own write not yet
    notified."""
    global _cache
    if _cache is None:
        _cache = JobCache(get_settings().job_cache_size)
    paths = server_paths(get_settings())

    async def shown(found_id: str) -> tuple[str, bytes] | None:
        # Kept as clients read it, the service's roots rewritten: once per change of the row, not once per poll.
        found = await reads.job_with_owner(found_id)
        return None if found is None else (found[0], paths.json(found[1]))

    found = await _cache.get(job_id, owner, shown)
    if found is None:
        raise reads.not_found(job_id)
    return found
