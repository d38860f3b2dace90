"""Worker settings, read from the environment (prefix FT_)."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

from worker.priority import Priority


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FT_", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    broker_url: str | None = None  # defaults to redis_url
    artifacts_root: str = "./var/artifacts"
    queues: str = "default"  # comma-separated Celery queues this worker serves
    heartbeat_seconds: float = 2.0
    lease_ttl_seconds: float = 10.0
    poll_seconds: float = 0.2
    # SIGTERM lets the trainer save a checkpoint before it exits; after this it is killed.
    term_grace_seconds: float = 30.0
    # How long a finished attempt keeps trying to report its end while Redis is unreachable.
    report_retry_seconds: float = 600.0
    python: str | None = None  # interpreter for the launcher; defaults to this one
    log_tail_lines: int = 40
    # DeepSpeed builds its C++/CUDA ops on first use; they are cached here, one folder per installation.
    extensions_dir: str = "~/.cache/finetune/torch_extensions"
    # How much of the node's CPU the launcher and ranks may take from the worker, its guards and whatever else
    # runs there (worker/priority.py): normal, low (nice 10) or idle (SCHED_IDLE; scripts.stack's default).
    trainer_priority: Priority = "low"

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url
