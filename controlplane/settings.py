"""The control plane's settings, read from the environment (prefix FT_), with documented defaults; the keys it
shares with the API and the workers are declared once in core/settings.py."""

from __future__ import annotations

from pydantic import field_validator

from core.settings import StoreSettings


class ControlPlaneSettings(StoreSettings):
    max_attempts: int = 3
    ingest_batch: int = 500
    loop_interval_seconds: float = 0.5
    # Where the control plane serves its Prometheus metrics (controlplane/metrics.py); empty: nowhere.
    controlplane_metrics_port: int | None = None
    webhook_timeout_seconds: float = 5.0  # a whole delivery: connect, send, the answer's status line
    webhook_max_attempts: int = 8
    webhook_backoff_seconds: float = 1.0  # before the first retry; doubled each time, with jitter
    webhook_backoff_max_seconds: float = 600.0
    webhook_concurrency: int = 32  # deliveries in flight, all receivers together
    webhook_per_receiver: int = 2  # in flight to one receiver (scheme, host, port): a slow one holds only these
    # PEM file of CAs trusted for https receivers besides the system's (receivers with an internal CA); empty: none.
    webhook_ca_file: str = ""

    @field_validator("controlplane_metrics_port", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("webhook_max_attempts", "webhook_concurrency", "webhook_per_receiver")
    @classmethod
    def _at_least_one(cls, value: int) -> int:
        if value < 1:
            raise ValueError("must be 1 or more")
        return value
