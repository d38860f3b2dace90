"""The FastAPI application: routers included in one place, one error shape everywhere."""

from __future__ import annotations

from fastapi import FastAPI

from api import errors
from api.routes import health, jobs


def create_app() -> FastAPI:
    app = FastAPI(title="Fine-tuning job service", version="0.1.0",
                  description="Submit DeepSpeed fine-tune jobs, follow their events and logs, get the model back.")
    errors.install(app)
    app.include_router(health.router)
    app.include_router(jobs.router)
    return app


app = create_app()
