"""The web dashboard: one static page (no build step) that reads the API with the key pasted into it.

The page itself holds no data, so it is served without a key (like /docs); every request it makes sends the
key from the tab's sessionStorage, and is checked like any other.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PATH = "/ui"
PAGE = Path(__file__).resolve().parent.parent / "static" / "ui.html"
router = APIRouter(tags=["ui"])


@lru_cache(maxsize=1)
def page() -> str:
    return PAGE.read_text(encoding="utf-8")


@router.get(PATH, response_class=HTMLResponse, include_in_schema=False)
async def dashboard() -> HTMLResponse:
    return HTMLResponse(page(), headers={"Cache-Control": "no-cache"})
