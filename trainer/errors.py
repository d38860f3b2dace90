"""Failures the trainer reports with a stable `code`, so the supervisor can tell a bad job from a bad node."""

from __future__ import annotations

from contract.codes import FailureCode


class TrainerError(Exception):
    code: str = FailureCode.TRAINER_ERROR


class DataError(TrainerError):
    code = FailureCode.DATA_ERROR


class ModelLoadError(TrainerError):
    code = FailureCode.MODEL_LOAD_ERROR


class Interrupted(Exception):
    """Raised after a SIGTERM was honoured with a committed checkpoint; maps to exit code 143."""

    def __init__(self, step: int) -> None:
        super().__init__(f"interrupted by SIGTERM at step {step}")
        self.step = step
