"""Control-plane settings, read from the environment (prefix FT_), with documented defaults."""

from __future__ import annotations

from functools import lru_cache

from pydantic import model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FT_", extra="ignore")

    env: str = "development"
    database_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/finetune"
    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str | None = None  # defaults to redis_url
    host: str = "127.0.0.1"
    port: int = 8000
    # Shared storage: the API and every worker see the same paths.
    artifacts_root: str = "./var/artifacts"
    model_root: str = "./var/models"
    data_root: str = "./var/data"
    nvme_root: str = "/local_nvme"
    allow_hub_models: bool = True
    trust_remote_code_models: str = ""  # comma-separated model ids allowed to run their own code
    api_token: str = ""  # when set, every /jobs request needs "Authorization: Bearer <token>"
    auto_micro_batch_tokens: int = 16384
    # A worker whose lease has been missing this long is gone; its job is requeued.
    lease_grace_seconds: float = 3.0
    # The workers' lease TTL (FT_LEASE_TTL_SECONDS, shared with them): after Redis lost its data, a
    # live worker re-creates its lease within one TTL, so no missing lease counts before then.
    lease_ttl_seconds: float = 10.0
    max_attempts: int = 3
    # Connections each API process keeps for its asynchronous reads (api/pg.py).
    api_db_pool_size: int = 10
    ingest_batch: int = 500
    loop_interval_seconds: float = 0.5

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url

    @model_validator(mode="after")
    def _token_outside_development(self) -> ApiSettings:
        if self.env != "development" and not self.api_token:
            raise ValueError("FT_API_TOKEN must be set outside development (FT_ENV=development)")
        return self


@lru_cache
def get_settings() -> ApiSettings:
    return ApiSettings()
