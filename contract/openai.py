"""The words of OpenAI's fine-tuning API that the service's own share a spelling with (a job's status, an event's
level): spelled once, here, like contract/codes.py's. Standard library only."""

from __future__ import annotations

import enum


class OpenAIStatus(str, enum.Enum):
    """`status` of a FineTuningJob (openai/types/fine_tuning/fine_tuning_job.py)."""

    def __str__(self) -> str:
        return str(self.value)

    VALIDATING_FILES = "validating_files"
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class EventType(str, enum.Enum):
    """`type` of a FineTuningJobEvent."""

    def __str__(self) -> str:
        return str(self.value)

    MESSAGE = "message"
    METRICS = "metrics"


class Level(str, enum.Enum):
    def __str__(self) -> str:
        return str(self.value)

    INFO = "info"
    WARN = "warn"
    ERROR = "error"
