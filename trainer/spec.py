"""The job schema: the one source of truth for what a fine-tune job may ask for.

Pure pydantic, importable without torch, so the API validates requests with the very classes the
trainer runs from. Unknown keys are refused everywhere (a typo must not silently train with a default).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    """A model by hub id (`org/name`) or by a path under the configured model root."""

    name_or_path: str = Field(min_length=1, max_length=500)
    revision: str | None = Field(default=None, max_length=200)
    trust_remote_code: bool = False
    init: Literal["pretrained", "random"] = Field(
        default="pretrained", description="random: the model's config with freshly initialised weights")
    attn_implementation: Literal["auto", "sdpa", "flex_attention", "eager"] = "auto"


class DataSpec(_Strict):
    train: str = Field(min_length=1, description="Training file, a path under the data root")
    validation: str | None = Field(default=None, description="Validation file, a path under the data root")
    validation_fraction: float = Field(default=0.0, ge=0.0, lt=0.5)
    format: Literal["text", "jsonl", "chat"] = "text"
    text_field: str = Field(default="text", min_length=1, description="JSONL field holding the text")
    packing: bool = True


class Hyperparameters(_Strict):
    max_steps: int | None = Field(default=None, ge=1, le=10_000_000)
    epochs: float = Field(default=1.0, gt=0, le=1000)
    learning_rate: float = Field(default=1e-4, gt=0, le=1.0)
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(default=0, ge=0)
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    weight_decay: float = Field(default=0.0, ge=0.0, le=1.0)
    adam_betas: tuple[float, float] = (0.9, 0.95)
    gradient_clipping: float = Field(default=1.0, ge=0.0)
    global_batch_size: int = Field(default=32, ge=1, le=1_000_000)
    micro_batch_size: int | Literal["auto"] = "auto"
    seq_len: int = Field(default=2048, ge=8, le=131_072)
    seed: int = Field(default=42, ge=0)
    eval_every_steps: int | None = Field(default=None, ge=1)

    @field_validator("micro_batch_size")
    @classmethod
    def _positive_micro(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError('must be a positive integer or "auto"')
        return v


class DeepSpeedOptions(_Strict):
    zero_stage: Literal[0, 1, 2, 3] = 2
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    offload_param: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = Field(default=None, description="Directory under the NVMe root for offload")
    activation_checkpointing: bool = False
    compile: Literal["auto", "on", "off"] = Field(
        default="auto", description="torch.compile each transformer block; auto: on CUDA without LoRA")
    config: dict[str, Any] | None = Field(
        default=None, description="A raw DeepSpeed config, checked field by field and merged"
    )

    @field_validator("offload_optimizer", "offload_param", mode="before")
    @classmethod
    def _bool_offload(cls, v: Any) -> Any:
        # `true`/`false` are what people write first; map them onto the explicit device names.
        if v is True:
            return "cpu"
        if v is False or v is None:
            return "none"
        return v

    @model_validator(mode="after")
    def _param_offload_needs_stage3(self) -> DeepSpeedOptions:
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ValueError(
                "offload_param needs zero_stage 3: only stage 3 partitions the parameters, so stages "
                f"0-2 cannot offload them (got zero_stage {self.zero_stage}); set zero_stage to 3 or "
                'offload_param to "none"'
            )
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise ValueError('offloading to "nvme" needs nvme_path, a directory under the NVMe root')
        return self


class Resources(_Strict):
    num_gpus: int = Field(default=1, ge=1, le=64, description="Launcher processes per node")
    queue: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    time_limit_seconds: int = Field(default=24 * 3600, ge=10, le=30 * 24 * 3600)


class Checkpointing(_Strict):
    every_steps: int | None = Field(default=None, ge=1)
    keep_last: int = Field(default=2, ge=1, le=100)


class LoraSpec(_Strict):
    rank: int = Field(default=8, ge=1, le=1024)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    merge_on_export: bool = False


class JobSpec(_Strict):
    """What a client sends in `POST /jobs` (and what `python -m trainer` runs from)."""

    name: str = Field(default="", max_length=200)
    model: ModelSpec
    data: DataSpec
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    deepspeed: DeepSpeedOptions = Field(default_factory=DeepSpeedOptions)
    resources: Resources = Field(default_factory=Resources)
    checkpointing: Checkpointing = Field(default_factory=Checkpointing)
    lora: LoraSpec | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("model", mode="before")
    @classmethod
    def _model_from_string(cls, v: Any) -> Any:
        return {"name_or_path": v} if isinstance(v, str) else v


class ResolvedJob(_Strict):
    """A job with every choice made: no `auto` left, the DeepSpeed JSON rendered, the reasons kept."""

    spec: JobSpec
    world_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    deepspeed_config: dict[str, Any]
    notes: list[str] = Field(default_factory=list)
    # True when the micro batch came from an estimate: a trainer on a GPU replaces it with a measured choice.
    micro_batch_auto: bool = False


class RunPaths(_Strict):
    """Where one attempt of a job reads and writes; all under the job's directory."""

    job_dir: str
    checkpoint_dir: str
    output_dir: str
    model_root: str | None = None
    data_root: str | None = None


class RunSpec(_Strict):
    """The file handed to `python -m trainer --spec`: the resolved job plus where to write."""

    job: ResolvedJob
    paths: RunPaths
    attempt: int = 1
