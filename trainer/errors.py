"""Failures the trainer reports with a stable `code`, so the supervisor can tell a bad job from a bad node."""

from __future__ import annotations


class TrainerError(Exception):
    code = "trainer_error"


class DataError(TrainerError):
    code = "data_error"


class ModelLoadError(TrainerError):
    code = "model_load_error"


class Interrupted(Exception):
    """Raised after a SIGTERM was honoured with a committed checkpoint; maps to exit code 143."""

    def __init__(self, step: int) -> None:
        super().__init__(f"interrupted by SIGTERM at step {step}")
        self.step = step
