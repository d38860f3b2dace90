"""The OpenAI-compatible face of the service, under /v1 (docs/openai.md)."""

from api.v1 import fine_tuning, models

routers = (fine_tuning.router, models.router)
