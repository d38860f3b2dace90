"""OpenAI's API, a second face of the service under /v1: thin routes over the same services, rows and store as the
native routes, in the shapes of the official `openai` SDK's types, every error in OpenAI's envelope
(api/v1/errors.py). api/main.py includes `routers` and renders errors under PREFIX with `errors.render`.
docs/openai.md maps one face onto the other."""

from __future__ import annotations

from fastapi import APIRouter

from api.v1 import errors, files, fine_tuning, models
from api.v1.errors import PREFIX

routers: tuple[APIRouter, ...] = (files.router, fine_tuning.router, models.router)

__all__ = ["PREFIX", "errors", "routers"]
