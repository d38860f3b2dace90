"""Control-plane settings, read from the environment (prefix FT_), with documented defaults."""

from __future__ import annotations

from functools import lru_cache

from pydantic import SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class ApiSettings(BaseSettings):
    # Inputs stay out of error messages: they hold FT_SECRETS_KEY and the database password.
    model_config = SettingsConfigDict(env_prefix="FT_", extra="ignore", hide_input_in_errors=True)

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
    # How long an Idempotency-Key's answer is kept (at least a day: clients retry across a night's outage).
    idempotency_hours: float = 24.0
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
    # Webhooks (api/webhooks.py, api/deliverer.py): CIDRs the service may call although they are not public
    # (loopback, private, link-local, ...); empty: public addresses only.
    webhook_allow_nets: str = ""
    webhook_timeout_seconds: float = 5.0  # a whole delivery: connect, send, the answer's status line
    webhook_max_attempts: int = 8
    webhook_backoff_seconds: float = 1.0  # before the first retry; doubled each time, with jitter
    webhook_backoff_max_seconds: float = 600.0
    webhook_concurrency: int = 32  # deliveries in flight, all receivers together
    webhook_per_receiver: int = 2  # in flight to one receiver (scheme, host, port): a slow one holds only these
    # PEM file of CAs trusted for https receivers besides the system's (receivers with an internal CA); empty: none.
    webhook_ca_file: str = ""
    # Keys that encrypt webhook secrets at rest (api/secretbox.py): comma-separated, the first encrypts, all decrypt.
    # Required outside development; unset in development: a public development key, with a warning.
    secrets_key: SecretStr = SecretStr("")
    loop_interval_seconds: float = 0.5

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def development(self) -> bool:
        return self.env == "development"

    @field_validator("quota_max_active_jobs", "quota_max_gpus", mode="before")
    @classmethod
    def _empty_is_no_limit(cls, value: object) -> object:
        return None if isinstance(value, str) and value.strip().lower() in ("", "none", "null") else value

    @field_validator("quota_max_active_jobs", "quota_max_gpus")
    @classmethod
    def _not_negative(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError("must be 0 or more (empty: no limit)")
        return value

    @field_validator("webhook_allow_nets")
    @classmethod
    def _cidrs(cls, value: str) -> str:
        from api.webhooks import parse_allow_nets

        parse_allow_nets(value)
        return value

    @field_validator("webhook_max_attempts", "webhook_concurrency", "webhook_per_receiver")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
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
                             "key with `python -m api.keys create --owner NAME --scopes admin` (docs/access.md)")
        if self.allow_anonymous and not self.development:
            raise ValueError("FT_ALLOW_ANONYMOUS is for development only (FT_ENV=development); production "
                             "requires an API key on every request")
        return self

    @model_validator(mode="after")
    def _secrets_key_usable(self) -> ApiSettings:
        from api.secretbox import check_setting

        check_setting(self.secrets_key.get_secret_value(), development=self.development)
        return self


@lru_cache
def get_settings() -> ApiSettings:
    return ApiSettings()


def settings_or_exit(program: str) -> ApiSettings:
    """The settings, or exit naming each setting that is wrong: a misconfigured process must not start, and
    one line per problem tells an operator more than a traceback."""
    try:
        return get_settings()
    except ValidationError as exc:
        problems = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e.get("loc", ()))
            msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
            problems.append(f"FT_{where.upper()}: {msg}" if where else msg)
        raise SystemExit(f"the {program} cannot start: " + "; ".join(problems)) from None
