"""The job schema: the one source of truth for what a fine-tune job may ask for.

Pure pydantic, importable without torch, so the API validates requests with the very classes the
trainer runs from. Unknown keys are refused everywhere (a typo must not silently train with a default).
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from contract.codes import Method
from contract.files import FileFormat as DataFormat
from contract.stages import spec_problems
from contract.storage import StoreConfig

# Bounds on everything a request may hold. Each one keeps a value inside what Postgres, numpy/torch and
# DeepSpeed accept, and keeps every validation step (the batch arithmetic included) at a few milliseconds.
MAX_STEPS = 10_000_000
MAX_BATCH = 1_000_000  # global batch, micro batch and the raw config's batch fields
MAX_AUTO_EXAMPLES_PER_STEP = 256  # OpenAI's cap on an "auto" batch_size
MAX_SEED = 2**32 - 1  # numpy's seeds are 32-bit
MAX_PATH_CHARS = 4096  # PATH_MAX
METADATA_MAX_BYTES = 16 * 1024  # serialized as compact UTF-8 JSON
METADATA_MAX_DEPTH = 8  # objects and arrays nested in each other, metadata itself being level 1
METADATA_MAX_KEYS = 100  # per object
METADATA_MAX_KEY_CHARS = 128
RAW_CONFIG_MAX_BYTES = 32 * 1024  # real configs are a few KiB
RAW_CONFIG_MAX_DEPTH = 8
RAW_CONFIG_MAX_KEYS = 100  # per object


def text_problem(value: str) -> str | None:
    """Why Postgres could not store this string (text or JSONB), or None."""
    if "\x00" in value:
        return "contains a NUL character (\\u0000), which cannot be stored; remove it"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone UTF-16 surrogate, which is not valid UTF-8; send well-formed Unicode"
    return None


def _storable(value: str) -> str:
    problem = text_problem(value)
    if problem:
        raise ValueError(problem)
    return value


# json.dumps writes NUL as \u0000; only an odd run of backslashes before "u0000" is that escape.
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

# Every string of a job ends up in a Postgres text or JSONB column.
Text = Annotated[str, AfterValidator(_storable)]


def json_problem(value: Any, *, max_bytes: int, max_depth: int, max_keys: int,
                 max_key_chars: int | None = None) -> str | None:
    """Why `value` is not a small JSON document Postgres can store, or None.

    First a walk, one level of nesting at a time (no recursion, so no depth can exhaust the stack),
    that counts a lower bound of the serialized size and stops as soon as it passes `max_bytes`: no
    input costs more than about max_bytes steps. Only then is the document serialized, in C, which
    finds NaN, Infinity, lone surrogates and NUL characters without a Python loop over every value.
    """
    budget = max_bytes
    too_large = f"is larger than {max_bytes} bytes of JSON"
    level: list[Any] = [value]
    for _ in range(max_depth):
        deeper: list[Any] = []
        for node in level:
            if isinstance(node, dict):
                if len(node) > max_keys:
                    return f"has an object with {len(node)} keys; at most {max_keys} are accepted"
                budget -= 2 * len(node) + 1  # braces, colons and commas
                if budget < 0:
                    return too_large
                for key in node:
                    budget -= len(key) + 2
                    if max_key_chars is not None and len(key) > max_key_chars:
                        return f"has a key longer than {max_key_chars} characters"
                items: Any = node.values()
            else:
                budget -= len(node) + 1  # brackets and commas
                if budget < 0:
                    return too_large
                items = node
            for item in items:  # at most `budget` of them: the checks above bound the count
                if isinstance(item, (dict, list)):
                    deeper.append(item)  # counted with its own level
                elif isinstance(item, str):
                    budget -= len(item) + 2
                else:
                    budget -= 1
            if budget < 0:
                return too_large
        if not deeper:
            break
        level = deeper
    else:
        return f"nests objects and arrays more than {max_depth} levels deep"
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return "has a number that is not finite; NaN and Infinity are not JSON"
    except TypeError as exc:
        return f"is not JSON: {exc}"
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return "has a string that contains a lone UTF-16 surrogate, which is not valid UTF-8"
    if size > max_bytes:
        return f"is {size} bytes of JSON; at most {max_bytes} are accepted"
    if _NUL_ESCAPE.search(text):
        return "has a key or string that contains a NUL character (\\u0000), which cannot be stored"
    return None


def _json_object_check(max_bytes: int, max_depth: int, max_keys: int, max_key_chars: int | None = None) -> Any:
    def check(value: Any) -> Any:
        # Only objects are walked; anything else is left to the type's own (clearer) error.
        if isinstance(value, dict):
            problem = json_problem(value, max_bytes=max_bytes, max_depth=max_depth, max_keys=max_keys,
                                   max_key_chars=max_key_chars)
            if problem:
                raise ValueError(problem)
        return value

    return BeforeValidator(check)


Metadata = Annotated[dict[str, Any], _json_object_check(METADATA_MAX_BYTES, METADATA_MAX_DEPTH, METADATA_MAX_KEYS,
                                                         METADATA_MAX_KEY_CHARS)]
RawConfig = Annotated[dict[str, Any], _json_object_check(RAW_CONFIG_MAX_BYTES, RAW_CONFIG_MAX_DEPTH,
                                                          RAW_CONFIG_MAX_KEYS)]
Beta = Annotated[StrictFloat, Field(ge=0.0, lt=1.0)]
# What LoraSpec._module_names enforces (with its own message), as the schema states it.
ModuleNames = Annotated[list[str], WithJsonSchema({"type": "array", "minItems": 1, "maxItems": 64,
                                                   "items": {"type": "string", "minLength": 1, "maxLength": 200}})]


def _integer(v: Any) -> Any:
    # pydantic's lax int takes true for 1 and "5" for 5, which the schema's `integer` does not; 2.0 it may take,
    # as JSON Schema does (a number with no fraction is an integer).
    if isinstance(v, (bool, str)):
        raise ValueError(f"must be an integer, got {type(v).__name__}")
    return v


@cache
def integer_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields typed int (or int | None, or int | "auto")."""
    return frozenset(name for name, f in model.model_fields.items()
                     if f.annotation is int or int in get_args(f.annotation))


def refuse_lax_integers(model: type[BaseModel], data: Any) -> Any:
    """`data` with each boolean or string given for an integer field made one pydantic's int refuses too (its lax
    mode takes true for 1 and "5" for 5; the schema's `integer` takes neither). Done on the raw object, not in
    the field's type, so that ge/le stay `minimum`/`maximum` in the schema; the 422 names the field."""
    if not isinstance(data, dict):
        return data
    bad = {name: data[name] for name in integer_fields(model)
           if isinstance(data.get(name), (bool, str)) and data[name] != "auto"}
    return {**data, **{name: f"{json.dumps(v)} (a {type(v).__name__}, not an integer)" for name, v in bad.items()}}


def _offload_from_bool(v: Any) -> Any:
    # `true`/`false` are what people write first; map them onto the explicit device names.
    if v is True:
        return "cpu"
    if v is False or v is None:
        return "none"
    return v


ZeroStage = Annotated[Literal[0, 1, 2, 3], BeforeValidator(_integer)]
Offload = Annotated[Literal["none", "cpu", "nvme"], BeforeValidator(_offload_from_bool), WithJsonSchema({"anyOf": [
    {"type": "string", "enum": ["none", "cpu", "nvme"]},
    {"type": "boolean", "description": "true: cpu, false: none"}, {"type": "null", "description": "none"}]})]

# RFC 3986's IPv6address, the bracketed host of a URL; it agrees with what ipaddress (and so urllib) accepts.
_H16 = "[0-9A-Fa-f]{1,4}"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LS32 = f"(?:{_H16}:{_H16}|{_OCTET}(?:\\.{_OCTET}){{3}})"
_IPV6 = "(?:" + "|".join([
    f"(?:{_H16}:){{6}}{_LS32}", f"::(?:{_H16}:){{5}}{_LS32}", f"(?:{_H16})?::(?:{_H16}:){{4}}{_LS32}",
    *(f"(?:(?:{_H16}:){{0,{n - 1}}}{_H16})?::(?:{_H16}:){{{5 - n}}}{_LS32}" for n in (2, 3, 4)),
    f"(?:(?:{_H16}:){{0,4}}{_H16})?::{_LS32}", f"(?:(?:{_H16}:){{0,5}}{_H16})?::{_H16}",
    f"(?:(?:{_H16}:){{0,6}}{_H16})?::"]) + ")"
_PORT = "(?:0*[1-9][0-9]{0,3}|0*[1-5][0-9]{4}|0*6[0-4][0-9]{3}|0*65[0-4][0-9]{2}|0*655[0-2][0-9]|0*6553[0-5])"
# A URL the service can call back, as the schema states it: http(s), a host (a name or an address, IPv6 in
# brackets), a port from 1 to 65535 if any, printable ASCII only (percent-encode the rest) and no #fragment
# (it is never sent). Every URL it matches is one urllib splits into exactly these parts; the API then checks
# where the host resolves.
WEBHOOK_URL_PATTERN = (
    "^[Hh][Tt][Tt][Pp][Ss]?://(?:[A-Za-z0-9._~%!$&'()*+,;=:-]*@)?"
    f"(?:\\[{_IPV6}\\]|[A-Za-z0-9._~%!$&'()*+,;=-]+)(?::{_PORT}?)?"
    '(?:[/?][!"$-~]*)?$')
_WEBHOOK_URL = re.compile(WEBHOOK_URL_PATTERN)


def _webhook_url(v: str) -> str:
    if not v.lower().startswith(("http://", "https://")):
        raise ValueError("must be an http:// or https:// URL")
    if not _WEBHOOK_URL.fullmatch(v):
        raise ValueError("must be an http(s) URL with a host, a port from 1 to 65535 if any, only printable ASCII "
                         "(percent-encode the rest) and no #fragment")
    return v


WebhookUrl = Annotated[str, Field(min_length=1, max_length=2048, json_schema_extra={"pattern": WEBHOOK_URL_PATTERN}),
                       AfterValidator(_webhook_url)]


def _at(model: str, field: str, value: Any, message: str) -> ValidationError:
    """A rule between fields, reported at the field it names (pydantic prefixes the enclosing fields' path)."""
    return ValidationError.from_exception_data(model, [InitErrorDetails(
        type=PydanticCustomError("value_error", "{message}", {"message": message}), loc=(field,), input=value)])


class _Strict(BaseModel):
    # NaN and Infinity are refused: Postgres JSONB cannot hold them and no training knob means them.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _integers(cls, data: Any) -> Any:
        return refuse_lax_integers(cls, data)


class ModelSpec(_Strict):
    """A model by hub id (`org/name`), by a path under the configured model root, by a succeeded job of the
    caller's (`job_…`), whose exported weights and tokenizer it continues from, or by a committed checkpoint of a
    job of the caller's (`job_…@step-N`), whose weights at that step it continues from."""

    # PATH_MAX: the API rewrites a local model to its absolute path, which the trainer validates again.
    name_or_path: Text = Field(min_length=1, max_length=MAX_PATH_CHARS)
    revision: Text | None = Field(default=None, min_length=1, max_length=200)
    trust_remote_code: StrictBool = False
    init: Literal["pretrained", "random"] = Field(
        default="pretrained", description="random: the model's config with freshly initialised weights")
    attn_implementation: Literal["auto", "sdpa", "flex_attention", "eager"] = Field(
        default="auto", description="auto: on CUDA in bf16/fp16, FlashAttention's variable-length kernel over each "
                                    "packed document for Llama-family models; sdpa otherwise")
    kernels: Literal["auto", "torch"] = Field(
        default="auto", description="auto: on CUDA, Liger's fused RMSNorm, rotary, SwiGLU and linear+cross-entropy "
                                    "kernels for Llama-family full fine-tunes where liger-kernel is installed (the "
                                    "`gpu` extra); torch: the model's own modules. The started event says what ran")

    @field_validator("name_or_path")
    @classmethod
    def _checkpoint_spelling(cls, v: str) -> str:
        if v.startswith(JOB_ID_PREFIX) and "@" in v and checkpoint_ref(v) is None:
            raise ValueError(f"{v!r} is no checkpoint of a job: name one as `<job id>{CHECKPOINT_MARK}<step>`, "
                             f"e.g. job_0123456789abcdef0123{CHECKPOINT_MARK}100 (GET /jobs/{{id}}/checkpoints "
                             "lists the committed steps)")
        return v


# What `POST /files` names its files; a data field holding one is a file of the store, not a path.
FILE_ID_PREFIX = "file_"


def is_file_id(value: str) -> bool:
    return value.startswith(FILE_ID_PREFIX) and "/" not in value


# A model named so is the export of a succeeded job of the caller's: continued fine-tuning.
JOB_ID_PREFIX = "job_"
# `job_…@step-N`: the checkpoint a job committed at step N (the store's tag, store/checkpoints.py `tag_for`).
CHECKPOINT_MARK = "@step-"
_CHECKPOINT_REF = re.compile(rf"^({JOB_ID_PREFIX}[A-Za-z0-9_-]{{1,40}}){re.escape(CHECKPOINT_MARK)}([0-9]{{1,12}})$")


def is_job_id(value: str) -> bool:
    return value.startswith(JOB_ID_PREFIX) and "/" not in value and "@" not in value


def checkpoint_ref(value: str) -> tuple[str, int] | None:
    """(job id, step) of a model named as a job's checkpoint (`job_…@step-N`), or None."""
    found = _CHECKPOINT_REF.match(value)
    return (found.group(1), int(found.group(2))) if found else None


def checkpoint_name(job_id: str, step: int) -> str:
    return f"{job_id}{CHECKPOINT_MARK}{step}"


class DataSpec(_Strict):
    train: Text = Field(min_length=1, max_length=MAX_PATH_CHARS,
                        description="Training data: a file id (`file_…`, from POST /files) of the caller's that "
                                    "is processed, or a path under the data root")
    validation: Text | None = Field(default=None, min_length=1, max_length=MAX_PATH_CHARS,
                                    description="Validation data: a processed file id of the caller's, or a path "
                                                "under the data root")
    validation_fraction: StrictFloat = Field(default=0.0, ge=0.0, lt=0.5)
    format: Literal["text", "jsonl", "chat", "completion", "preference"] = Field(
        default="text", description="For a file id, the file's own format when unset (and it must agree when set); "
                                    "preference pairs are what a `method.type: dpo` job trains on, and only it")
    text_field: Text = Field(default="text", min_length=1, max_length=200, description="JSONL field holding the text")
    packing: StrictBool = True


# A batch field's bound as the schema states it (`_positive_batch` checks it with its own message).
_BATCH_OR_AUTO = [{"type": "integer", "minimum": 1, "maximum": MAX_BATCH}, {"const": "auto"}]


class Hyperparameters(_Strict):
    max_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    epochs: StrictFloat = Field(default=1.0, gt=0, le=1000)
    learning_rate: StrictFloat = Field(default=1e-4, gt=0, le=1.0)
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    min_lr_ratio: StrictFloat = Field(default=0.0, ge=0.0, le=1.0)
    weight_decay: StrictFloat = Field(default=0.0, ge=0.0, le=1.0)
    adam_betas: tuple[Beta, Beta] = Field(default=(0.9, 0.95), description="Each from 0 up to (not including) 1")
    gradient_clipping: StrictFloat = Field(default=1.0, ge=0.0, le=1_000_000.0, description="0 turns clipping off")
    global_batch_size: int = Field(default=32, ge=1, le=MAX_BATCH, description=(
        "Rows (packed sequences of seq_len tokens, or one example each without packing) per optimizer step. Data "
        "that makes fewer rows runs with the global batch clamped to what it makes, said in a `resolved` event"))
    examples_per_step: Annotated[int | Literal["auto"] | None, WithJsonSchema(
        {"anyOf": [*_BATCH_OR_AUTO, {"type": "null"}]})] = Field(default=None, description=(
        f"Examples per optimizer step (what OpenAI's batch_size counts), 1 to {MAX_BATCH} or \"auto\" (about 0.2% "
        f"of the training examples, 1 to {MAX_AUTO_EXAMPLES_PER_STEP}). When set the trainer chooses "
        "global_batch_size from the data's token counts (the rows that many examples pack into) and says so in a "
        "`resolved` event; global_batch_size may not be given as well"))
    micro_batch_size: Annotated[int | Literal["auto"], WithJsonSchema({"anyOf": _BATCH_OR_AUTO})] = Field(
        default="auto", description=f'1 to {MAX_BATCH}, or "auto"')
    seq_len: int = Field(default=2048, ge=8, le=131_072)
    seed: int = Field(default=42, ge=0, le=MAX_SEED, description="0 to 2**32 - 1 (what numpy accepts)")
    eval_every_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    optimizer: Literal["adamw", "adamw_bf16"] = Field(
        default="adamw",
        description="adamw: DeepSpeed's AdamW with fp32 master weights and moments (16 bytes of optimizer state per "
                    "trained parameter); adamw_bf16: master weights and both moments in bf16, each written back with "
                    "stochastic rounding (6 bytes), for full fine-tunes of models that do not fit otherwise; needs "
                    'precision "bf16", ZeRO stage 1-3 and no optimizer offload')

    @field_validator("micro_batch_size", "examples_per_step")
    @classmethod
    def _positive_batch(cls, v: int | str | None) -> int | str | None:
        if isinstance(v, int) and not 1 <= v <= MAX_BATCH:
            raise ValueError(f'must be an integer from 1 to {MAX_BATCH} or "auto"')
        return v


class DeepSpeedOptions(_Strict):
    zero_stage: ZeroStage = 2
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    offload_optimizer: Offload = "none"
    offload_param: Offload = "none"
    nvme_path: Text | None = Field(default=None, min_length=1, max_length=MAX_PATH_CHARS,
                                   description="Directory under the NVMe root for offload")
    activation_checkpointing: StrictBool = False
    compile: Literal["auto", "on", "off"] = Field(
        default="auto", description="torch.compile: for Llama-family models the RMSNorm, rotary and SwiGLU math where "
                                    "Liger's kernels do not already fuse it, for other models each transformer block "
                                    "(under ZeRO-3 only when on); auto: on CUDA without LoRA")
    config: RawConfig | None = Field(
        default=None,
        description=f"A raw DeepSpeed config, read as the pinned DeepSpeed reads it (its names, aliases, types and "
                    "defaults) and merged; unrun features and fields that write files, open connections or import "
                    "code are refused with the reason, and every difference from DeepSpeed's reading is in "
                    f"resolved.notes; at most {RAW_CONFIG_MAX_BYTES} "
                    f"bytes of JSON, nested at most {RAW_CONFIG_MAX_DEPTH} levels, at most {RAW_CONFIG_MAX_KEYS} "
                    "keys per object")

    @model_validator(mode="after")
    def _param_offload_needs_stage3(self) -> DeepSpeedOptions:
        # Located at the field, so the API's 422 names deepspeed.offload_param, not the whole section.
        if self.offload_param != "none" and self.zero_stage != 3:
            raise _at("DeepSpeedOptions", "offload_param", self.offload_param,
                      "offload_param needs zero_stage 3: only stage 3 partitions the parameters, so stages "
                      f"0-2 cannot offload them (got zero_stage {self.zero_stage}); set zero_stage to 3 or "
                      'offload_param to "none"')
        if "nvme" in (self.offload_optimizer, self.offload_param) and not self.nvme_path:
            raise _at("DeepSpeedOptions", "nvme_path", self.nvme_path,
                      'offloading to "nvme" needs nvme_path, a directory under the NVMe root')
        return self


class Resources(_Strict):
    num_gpus: int = Field(default=1, ge=1, le=64, description="Launcher processes per node")
    num_nodes: int = Field(default=1, ge=1, le=64, description=(
        "Nodes of the job, each running num_gpus processes (world size num_nodes × num_gpus); placed all at once "
        "or not at all"))
    queue: str = Field(default="default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    priority: int = Field(default=0, ge=-1000, le=1000,
                          description="Higher runs first; among equal priorities the oldest job first, owners "
                                      "taking turns")
    time_limit_seconds: int = Field(default=24 * 3600, ge=10, le=30 * 24 * 3600)
    on_oom: Literal["fail", "adapt"] = Field(
        default="fail",
        description="fail: a GPU out-of-memory error fails the job; adapt: an out-of-memory error during setup or the "
                    "first optimizer steps restarts the attempt in place with the next setting of the ladder (a "
                    "smaller micro batch with more accumulation, the same global batch; then activation "
                    "checkpointing; then the optimizer offloaded to the CPU), reported in `adapted` events")
    pipeline_stages: int = Field(
        default=1, ge=1, le=64,
        description="Pipeline parallelism: the model's layers split into this many consecutive stages (DeepSpeed's "
                    "pipeline engine, micro batches = gradient accumulation steps); world size = stages × "
                    "data-parallel degree. Above 1: Llama, Mistral, Qwen2 and Qwen3 decoders, ZeRO stage 0 or 1 "
                    '(1 unless deepspeed.zero_stage says otherwise), no LoRA, on_oom "fail"')
    pipeline_partition: Literal["parameters", "uniform"] = Field(
        default="parameters", description="How layers are spread over the stages: parameters (balanced parameter "
                                          "counts) or uniform (balanced layer counts)")


class Checkpointing(_Strict):
    every_steps: int | None = Field(default=None, ge=1, le=MAX_STEPS)
    keep_last: int = Field(default=2, ge=1, le=100)


class LoraSpec(_Strict):
    rank: int = Field(default=8, ge=1, le=1024)
    alpha: StrictFloat = Field(default=16.0, gt=0, le=65_536.0)
    dropout: StrictFloat = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: ModuleNames | Literal["all-linear"] = Field(
        default="all-linear", description="1 to 64 module names of 1 to 200 characters each, or all-linear")
    merge_on_export: StrictBool = False

    @field_validator("target_modules")
    @classmethod
    def _module_names(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, str):
            return v
        if not 1 <= len(v) <= 64:
            raise ValueError(f'must list 1 to 64 module names (got {len(v)}), or be "all-linear"')
        for name in v:
            if not 1 <= len(name) <= 200:
                raise ValueError("each module name must have 1 to 200 characters")
            _storable(name)
        return v


class Notifications(_Strict):
    """Whom the service tells about the job. The API's alone (core/webhooks.py): the trainer ignores it."""

    webhook_url: WebhookUrl | None = Field(
        default=None,
        description="An http(s) URL the service POSTs each state change and committed checkpoint to, signed with "
                    "the owner's webhook secret (README, Webhooks); its host must resolve to public addresses only, "
                    "unless the operator allows a range; null: the owner's default URL, if one is set")


def _or_model_name(schema: dict[str, Any]) -> None:
    # A bare string is read as {"name_or_path": ...} (JobSpec._model_from_string); the schema says so.
    spec = {k: schema.pop(k) for k in ("$ref", "allOf") if k in schema}
    schema["anyOf"] = [spec, {"type": "string", "minLength": 1, "maxLength": MAX_PATH_CHARS,
                              "description": "The same as {\"name_or_path\": ...}"}]


class DpoSpec(_Strict):
    """Direct preference optimisation (docs/preference.md): the model learns to rank each pair's chosen answer above
    its rejected one, measured against a reference model. The loss is trl's `DPOTrainer`'s, term for term."""

    beta: StrictFloat = Field(default=0.1, gt=0.0, le=100.0, description=(
        "How far the model may move from the reference: larger keeps it closer (0 < beta ≤ 100)"))
    loss: Literal["sigmoid", "ipo"] = Field(default="sigmoid", description=(
        "sigmoid: the DPO paper's loss; ipo: the IPO loss, on per-token averages of the log-probabilities"))
    sft_weight: StrictFloat = Field(default=0.0, ge=0.0, le=100.0, description=(
        "Weight of a supervised term on the chosen answers (their per-token negative log-likelihood) added to the "
        "loss; 0 turns it off"))
    length_normalization: StrictBool = Field(default=False, description=(
        "Compare per-token averages of the log-probabilities instead of their sums, so a longer answer is not "
        "favoured for its length (IPO always does)"))
    reference: Literal["auto", "adapters_off", "precomputed", "none"] = Field(default="auto", description=(
        "The reference model: adapters_off (LoRA only: the base model with the adapters disabled, no second "
        "copy); precomputed (the reference log-probabilities of every pair computed in one pass before training "
        "and kept with the job's checkpoints); none (reference-free); auto: adapters_off with LoRA, else "
        "precomputed"))


class MethodSpec(_Strict):
    """How the job trains: on demonstrations (supervised) or on preference pairs (dpo)."""

    type: Method = Method.SUPERVISED
    dpo: DpoSpec | None = Field(default=None, description="The preference method's settings (type dpo only)")

    @model_validator(mode="after")
    def _settings_of_its_type(self) -> MethodSpec:
        if self.type == Method.DPO and self.dpo is None:
            self.dpo = DpoSpec()
        elif self.type != Method.DPO and self.dpo is not None:
            raise _at("MethodSpec", "dpo", self.dpo, f"is for method.type {Method.DPO.value!r}; this job's "
                                                             f"type is {self.type.value!r}")
        return self


def _method_schema() -> dict[str, Any]:
    """MethodSpec as the schema states it: each type with only its own settings, so a generated request that the
    schema allows is one the validator accepts (a dpo object on a supervised job is refused)."""
    dpo = DpoSpec.model_json_schema()
    return {"description": MethodSpec.__doc__, "oneOf": [
        {"type": "object", "title": "Supervised", "additionalProperties": False,
         "properties": {"type": {"const": Method.SUPERVISED.value}, "dpo": {"type": "null"}}},
        {"type": "object", "title": "Dpo", "additionalProperties": False, "required": ["type"],
         "properties": {"type": {"const": Method.DPO.value},
                        "dpo": {"anyOf": [{**dpo, "title": "DpoSpec"}, {"type": "null"}]}}}]}


class Shown(_Strict):
    """The fields of a request that every job response shows as they were sent: api/schemas.py's JobSummary takes
    them from here, and db/reads.py's SUMMARY_FIELDS names their columns (CONTRIBUTING.md)."""

    name: Text = Field(default="", max_length=200)
    description: Text | None = Field(default=None, max_length=2000, description=(
        "What the job is for, in a sentence or a paragraph: shown with the job in every response and list"))
    metadata: Metadata = Field(
        default_factory=dict,
        description=f"Free-form JSON object kept with the job: at most {METADATA_MAX_BYTES} bytes of JSON, nested at "
                    f"most {METADATA_MAX_DEPTH} levels, at most {METADATA_MAX_KEYS} keys per object, keys at most "
                    f"{METADATA_MAX_KEY_CHARS} characters, no NUL characters")


class JobSpec(Shown):
    """What a client sends in `POST /jobs` (and what `python -m trainer` runs from)."""

    model: ModelSpec = Field(json_schema_extra=_or_model_name)
    data: DataSpec
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    deepspeed: DeepSpeedOptions = Field(default_factory=DeepSpeedOptions)
    resources: Resources = Field(default_factory=Resources)
    checkpointing: Checkpointing = Field(default_factory=Checkpointing)
    lora: LoraSpec | None = None
    notifications: Notifications | None = None
    method: Annotated[MethodSpec, WithJsonSchema(_method_schema())] = Field(default_factory=MethodSpec)

    @field_validator("model", mode="before")
    @classmethod
    def _model_from_string(cls, v: Any) -> Any:
        return {"name_or_path": v} if isinstance(v, str) else v

    @model_validator(mode="after")
    def _method_rules(self) -> JobSpec:
        """What a method asks of the rest of the job, each refusal at the field to change."""
        problems: list[tuple[tuple[str, ...], Any, str]] = []
        fmt_given = "format" in self.data.model_fields_set
        preference = DataFormat.PREFERENCE.value
        if self.method.type == Method.DPO:
            if not fmt_given:
                # A file id's own format still decides (api/services/inputs.py); it must then be preference.
                self.data.format = preference  # type: ignore[assignment]
                self.data.__pydantic_fields_set__.discard("format")
            elif self.data.format != preference:
                problems.append((("data", "format"), self.data.format, (
                    f"is {self.data.format!r}, but a dpo job trains on preference pairs: set data.format to "
                    f"{preference!r} (or leave it unset for a file id)")))
            dpo = self.method.dpo
            if dpo is not None and dpo.reference == "adapters_off" and self.lora is None:
                problems.append((("method", "dpo", "reference"), dpo.reference,
                                 "is 'adapters_off', which needs lora: without adapters there is nothing to turn "
                                 "off; use 'precomputed' or 'auto'"))
            if self.resources.pipeline_stages > 1:
                problems.append((("resources", "pipeline_stages"), self.resources.pipeline_stages,
                                 "must be 1 for a dpo job: the pipeline stages run the supervised loss only"))
        elif fmt_given and self.data.format == preference:
            problems.append((("data", "format"), self.data.format, (
                "is 'preference', which trains a dpo job only: set method.type to 'dpo', or give a file of "
                "demonstrations (chat, completion, jsonl or text)")))
        if problems:
            raise ValidationError.from_exception_data("JobSpec", [InitErrorDetails(
                type=PydanticCustomError("value_error", "{message}", {"message": m}), loc=loc, input=v)
                for loc, v, m in problems])
        return self

    @model_validator(mode="after")
    def _pipeline_rules(self) -> JobSpec:
        if self.resources.pipeline_stages > 1 and "zero_stage" not in self.deepspeed.model_fields_set:
            # The usual default, stage 2, is one the pipeline engine cannot run; stage 1 is the one it can.
            self.deepspeed.zero_stage = 1
            # Still the default: a raw config's zero_optimization.stage may set it (checked again after the merge).
            self.deepspeed.__pydantic_fields_set__.discard("zero_stage")
        problems = spec_problems(self.resources.pipeline_stages, self.resources.num_gpus * self.resources.num_nodes,
                                 self.deepspeed.zero_stage, self.lora is not None, self.resources.on_oom,
                                 self.model.trust_remote_code)
        if problems:
            # Located at the field, so the API's 422 names resources.pipeline_stages rather than the body.
            raise ValidationError.from_exception_data("JobSpec", [InitErrorDetails(
                type=PydanticCustomError("value_error", "{message}", {"message": m}),
                loc=("resources", "pipeline_stages"), input=self.resources.pipeline_stages) for m in problems])
        return self


class StoredInput(_Strict):
    """A stored file a job reads, as the submit found it: each node fetches it by key into its cache and checks
    the bytes against `sha256`, so a job reads exactly what was validated."""

    file_id: str
    key: str
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class StoredModelFile(_Strict):
    path: str = Field(min_length=1, description="Where the file lies in the model's folder")
    key: str
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class StoredModel(_Strict):
    """The base model of a continued fine-tune, as the submit found it in the store: the export of `job_id`, or
    with `step`, the files of its checkpoint at that step (DeepSpeed's state and the model's config and
    tokenizer), which each node turns into a model folder (worker/from_checkpoint.py)."""

    job_id: str
    step: int | None = Field(default=None, ge=0)
    files: list[StoredModelFile] = Field(min_length=1)


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
    # The stored files of the spec's data fields, by field ("data.train", "data.validation").
    inputs: dict[str, StoredInput] = Field(default_factory=dict)
    # The model, where the spec names a succeeded job of the caller's (`"model": "job_…"`) or a checkpoint of a
    # job of the caller's (`"model": "job_…@step-N"`).
    base_model: StoredModel | None = None


class StoreRef(_Strict):
    """The artifact store the trainer commits checkpoints to, its config whole (contract/storage.py); credentials
    come from the inherited AWS_* environment, never from this file."""

    config: StoreConfig
    job_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,40}$", description="Whose keys: jobs/<job id>/ in the store")


class RunPaths(_Strict):
    """Where one attempt of a job reads and writes; all under the job's directory."""

    job_dir: str
    checkpoint_dir: str
    output_dir: str
    model_root: str | None = None
    data_root: str | None = None
    # Set by the worker; null for a trainer run by hand, whose checkpoints stay on its disk only.
    store: StoreRef | None = None


class GangMember(_Strict):
    node: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    devices: list[str] = Field(min_length=1, max_length=1024)


class NodeShare(_Strict):
    """One node's part of a placed job, as the control plane chose it (controlplane/scheduler.py)."""

    node: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    devices: list[str] = Field(min_length=1, max_length=1024,
                               description="The node's device ids for this job: GPU ids, or CPU process slots")
    kind: str = "cpu"
    node_rank: int = Field(default=0, ge=0)
    num_nodes: int = Field(default=1, ge=1)
    master_addr: str = "127.0.0.1"
    master_port: int | None = Field(default=None, ge=1, le=65535)
    # Every node of a multi-node job in node-rank order (each node writes the same hostfile); empty for one node.
    gang: list[GangMember] = Field(default_factory=list, max_length=64)


class AttemptOrder(_Strict):
    """What the control plane sends each node of a placed attempt: the resolved job, which attempt, and the node's
    share. Where the attempt reads and writes is the node's own choice (worker/attempt.py `node_paths`)."""

    job: ResolvedJob
    attempt: int = Field(ge=1)
    placement: NodeShare | None = None


class RunSpec(_Strict):
    """The file handed to `python -m trainer --spec`: the resolved job plus where to write."""

    job: ResolvedJob
    paths: RunPaths
    attempt: int = 1
    # Null when the trainer is run by hand: one node, every device the launcher was given.
    placement: NodeShare | None = None
