"""The settings every process shares, read from the environment (prefix FT_). Each process has one class of its
own over these (api/settings.py, controlplane/settings.py, worker/settings.py), so a key both sides need is
declared once and cannot drift between them."""

from __future__ import annotations

import json
from functools import cached_property
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from contract.storage import StoreConfig

if TYPE_CHECKING:
    from store.objects import Store


class SharedSettings(BaseSettings):
    """What the API, the control plane and every worker must agree on."""

    # Inputs stay out of error messages: they hold FT_SECRETS_KEY and the database password.
    model_config = SettingsConfigDict(env_prefix="FT_", extra="ignore", hide_input_in_errors=True)

    env: str = "development"
    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str | None = None  # defaults to redis_url
    # Shared storage: the API and every worker see the same paths.
    artifacts_root: str = "./var/artifacts"
    # Where a job's model and data lie (the API checks a job's paths against them, and a worker's messages name
    # paths relative to them: core/serverpaths.py), and where NVMe offload may write.
    model_root: str = "./var/models"
    data_root: str = "./var/data"
    nvme_root: str = "/local_nvme"
    # The artifact store (store/): uploaded files and exports. file://<folder> on one machine; s3://<bucket>/<prefix>
    # for a cluster, with the S3 server's URL (unset for AWS) and the standard AWS_* credentials. `store_config` is
    # the one place these become the store's config.
    store_url: str = "file://./var/store"
    s3_endpoint_url: str | None = None  # the s3 backend's `endpoint` option
    # The backend's own options, a JSON object (FT_STORE_OPTIONS='{"endpoint": "http://minio:9000"}').
    store_options: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    # A worker renews its lease at least this often; after Redis lost its data, a live worker re-creates its lease
    # within one TTL, so the control plane counts no missing lease before then.
    lease_ttl_seconds: float = 10.0

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def development(self) -> bool:
        return self.env == "development"

    @field_validator("store_url")
    @classmethod
    def _store_url(cls, value: str) -> str:
        from store.backends import BACKENDS, forms

        scheme, sep, rest = value.partition("://")
        if not (sep and rest and scheme in BACKENDS):
            raise ValueError(f"the store is {forms()}")
        return value

    @field_validator("store_options", mode="before")
    @classmethod
    def _store_options_json(cls, value: Any) -> Any:
        # Decoded here rather than by the settings source, so bad JSON is one line naming the setting.
        if isinstance(value, str):
            try:
                return json.loads(value) if value.strip() else {}
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object: {exc}") from None
        return value

    @field_validator("store_options")
    @classmethod
    def _store_options_known(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        from store.backends import BACKENDS, option_problem

        url = info.data.get("store_url")  # absent where it was refused itself
        if url is None:
            return value
        scheme = url.partition("://")[0]
        if problem := option_problem(BACKENDS[scheme], scheme, value):
            raise ValueError(problem)
        endpoint = info.data.get("s3_endpoint_url")
        if endpoint and value.get("endpoint", endpoint) != endpoint:
            raise ValueError("names an endpoint other than FT_S3_ENDPOINT_URL's: set one of them")
        return value

    def store_config(self) -> StoreConfig:
        """The artifact store these settings name, whole: FT_STORE_URL, the backend's options from FT_STORE_OPTIONS,
        and FT_S3_ENDPOINT_URL as an s3 store's `endpoint` (a folder store has no use for it, so one environment may
        carry it for either). The one place settings become a store config."""
        return self._store_config

    @cached_property
    def _store_config(self) -> StoreConfig:
        # Built once: the API asks for it on every request that reaches the store.
        options = dict(self.store_options)
        if self.s3_endpoint_url and self.store_url.startswith("s3://"):
            options["endpoint"] = self.s3_endpoint_url
        return StoreConfig(url=self.store_url, options=options)

    def store(self) -> Store:
        """A client of the artifact store these settings name."""
        from store.objects import Store

        return Store(self.store_config())


class StoreSettings(SharedSettings):
    """What the two processes that hold the database (the API and the control plane) must agree on."""

    database_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/finetune"
    # Keys that encrypt webhook secrets at rest (core/secretbox.py): comma-separated, the first encrypts, all
    # decrypt. Required outside development; unset in development: a public development key, with a warning.
    secrets_key: SecretStr = SecretStr("")
    # Webhooks (core/webhooks.py): CIDRs the service may call although they are not public (loopback, private,
    # link-local, ...); empty: public addresses only. Checked at submit (API) and at every delivery (control plane).
    webhook_allow_nets: str = ""
    # A worker whose lease has been missing this long is gone: the control plane requeues its job, and the API
    # shows its node as lost (GET /nodes, dry runs).
    lease_grace_seconds: float = 3.0

    @field_validator("webhook_allow_nets")
    @classmethod
    def _cidrs(cls, value: str) -> str:
        from core.webhooks import parse_allow_nets

        parse_allow_nets(value)
        return value

    @model_validator(mode="after")
    def _secrets_key_usable(self) -> StoreSettings:
        from core.secretbox import check_setting

        check_setting(self.secrets_key.get_secret_value(), development=self.development)
        return self


S = TypeVar("S", bound=BaseSettings)


def settings_or_exit(make: type[S], program: str) -> S:
    """The settings, or exit naming each setting that is wrong: a misconfigured process must not start, and
    one line per problem tells an operator more than a traceback."""
    try:
        return make()
    except ValidationError as exc:
        problems = []
        for e in exc.errors():
            where = ".".join(str(p) for p in e.get("loc", ()))
            msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
            problems.append(f"FT_{where.upper()}: {msg}" if where else msg)
        raise SystemExit(f"the {program} cannot start: " + "; ".join(problems)) from None
