"""The body of `POST /v1/fine_tuning/jobs` as OpenAI defines it (openai/types/fine_tuning/job_create_params.py),
strict like every body of the service, and its mapping onto the native job spec (contract/spec.py): the
deployment's defaults (FT_OPENAI_JOB_DEFAULTS) first, then what the body says. The mapping is in docs/openai.md.
"""

from __future__ import annotations

import enum
import json
from typing import Annotated, Any

from annotated_types import Le
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from api.errors import ApiError, ErrorCode, invalid
from contract.codes import Method as NativeMethod
from contract.problems import FieldError
from contract.spec import MAX_SEED, DpoSpec, Hyperparameters, JobSpec, refuse_lax_integers

AUTO = "auto"
# OpenAI's own bounds: a value past them is refused there too.
MAX_EPOCHS = 50
MAX_BATCH_SIZE = 256
MAX_LR_MULTIPLIER = 10.0
# OpenAI takes any positive multiplier; a smaller one than this would make the learning rate underflow towards 0.
MIN_LR_MULTIPLIER = 1e-6
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
# OpenAI states no upper bound for beta; the trainer's is the one that holds (contract/spec.py DpoSpec.beta).
MAX_BETA = next(float(m.le) for m in DpoSpec.model_fields["beta"].metadata if isinstance(m, Le))
# The suffix is one part of a `:`-separated model name and of a URL path: no `:`, `/` or spaces.
SUFFIX_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class MethodType(str, enum.Enum):
    def __str__(self) -> str:
        return str(self.value)

    SUPERVISED = "supervised"
    DPO = "dpo"
    REINFORCEMENT = "reinforcement"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _auto_or(low: float, high: float, *, integer: bool, above_low: bool = False) -> Any:
    """`"auto"` or a number within OpenAI's bounds, refused with one message (a union's would give two);
    `above_low`: `low` itself is refused too."""
    kind = "an integer" if integer else "a number"
    span = f"above {low:g} and at most {high:g}" if above_low else f"from {low:g} to {high:g}"

    def check(value: Any) -> Any:
        if value == AUTO:
            return value
        if integer and isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON has one number type: 3.0 is the integer 3, as the schema's `integer` says
        number = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not number or not (low < value if above_low else low <= value) \
                or not value <= high:
            raise ValueError(f'must be "auto" or {kind} {span}, got {json.dumps(value)[:40]}')
        return value

    bound = {"exclusiveMinimum": low} if above_low else {"minimum": low}
    schema = {"anyOf": [{"const": AUTO}, {"type": "integer" if integer else "number", **bound, "maximum": high}]}
    return Annotated[Any, BeforeValidator(check), WithJsonSchema(schema)]


class OpenAIHyperparameters(_Strict):
    n_epochs: _auto_or(1, MAX_EPOCHS, integer=True) = AUTO  # type: ignore[valid-type]
    batch_size: _auto_or(1, MAX_BATCH_SIZE, integer=True) = AUTO  # type: ignore[valid-type]
    learning_rate_multiplier: _auto_or(MIN_LR_MULTIPLIER, MAX_LR_MULTIPLIER, integer=False) = AUTO  # type: ignore[valid-type]


class DpoHyperparameters(OpenAIHyperparameters):
    beta: _auto_or(0, MAX_BETA, integer=False, above_low=True) = AUTO  # type: ignore[valid-type]


class Supervised(_Strict):
    hyperparameters: OpenAIHyperparameters | None = None


class Dpo(_Strict):
    hyperparameters: DpoHyperparameters | None = None


def _only_its_own(kind: MethodType) -> dict[str, Any]:
    """The schema of a method of type `kind`: the other method's settings, if named, are null."""
    others = {o.value: {"type": "null"} for o in (MethodType.SUPERVISED, MethodType.DPO) if o != kind}
    return {"properties": {"type": {"const": kind.value}, **others}}


class Method(_Strict):
    # The schema states what is accepted (chosen_hyperparameters refuses the rest by name, with why): one of the two
    # methods, with its own settings and not the other's.
    model_config = ConfigDict(json_schema_extra={"oneOf": [_only_its_own(MethodType.SUPERVISED),
                                                           _only_its_own(MethodType.DPO)]})

    type: Annotated[MethodType, WithJsonSchema({
        "type": "string", "enum": [MethodType.SUPERVISED.value, MethodType.DPO.value],
        "description": "supervised or dpo; reinforcement is refused, naming method.type"})]
    supervised: Supervised | None = None
    dpo: Dpo | None = None
    # Named so its refusal names `method.type`, not an unknown field.
    reinforcement: Annotated[dict[str, Any] | None, WithJsonSchema({
        "type": "null", "description": "reinforcement is refused, naming method.type"})] = None


class FineTuningJobCreate(_Strict):
    model: str = Field(min_length=1, max_length=4096)
    training_file: str = Field(min_length=1, max_length=4096)
    validation_file: str | None = Field(default=None, min_length=1, max_length=4096)
    suffix: str | None = Field(default=None, pattern=SUFFIX_PATTERN, description=(
        "Up to 64 letters, digits, '.', '_' or '-', starting with a letter or digit: part of the model's name"))
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    metadata: dict[str, Annotated[str, Field(max_length=MAX_METADATA_VALUE)]] | None = Field(
        default=None, json_schema_extra={"maxProperties": MAX_METADATA_PAIRS,
                                         "propertyNames": {"maxLength": MAX_METADATA_KEY}})
    hyperparameters: OpenAIHyperparameters | None = None
    method: Method | None = None
    integrations: Annotated[list[dict[str, Any]] | None, WithJsonSchema({
        "anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}],
        "description": "None supported: null or []; a listed integration is refused, naming integrations"})] = None

    @model_validator(mode="before")
    @classmethod
    def _integers_only(cls, data: Any) -> Any:
        return refuse_lax_integers(cls, data)

    @field_validator("metadata")
    @classmethod
    def _pairs(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            if len(value) > MAX_METADATA_PAIRS:
                raise ValueError(f"has {len(value)} pairs; at most {MAX_METADATA_PAIRS} are accepted")
            if any(len(k) > MAX_METADATA_KEY for k in value):
                raise ValueError(f"has a key longer than {MAX_METADATA_KEY} characters")
        return value


def bad_request(param: str, message: str) -> ApiError:
    """A refusal naming the OpenAI parameter at fault: the native 422 shape, which /v1 answers as OpenAI's 400."""
    return invalid([FieldError(param, message)])


# OpenAI's methods this service trains, as the native contract names them (contract/codes.py Method).
TRAINED = {MethodType.SUPERVISED: NativeMethod.SUPERVISED, MethodType.DPO: NativeMethod.DPO}


def method_type(body: FineTuningJobCreate) -> MethodType:
    return body.method.type if body.method is not None else MethodType.SUPERVISED


def chosen_hyperparameters(body: FineTuningJobCreate) -> tuple[OpenAIHyperparameters, str]:
    """The hyperparameters the body gives, and where it gives them (the param to name for their problems); a dpo
    job's are DpoHyperparameters. Refuses what the service does not train before anything is looked up."""
    method, kind = body.method, method_type(body)
    if body.integrations:
        raise bad_request("integrations", "integrations are not supported by this service; leave them out "
                                          "(metrics are in the job's events)")
    if kind not in TRAINED:
        raise bad_request("method.type", f"{kind.value!r} fine-tuning is not supported by this service; only "
                                         f"{' and '.join(repr(t.value) for t in TRAINED)} are")
    for other in MethodType:
        if other != kind and method is not None and getattr(method, other.value) is not None:
            raise bad_request(f"method.{other.value}", f"holds the settings of method.type {other.value!r}; this "
                                                       f"job's method.type is {kind.value!r}")
    settings = getattr(method, kind.value) if method is not None else None
    under_method = settings.hyperparameters if settings is not None else None
    if under_method is not None and body.hyperparameters is not None:
        raise bad_request("hyperparameters", "give the hyperparameters either at the top level or under "
                                             f"method.{kind.value}, not both")
    if under_method is not None:
        return under_method, f"method.{kind.value}.hyperparameters"
    top = body.hyperparameters or OpenAIHyperparameters()
    # The top level has no beta: a dpo job given its hyperparameters there takes the default beta.
    return (DpoHyperparameters(**top.model_dump()) if kind == MethodType.DPO else top), "hyperparameters"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_defaults(text: str) -> dict[str, Any]:
    return json.loads(text) if text.strip() else {}


# The fields a /v1 job takes from its body; the defaults may not set them. (They may set method.dpo's other
# settings, `loss` or `reference`, which a dpo job then takes; a supervised job ignores them.)
FROM_THE_BODY = ("model", "name", "metadata", "data.train", "data.validation", "data.format", "method.type")


def defaults_problem(text: str) -> str | None:
    """Why FT_OPENAI_JOB_DEFAULTS cannot be the base of a job, or None."""
    try:
        found = parse_defaults(text)
    except ValueError as exc:
        return f"is not JSON: {exc}"
    if not isinstance(found, dict):
        return "must be a JSON object: a partial job spec, as POST /jobs takes it"
    nested = {f"{top}.{k}" for top in ("data", "method") if isinstance(found.get(top), dict) for k in found[top]}
    if any(k in found or k in nested for k in FROM_THE_BODY):
        return f"may not set {', '.join(FROM_THE_BODY)}: each /v1 job takes them from its body"
    probe = _merge(found, {"model": "m", "data": {"train": "t"}})
    if isinstance(found.get("method"), dict):
        probe["method"] = {**found["method"], "type": NativeMethod.DPO.value}  # only a dpo job takes them
    try:
        JobSpec.model_validate(probe)
    except ValidationError as exc:
        return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
    return None


def default_learning_rate(defaults: dict[str, Any]) -> float:
    """The rate a learning_rate_multiplier of 1 means: the deployment's default, or the service's."""
    rate = defaults.get("hyperparameters", {}).get("learning_rate")
    return float(rate) if rate is not None else float(Hyperparameters.model_fields["learning_rate"].default)


def native_spec(body: FineTuningJobCreate, *, model: str, defaults: dict[str, Any]) -> tuple[JobSpec, str]:
    """The native spec of an OpenAI body, over the deployment's defaults; `model` is the native model name (a
    fine-tuned model's name already turned into its job's id). Returns it with the hyperparameters' param.
    Unset values (`"auto"`, no seed) are left to the defaults: `auto` epochs, batch size and learning rate are the
    deployment's or the service's, and a missing seed is the service's fixed default, so that a retry is the
    same request (Idempotency-Key) and a job can be run again alike."""
    chosen, param = chosen_hyperparameters(body)
    hp: dict[str, Any] = {}
    if chosen.n_epochs != AUTO:
        hp["epochs"] = float(chosen.n_epochs)
    # OpenAI's batch_size counts examples; the trainer turns them into rows from the data (trainer/batching.py).
    hp["examples_per_step"] = chosen.batch_size
    if chosen.learning_rate_multiplier != AUTO:
        hp["learning_rate"] = float(chosen.learning_rate_multiplier) * default_learning_rate(defaults)
    if body.seed is not None:
        hp["seed"] = body.seed
    # The format is left out: a file's own (chat, for a chat file) is taken (api/services/inputs.py), which must be
    # the method's (preference for dpo), or the submit refuses it naming the file.
    data: dict[str, Any] = {"train": body.training_file, "validation": body.validation_file}
    request = _merge(defaults, {"name": body.suffix or "", "model": model, "data": data, "hyperparameters": hp,
                                "metadata": body.metadata or {}})
    # A deployment's default global batch counts rows, which this job's batch in examples replaces.
    request["hyperparameters"].pop("global_batch_size", None)
    request["method"] = native_method(body, chosen, defaults)
    try:
        return JobSpec.model_validate(request), param
    except ValidationError as exc:
        raise invalid([FieldError(openai_param(".".join(str(p) for p in e["loc"]), param),
                                  str(e["msg"]).removeprefix("Value error, ")) for e in exc.errors()]) from None


def native_method(body: FineTuningJobCreate, chosen: OpenAIHyperparameters, defaults: dict[str, Any]) -> dict[str, Any]:
    """The native `method` of the body's: its type, and for dpo the deployment's dpo settings with the body's beta
    (`"auto"`: the deployment's beta, else the trainer's default)."""
    kind = TRAINED[method_type(body)]
    if kind != NativeMethod.DPO:
        return {"type": kind.value}
    dpo = dict((defaults.get("method") or {}).get("dpo") or {})
    beta = chosen.beta if isinstance(chosen, DpoHyperparameters) else AUTO
    if beta != AUTO:
        dpo["beta"] = float(beta)
    return {"type": kind.value, "dpo": dpo}


# Native fields (as a native 422 names them) and the OpenAI params they come from.
PARAMS = {"model.name_or_path": "model", "model": "model", "data.train": "training_file",
          "data.validation": "validation_file", "data.format": "training_file", "name": "suffix",
          "metadata": "metadata", "hyperparameters.seed": "seed",
          # OpenAI's body has no length: the deployment's (FT_OPENAI_JOB_DEFAULTS) leaves no pair of the file room.
          "hyperparameters.seq_len": "training_file"}
HYPERPARAMETERS = {"hyperparameters.epochs": "n_epochs", "hyperparameters.examples_per_step": "batch_size",
                   "hyperparameters.learning_rate": "learning_rate_multiplier", "method.dpo.beta": "beta"}


def openai_param(field: str, hyperparameters_param: str = "hyperparameters") -> str:
    if field in HYPERPARAMETERS:
        return f"{hyperparameters_param}.{HYPERPARAMETERS[field]}"
    return PARAMS.get(field, field)


def renamed(exc: ApiError, hyperparameters_param: str) -> ApiError:
    """A native refusal of the mapped spec, its fields named as the OpenAI body names them."""
    if exc.status != 422 or exc.code != ErrorCode.INVALID_REQUEST:
        return exc
    problems = exc.details or [{"field": exc.field or "body", "message": exc.message}]
    return invalid([FieldError(openai_param(p["field"], hyperparameters_param), p["message"]) for p in problems])
