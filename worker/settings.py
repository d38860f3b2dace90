"""The worker's settings, read from the environment (prefix FT_); the keys it shares with the API and the control
plane are declared once in core/settings.py."""

from __future__ import annotations

from pathlib import Path

from core.settings import SharedSettings
from worker.priority import Priority


class WorkerSettings(SharedSettings):
    queues: str = "default"  # comma-separated Celery queues this worker serves (-Q of `python -m worker` wins)
    heartbeat_seconds: float = 2.0
    poll_seconds: float = 0.2
    # SIGTERM lets the trainer save a checkpoint before it exits; after this it is killed.
    term_grace_seconds: float = 30.0
    # How long a finished attempt keeps trying to report its end while Redis is unreachable.
    report_retry_seconds: float = 600.0
    # How long a finished attempt keeps trying to put its export in the artifact store while the store is
    # unreachable; past it the job fails with store_unavailable rather than succeed with no model to download.
    store_retry_seconds: float = 600.0
    python: str | None = None  # interpreter for the launcher; defaults to this one
    log_tail_lines: int = 40
    # DeepSpeed builds its C++/CUDA ops on first use; they are cached here, one folder per installation.
    extensions_dir: str = "~/.cache/finetune/torch_extensions"
    # The node's copies of stored files its jobs read (store/cache.py): least recently used go first past the bound.
    cache_root: str = "./var/cache"
    cache_max_bytes: int = 100 * 1024**3
    # How much of the node's CPU the launcher and ranks may take from the worker, its guards and whatever else
    # runs there (worker/priority.py): normal, low (nice 10) or idle (SCHED_IDLE; scripts.stack's default).
    trainer_priority: Priority = "low"
    # Start a single-node attempt's ranks by forking a warm trainer (worker/spare.py) instead of through the DeepSpeed
    # launcher's processes, each importing torch anew; multi-node attempts always use the launcher.
    warm_trainer: bool = True
    # A job's folder on the node that no attempt has used for this long is removed (worker/scratch.py): what must
    # outlive it is in the artifact store. A disk short of room has idle folders removed sooner, oldest first.
    scratch_retention_seconds: float = 24 * 3600.0

    @property
    def jobs_root(self) -> Path:
        """The folder of this node's job folders, under its own FT_ARTIFACTS_ROOT (worker/attempt.py
        `node_job_dir`); the node announces the room left on its filesystem (worker/node.py)."""
        return Path(self.artifacts_root).expanduser().resolve() / "jobs"
