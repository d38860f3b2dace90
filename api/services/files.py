"""Deleting a file, for both faces (api/routes/files.py and api/v1/files.py): the row first, which refuses a file a
job that has not ended names, then its bytes in the store."""

from __future__ import annotations

from typing import Any

from api.access import Principal
from api.deps import owner_of
from db import files
from store.layout import file_key
from store.objects import Store


async def delete(*, file_id: str, caller: Principal, store: Store) -> dict[str, Any]:
    """The row removed (the File schema's fields); NotFound for a file the caller cannot see, FileInUse while a job
    that has not ended names it."""
    gone = await files.delete(file_id=file_id, owner=owner_of(caller), actor=caller.actor())
    await store.delete_async(file_key(file_id))
    return gone
