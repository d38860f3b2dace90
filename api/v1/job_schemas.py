"""What the OpenAI-compatible fine-tuning and model routes answer, as the official SDK's types declare it
(openai/types/fine_tuning/fine_tuning_job.py, fine_tuning_job_event.py, jobs/fine_tuning_job_checkpoint.py,
openai/types/model.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from contract.openai import EventType, Level, OpenAIStatus

Auto = Literal["auto"]


class FineTuningHyperparameters(BaseModel):
    n_epochs: Auto | int | float = Field(description="Epochs as resolved (the service's default where auto)")
    batch_size: Auto | int = Field(description=(
        "Examples per optimizer step; \"auto\" until the trainer settles it on the data. A job made natively shows "
        "its global batch (rows per step)"))
    learning_rate_multiplier: Auto | float = Field(description="The learning rate ÷ the deployment's default rate")


class DpoHyperparameters(FineTuningHyperparameters):
    beta: float = Field(description="The beta the job trains with (the service's default, 0.1, where auto)")


class SupervisedMethod(BaseModel):
    hyperparameters: FineTuningHyperparameters


class DpoMethod(BaseModel):
    hyperparameters: DpoHyperparameters


class FineTuningMethod(BaseModel):
    type: Literal["supervised", "dpo"]
    supervised: SupervisedMethod | None = Field(default=None, description="A supervised job's; null for dpo")
    dpo: DpoMethod | None = Field(default=None, description="A dpo job's; null for supervised")


class FineTuningError(BaseModel):
    code: str
    message: str
    param: str | None


class FineTuningJob(BaseModel):
    id: str
    object: Literal["fine_tuning.job"]
    model: str
    created_at: int
    finished_at: int | None
    status: OpenAIStatus
    fine_tuned_model: str | None
    organization_id: str = Field(description="The job's owner")
    training_file: str
    validation_file: str | None
    hyperparameters: FineTuningHyperparameters
    method: FineTuningMethod
    seed: int
    trained_tokens: int | None
    estimated_finish: int | None
    error: FineTuningError | None
    result_files: list[str] = Field(description="Always empty: the model is at GET /jobs/{id}/output")
    integrations: list[Any]
    metadata: dict[str, Any]
    user_provided_suffix: str | None


class FineTuningJobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJob]
    has_more: bool


class FineTuningJobEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"]
    created_at: int
    level: Level
    message: str
    type: EventType
    data: dict[str, Any]


class FineTuningJobEventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJobEvent]
    has_more: bool


class CheckpointMetrics(BaseModel):
    # A dpo job's figures are trl's, keyed as trl logs them ("rewards/margins", "eval_rewards/margins"): names
    # with a "/", which no field can have; the schema states them as further numbers.
    model_config = ConfigDict(extra="allow", json_schema_extra={
        "description": "step, train_loss and valid_loss; for a dpo job also trl's reward figures at the step: "
                       "rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies, logps/chosen, "
                       "logps/rejected (training, the last reported at or before the step) and the same with "
                       "eval_ (the evaluation at the step)"})
    __pydantic_extra__: dict[str, float] = Field(init=False)

    step: float
    train_loss: float | None = None
    valid_loss: float | None = None


class FineTuningJobCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"]
    created_at: int
    step_number: int
    metrics: CheckpointMetrics
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str


class FineTuningJobCheckpointList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FineTuningJobCheckpoint]
    has_more: bool
    first_id: str | None
    last_id: str | None


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]
