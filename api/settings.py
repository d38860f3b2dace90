"""The API process's settings, read from the environment (prefix FT_), with documented defaults; the keys it shares
with the control plane and the workers are declared once in core/settings.py."""

from __future__ import annotations

from functools import lru_cache

from pydantic import field_validator, model_validator

from core.settings import StoreSettings, settings_or_exit


class ApiSettings(StoreSettings):
    # Where `make up` (scripts/stack.py) starts the API; the compose file's API listens on 0.0.0.0:8000.
    host: str = "127.0.0.1"
    port: int = 8000
    allow_hub_models: bool = True
    trust_remote_code_models: str = ""  # comma-separated model ids allowed to run their own code
    # Removed: one shared token for everyone. Set, it stops the API from starting (see _no_shared_token).
    api_token: str = ""
    # Development only: a request without an Authorization header acts as an admin of owner `default`
    # (local experiments, and test clients that speak raw HTTP). A request that sends a key is checked as usual.
    allow_anonymous: bool = False
    # How long an API process trusts what it read about a key (owner, scopes, expiry, revoked). Revocation
    # reaches every process at once through a notification; this bounds it when one is missed.
    key_cache_seconds: float = 10.0
    # Jobs whose JSON each API process keeps for GET /jobs/{id}, dropped when the row changes (api/jobcache.py);
    # 0 turns the cache off.
    job_cache_size: int = 4096
    # Quotas for an owner an admin set none for (PUT /owners/{owner}/quota); empty: no limit.
    quota_max_active_jobs: int | None = 100
    quota_max_gpus: int | None = None
    # Bytes an owner's uploaded files may take in the store together (POST /files); empty: no limit.
    quota_max_stored_bytes: int | None = 100 * 1024**3
    # The largest file one upload may store (POST /files answers 413 past it, whatever Content-Length said).
    max_file_bytes: int = 10 * 1024**3
    # How long an Idempotency-Key's answer is kept (at least a day: clients retry across a night's outage).
    idempotency_hours: float = 24.0
    auto_micro_batch_tokens: int = 16384
    # How long after a node's heartbeat key expired it counts as lost (GET /nodes, a dry run's placement). The
    # control plane reads the same FT_LEASE_GRACE_SECONDS (controlplane/settings.py); it belongs in
    # core.settings.StoreSettings, where both would share one declaration.
    # Connections each API process keeps for its asynchronous reads and writes (db/pool.py).
    api_db_pool_size: int = 10
    # The OpenAI-compatible face (/v1, docs/openai.md). The base models GET /v1/models lists, comma-separated, each
    # as `model` of POST /jobs names it (a path under the model root or a hub id); any other such name is accepted
    # as a job's model too.
    base_models: str = ""
    # A partial job spec (JSON, the shape of POST /jobs) under every /v1 job: what the OpenAI body cannot say
    # (seq_len, GPUs, precision, checkpointing, ...). Empty: the service's own defaults.
    openai_job_defaults: str = ""
    # How long POST /v1/fine_tuning/jobs waits for a named file still being validated before refusing it.
    openai_file_wait_seconds: float = 10.0

    @field_validator("quota_max_active_jobs", "quota_max_gpus", "quota_max_stored_bytes", mode="before")
    @classmethod
    def _empty_is_no_limit(cls, value: object) -> object:
        return None if isinstance(value, str) and value.strip().lower() in ("", "none", "null") else value

    @field_validator("quota_max_active_jobs", "quota_max_gpus", "quota_max_stored_bytes")
    @classmethod
    def _not_negative(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError("must be 0 or more (empty: no limit)")
        return value

    @field_validator("openai_job_defaults")
    @classmethod
    def _job_defaults(cls, value: str) -> str:
        from api.v1.hyperparameters import defaults_problem

        problem = defaults_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("openai_file_wait_seconds")
    @classmethod
    def _wait_bounded(cls, value: float) -> float:
        if not 0 <= value <= 60:
            raise ValueError("must be from 0 to 60 seconds")
        return value

    @property
    def base_model_names(self) -> list[str]:
        return [name.strip() for name in self.base_models.split(",") if name.strip()]

    @field_validator("max_file_bytes")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be 1 or more")
        return value

    @field_validator("idempotency_hours")
    @classmethod
    def _at_least_a_day(cls, value: float) -> float:
        if value < 24:
            raise ValueError("must be at least 24: clients count on a retry within a day being recognised")
        return value

    @model_validator(mode="after")
    def _safe_outside_development(self) -> ApiSettings:
        if self.api_token:
            # Refused rather than ignored: a deployment that still sets it believes it is guarded by it.
            raise ValueError("FT_API_TOKEN was removed: access is by API keys now. Unset it and create an admin "
                             "key with `python -m api.admin.keys create --owner NAME --scopes admin` (docs/access.md)")
        if self.allow_anonymous and not self.development:
            raise ValueError("FT_ALLOW_ANONYMOUS is for development only (FT_ENV=development); production "
                             "requires an API key on every request")
        return self


def quota_defaults(settings: ApiSettings) -> tuple[int | None, int | None]:
    """The quota of an owner an admin set none for (db/quotas.py)."""
    return settings.quota_max_active_jobs, settings.quota_max_gpus


@lru_cache
def get_settings() -> ApiSettings:
    return ApiSettings()


def api_settings_or_exit() -> ApiSettings:
    return settings_or_exit(ApiSettings, "API")
