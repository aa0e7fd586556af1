"""Wire contract of the experience pool service.

This module is the one piece shared by the service and its clients, so it imports nothing but
pydantic, numpy and the standard library. All models are strict: a JSON `false` is not a float, a string
is not an int, and unknown fields are refused, so a typo in a request is an error, not a silent
default. Payload arrays (token ids, log-probs) travel either as JSON lists (easy with curl) or as
base64 of little-endian packed arrays (int32 ids, float32 log-probs), which is what the SDK sends.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar, cast

import numpy as np
import numpy.typing as npt
import pybase64
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import InitErrorDetails, SchemaValidator, from_json

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
#: Steps and policy versions are 32-bit columns, row ids 64-bit: JSON integers are unbounded.
Int32 = Annotated[int, Field(ge=0, le=2**31 - 1)]
RowId = Annotated[int, Field(ge=0, le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Weighting = Literal["normal", "linear", "sqrt", "linear_clip", "uniform"]
Phase = Literal["on_policy", "mixed"]
Sharing = Literal["per_run", "pooled", "shared_trajectories"]
"""What the runs of one pool share (never anything across pools). `per_run`: nothing; each run has
its own buckets, retirement and trajectories. `pooled`: buckets, retirement and trajectories.
`shared_trajectories`: trajectories only (buckets and retirement per run)."""
CandidateMode = Literal["all", "lowest_stored_entropy", "none"]
BatchStatus = Literal["planned", "committed", "abandoned"]
TaskStatus = Literal["pending", "leased", "completed", "failed"]

MAX_TOKENS_PER_TRAJECTORY = 65_536
#: The most characters of a rollout's text (its response, decoded).
MAX_TEXT_CHARS = 1_000_000


# ------------------------------------------------------------------------ text and free-form JSON
# One rule for both storage backends: what Postgres cannot hold is refused on the wire (422 naming
# the field), so SQLite, which would store it, answers the same.
NUL_MESSAGE = "must not contain NUL characters (\\u0000): no database column holds them"
NO_NUL_PATTERN = "^[^\\u0000]*$"
#: How deep free-form JSON (question metadata) may nest.
MAX_JSON_DEPTH = 32


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError(NUL_MESSAGE)
    return value


#: Every string field of a request: any text but NUL.
Text = Annotated[str, AfterValidator(_no_nul), Field(json_schema_extra={"pattern": NO_NUL_PATTERN})]
#: `Text` whose NUL rule the model that holds it checks (a rollout's text: `_rollout_rules`).
BulkText = Annotated[str, Field(json_schema_extra={"pattern": NO_NUL_PATTERN})]


def _json_problem(value: Any) -> str | None:
    """What makes a decoded JSON value unstorable (None when it is fine): a NUL in a string or a
    key, a number that is not finite (NaN, Infinity and 1e400 are not JSON numbers; Postgres
    refuses them and they would come back as invalid JSON), or nesting deeper than MAX_JSON_DEPTH."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        node, where, depth = stack.pop()
        at = f" (at {where or 'the top'})"
        if depth > MAX_JSON_DEPTH:
            return f"nested deeper than {MAX_JSON_DEPTH} levels{at}"
        if isinstance(node, str):
            if "\x00" in node:
                return NUL_MESSAGE + at
        elif isinstance(node, float):
            if not math.isfinite(node):
                return f"numbers must be finite: NaN and infinities are not JSON{at}"
        elif isinstance(node, dict):
            for k, v in node.items():
                if not isinstance(k, str) or "\x00" in k:
                    return f"keys must be strings without NUL characters{at}"
                stack.append((v, f"{where}.{k}" if where else k, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, f"{where}[{i}]", depth + 1) for i, v in enumerate(node))
        elif not (node is None or isinstance(node, bool | int)):
            return f"not a JSON value: {type(node).__name__}{at}"
    return None


def _storable_json(value: dict[str, Any]) -> dict[str, Any]:
    problem = _json_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


#: A free-form JSON object: any JSON, as long as a database can store it and give it back as JSON.
JsonObject = Annotated[
    dict[str, Any],
    AfterValidator(_storable_json),
    WithJsonSchema(
        {
            "type": "object",
            "propertyNames": {"pattern": NO_NUL_PATTERN},
            "additionalProperties": True,
            "description": "Free-form JSON: finite numbers, no NUL characters, at most "
            f"{MAX_JSON_DEPTH} levels deep.",
        }
    ),
]


# ------------------------------------------------------------------- integers and cross-field rules
class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=False)


M = TypeVar("M", bound="Checked")
Loc = tuple[str | int, ...]
#: A rule a validated model breaks: where (relative to the model), the message, the value there.
Broken = tuple[Loc, str, Any]


def _integral_locs(error: ValidationError) -> list[Loc]:
    """Where `error` refuses an integral float (3.0) as an integer: strict mode takes no float for
    an int, while JSON Schema counts 3.0 as an integer."""
    return [
        e["loc"]
        for e in error.errors(include_url=False, include_context=False)
        if e["type"] == "int_type" and type(e["input"]) is float and e["input"].is_integer()
    ]


def _with_ints(data: Any, locs: list[Loc]) -> Any:
    """`data` with the integral float at each of `locs` made an int, and, where one is in a list
    (of integers: token ids), every integral float of that list: such a list stops at its first
    error (`fail_fast`), so one error stands for all of them. The dicts and lists on the way are
    copied (the caller's data is left as it was); a place `data` does not hold is skipped."""
    root = [data]
    copies: set[int] = set()  # ids of the containers copied already
    lists: set[int] = set()  # ids of the lists whose floats are made ints already
    for loc in locs:
        parent: Any = root
        key: str | int = 0
        for step in loc:
            node = parent[key]
            if isinstance(node, dict) and isinstance(step, str) and step in node:
                copy: Any = dict(node) if id(node) not in copies else node
            elif isinstance(node, list) and type(step) is int and 0 <= step < len(node):
                copy = list(node) if id(node) not in copies else node
            else:
                break
            copies.add(id(copy))
            parent[key] = copy
            parent, key = copy, step
        else:
            if isinstance(parent, list) and isinstance(key, int):
                if id(parent) not in lists:  # from its first error on (the ids before it are ints)
                    lists.add(id(parent))
                    rest = parent[key:]
                    parent[key:] = [int(v) if type(v) is float and v.is_integer() else v for v in rest]
            elif type(parent[key]) is float and parent[key].is_integer():
                parent[key] = int(parent[key])
    return root[0]


def _validated(validate: Callable[[Any], M], data: Any) -> M:
    """`validate(data)` (pydantic-core's compiled validation) taking integral floats as integers,
    then the rules of the validated model checked (`_with_rules_kept`)."""
    try:
        model = validate(data)
    except ValidationError as e:
        locs = _integral_locs(e)
        if not locs:
            raise
        # again without the integral floats, so the errors left are what a body with ints gets
        model = validate(_with_ints(data, locs))
    return _with_rules_kept(model)


def _with_rules_kept(model: M) -> M:
    """`model`, unless it breaks a rule of `Checked._broken_rules`: then a `ValidationError` of
    `value_error`s, each at the place that breaks one, as a validator there would refuse it."""
    broken = model._broken_rules()
    if broken:
        raise ValidationError.from_exception_data(
            type(model).__name__,
            [
                InitErrorDetails(type="value_error", loc=loc, input=value, ctx={"error": ValueError(msg)})
                for loc, msg, value in broken
            ],
        )
    return model


class Checked(Strict):
    """A model of what clients send (request bodies, export records) and what it holds.

    JSON Schema counts 3.0 as an integer, so its integer fields take 3.0 as 3 (never 3.5, "3" or
    true): a body the published schema allows is not refused for it. pydantic-core validates the
    body strictly; only when it refuses an integral float as an integer is the body validated once
    more with those floats made ints, so a body of ints pays nothing for the rule.

    Rules that span fields, and those whose message pydantic-core cannot give, are checked in
    Python once the fields are valid (`_broken_rules`), by the request over everything it holds
    (all its rollouts in one pass), not model by model."""

    def _broken_rules(self) -> list[Broken]:
        """The rules this validated model (and what it holds) breaks; none by default."""
        return []


class Incoming(Checked):
    """A request body or an export record: validated as `Checked` says, by one validator of the
    whole model. (Answers stay plain `Strict`: a model validator makes pydantic check the model's
    fields as Python values, which a datetime field in strict mode refuses when it comes as JSON
    text.)"""

    @model_validator(mode="wrap")
    @classmethod
    def _checked(cls, data: Any, handler: ModelWrapValidatorHandler[Incoming]) -> Incoming:
        return _validated(handler, data)


class _SelfChecking:
    """The validator of a `Bulk` model validated on its own (constructed, `model_validate`,
    `TypeAdapter`): the model's compiled one, then what `Incoming` adds (integral floats, rules)."""

    def __init__(self, compiled: SchemaValidator) -> None:
        self._compiled = compiled

    def validate_python(self, input: Any, **kwargs: Any) -> Any:
        return _validated(lambda data: self._compiled.validate_python(data, **kwargs), input)

    def validate_json(self, input: str | bytes | bytearray, **kwargs: Any) -> Any:
        try:
            model = self._compiled.validate_json(input, **kwargs)
        except ValidationError as e:
            if not _integral_locs(e):
                raise
            return self.validate_python(from_json(input), **kwargs)
        return _with_rules_kept(model)

    def validate_strings(self, input: Any, **kwargs: Any) -> Any:
        return _validated(lambda data: self._compiled.validate_strings(data, **kwargs), input)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)


class Bulk(Checked):
    """A part of a request that comes by the thousand (rollouts, groups): the request that holds
    it validates it with no Python validator of its own, and checks the rules of all its parts
    at once (`Incoming`). Validated on its own, it checks itself just the same."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if not cls.__pydantic_complete__:
            raise TypeError(f"{cls.__name__}: a Bulk model needs its annotations defined before it")
        # its own entry points only: a model that holds it uses its core schema, which stays
        # pure pydantic-core
        compiled = cast(SchemaValidator, cls.__pydantic_validator__)
        cls.__pydantic_validator__ = cast(SchemaValidator, _SelfChecking(compiled))


def validation_summary(e: ValidationError, limit: int = 3) -> str:
    """The first `limit` errors of a validation, one `location: message` each, on one line."""
    parts = []
    for err in e.errors()[:limit]:
        loc = ".".join(str(x) for x in err["loc"])
        parts.append(f"{loc}: {err['msg']}" if loc else err["msg"])
    return "; ".join(parts)


class Problem(BaseModel):
    """RFC 9457 problem details, the body of every error response."""

    model_config = ConfigDict(extra="allow")
    type: str = "about:blank"
    title: str
    status: int
    detail: str
    instance: str | None = None
    request_id: str | None = None
    errors: list[dict[str, Any]] | None = None


# --------------------------------------------------------------------------------------- pools
class PoolConfig(Incoming):
    """ExGRPO rules of a pool (spec sections 2-5). Runs may override the batch-level ones."""

    k: int = Field(8, ge=2, le=1024, description="Rollouts per question (group size K).")
    lbound: int = Field(
        0, ge=0, le=1022, description="Collect a group only when lbound < k (and lbound < rbound)."
    )
    rbound: int | None = Field(
        None, ge=1, le=1023, description="... and k <= rbound; at most K-1, the default."
    )
    weighting: Weighting = Field("normal", description="Bucket weighting for replay sampling.")
    # The bounds of mu and sigma keep every bucket's Gaussian log-weight finite, so any set of
    # non-empty buckets normalises (the service also checks the weights a config gives).
    mu: FiniteFloat | None = Field(
        None, ge=-1e6, le=1e6, description="Gaussian centre; default K/2 (count) or 0.5."
    )
    sigma: FiniteFloat = Field(1.0, ge=1e-6, le=1e6, description="Gaussian width in `unit`s.")
    unit: Literal["count", "accuracy"] = Field("count", description="Unit of mu and sigma.")
    experience_ratio: FiniteFloat = Field(0.5, ge=0, le=1, description="Share of replayed questions.")
    batch_size: int = Field(128, ge=1, le=65_536, description="Questions per training step (B).")
    start_threshold: FiniteFloat = Field(0.35, ge=0, le=1, description="Delayed-start threshold.")
    sharing: Sharing = Field(
        "per_run",
        description="What the pool's runs share: per_run (nothing), pooled (buckets, retirement and "
        "trajectories) or shared_trajectories (trajectories; buckets and retirement per run).",
    )
    active_refresh_margin: int = Field(
        20, ge=0, le=2**31 - 1, description="Epoch refresh needs > B + margin."
    )
    max_trajectories_per_question: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="Keep at most this many stored trajectories per question (in each trajectory "
        "scope); a write beyond it evicts the question's oldest. None: no limit (the spec's).",
    )
    max_payload_bytes: int | None = Field(
        None,
        ge=1024,
        le=2**62,
        description="Keep at most this many bytes of stored token ids and log-probs (8 per token) "
        "in the pool; a write beyond it evicts the pool's oldest trajectories, and a write that "
        "alone sends more is refused. None: no limit.",
    )
    max_replay_age: int | None = Field(
        None,
        ge=1,
        le=2**31 - 1,
        description="Replay only stored trajectories collected at most this many steps before the "
        "run's current step (older ones stay stored, not replayed). None: no limit (the spec's).",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> PoolConfig:
        rb = self.k - 1 if self.rbound is None else self.rbound
        if rb > self.k - 1:
            raise ValueError(f"rbound must be at most k-1 = {self.k - 1} (k = K means retire), got {rb}")
        if self.lbound >= rb:
            raise ValueError(f"lbound ({self.lbound}) must be smaller than rbound ({rb})")
        return self


class PoolCreate(Incoming):
    name: Name
    config: PoolConfig = Field(default_factory=PoolConfig)
    description: Text = Field("", max_length=2000)


class PoolConfigPatch(Incoming):
    """The `PoolConfig` keys a PATCH changes: only the keys given (null resets a nullable key to its
    default); the merged config is validated as a whole. `k` and `sharing` cannot change."""

    k: int | None = Field(None, ge=2, le=1024)
    lbound: int | None = Field(None, ge=0, le=1022)
    rbound: int | None = Field(None, ge=1, le=1023)
    weighting: Weighting | None = None
    mu: FiniteFloat | None = Field(None, ge=-1e6, le=1e6)
    sigma: FiniteFloat | None = Field(None, ge=1e-6, le=1e6)
    unit: Literal["count", "accuracy"] | None = None
    experience_ratio: FiniteFloat | None = Field(None, ge=0, le=1)
    batch_size: int | None = Field(None, ge=1, le=65_536)
    start_threshold: FiniteFloat | None = Field(None, ge=0, le=1)
    sharing: Sharing | None = None
    active_refresh_margin: int | None = Field(None, ge=0, le=2**31 - 1)
    max_trajectories_per_question: int | None = Field(None, ge=1, le=1_000_000)
    max_payload_bytes: int | None = Field(None, ge=1024, le=2**62)
    max_replay_age: int | None = Field(None, ge=1, le=2**31 - 1)

    def merged(self, current: PoolConfig) -> PoolConfig:
        """`current` with the keys this patch gives (`ValidationError` if the result breaks a rule)."""
        return PoolConfig.model_validate({**current.model_dump(), **self.model_dump(exclude_unset=True)})


class PoolUpdate(Incoming):
    description: Text | None = Field(None, max_length=2000)
    config: PoolConfigPatch | None = Field(None, description="Keys of the config to change (merged).")


class PoolPublic(Strict):
    id: int
    name: str
    description: str
    config: PoolConfig
    num_questions: int
    num_trajectories: int
    num_runs: int
    created_at: datetime
    updated_at: datetime


class PoolsPublic(Strict):
    data: list[PoolPublic]
    count: int


# ------------------------------------------------------------------------------------ questions
class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = Field(max_length=200_000)


class QuestionCreate(Strict):
    prompt: list[ChatMessage] = Field(min_length=1, max_length=64)
    ground_truth: Text = Field(max_length=100_000)
    data_source: Text = Field("", max_length=256)
    external_id: Text | None = Field(None, max_length=256)
    metadata: JsonObject = Field(default_factory=dict)


class QuestionsImport(Strict):
    questions: list[QuestionCreate] = Field(min_length=1, max_length=50_000)


class QuestionsImported(Strict):
    received: int
    inserted: int
    duplicates: int
    num_questions: int


class QuestionPublic(Strict):
    id: int
    pool: str
    prompt: list[ChatMessage]
    ground_truth: str
    data_source: str
    external_id: str | None
    metadata: dict[str, Any]
    created_at: datetime


class QuestionsPublic(Strict):
    data: list[QuestionPublic]
    count: int
    next_after: int | None = None


# --------------------------------------------------------------------------------- trajectories
class _PackedBytes:
    """`_packed`: a payload as packed bytes (little-endian int32 ids, float32 log-probs), beside
    the model's fields (on the service's request path, byte views into the request's frame
    instead: `frames.attach(..., views=True)`). It lives in the model's private values
    (`__pydantic_private__`, which copies and pickles keep) but is no pydantic private attribute:
    pydantic initialises those with a Python call for every model it validates, thousands a
    request."""

    __slots__ = ()

    @property
    def _packed(self) -> tuple[bytes, bytes] | None:
        return packed_of(self)

    @_packed.setter
    def _packed(self, value: tuple[bytes, bytes] | None) -> None:
        set_packed(self, value)


def packed_of(model: object) -> tuple[bytes, bytes] | None:
    """`model._packed`, read straight from its private values (the hot paths read it for every
    rollout of a request: no attribute lookup through the model's class)."""
    private: dict[str, Any] | None = getattr(model, "__pydantic_private__", None)
    return None if private is None else private.get("_packed")


def set_packed(model: object, value: tuple[bytes, bytes] | None) -> None:
    """`model._packed = value` without pydantic's `__setattr__` (a Python call per rollout)."""
    private: dict[str, Any] | None = getattr(model, "__pydantic_private__", None)
    if private is not None:
        private["_packed"] = value
    elif value is not None:
        object.__setattr__(model, "__pydantic_private__", {"_packed": value})


class Payload(Bulk):
    """Token ids and per-token log-probs of one response, as lists or base64 packed arrays."""

    # an error names the first token id that is wrong, not each: 65,536 of them would be 65,536
    # errors (and 3.0 for 3 costs one error a list to take as an integer: `_with_ints`)
    token_ids: list[TokenId] | None = Field(None, max_length=MAX_TOKENS_PER_TRAJECTORY, fail_fast=True)
    token_ids_b64: str | None = Field(None, description="base64 of little-endian int32 ids")
    logprobs: list[FiniteFloat] | None = Field(None, max_length=MAX_TOKENS_PER_TRAJECTORY)
    logprobs_b64: str | None = Field(None, description="base64 of little-endian float32 log-probs")

    def _broken_rules(self) -> list[Broken]:
        if (self.token_ids is None) == (self.token_ids_b64 is None):
            return [((), "give exactly one of token_ids or token_ids_b64", self)]
        if (self.logprobs is None) == (self.logprobs_b64 is None):
            return [((), "give exactly one of logprobs or logprobs_b64", self)]
        return []


#: A rollout's reward: 1 correct, 0 not (spec section 7). Other values are refused (by the
#: request, with the other rules of its rollouts: `_rollout_rules`).
Reward = Annotated[FiniteFloat, Field(json_schema_extra={"enum": [0, 1]})]


def _reward_message(value: float) -> str:
    return (
        f"reward must be 0 or 1 (1 = correct: the pool counts correct rollouts), got {value}; map "
        "a grader's other scores to 0 or 1 before sending them"
    )


class RolloutResult(Payload, _PackedBytes):
    """One graded rollout of a group. Payload fields are required for correct rollouts only."""

    token_ids: list[TokenId] | None = Field(None, max_length=MAX_TOKENS_PER_TRAJECTORY, fail_fast=True)
    logprobs: list[FiniteFloat] | None = Field(None, max_length=MAX_TOKENS_PER_TRAJECTORY)
    reward: Reward
    entropy: FiniteFloat | None = Field(None, ge=0, description="Mean token entropy of the response.")
    replayed: bool = Field(False, description="This row is the replayed stored trajectory.")
    finish_reason: Literal["stop", "length", "abort"] | None = None
    text: BulkText | None = Field(
        None,
        max_length=MAX_TEXT_CHARS,
        description="The response as text (its tokens decoded), stored with a collected trajectory so "
        "people can read it.",
    )
    # `_packed` (from `_PackedBytes`): the payload as packed bytes when it came in a binary frame
    # or was built by `exgrpo_client.rollout`; never on the JSON wire, where the fields above carry it

    def _broken_rules(self) -> list[Broken]:
        return _rollout_rules(self, ())


def _rollout_rules(r: RolloutResult, at: Loc) -> list[Broken]:
    """The rules of one validated rollout, at `at`: its reward and text (as field validators would
    refuse them), then (as a model validator would, once those hold) how its payload is given."""
    reward, text = r.reward, r.text
    broken: list[Broken] = []
    if reward != 0.0 and reward != 1.0:
        broken.append(((*at, "reward"), _reward_message(reward), reward))
    if text is not None and "\x00" in text:
        broken.append(((*at, "text"), NUL_MESSAGE, text))
    if broken:
        return broken
    ids, ids_b64, lps, lps_b64 = r.token_ids, r.token_ids_b64, r.logprobs, r.logprobs_b64
    if ids is not None and ids_b64 is not None:
        return [(at, "give token_ids or token_ids_b64, not both", r)]
    if lps is not None and lps_b64 is not None:
        return [(at, "give logprobs or logprobs_b64, not both", r)]
    if (ids is None and ids_b64 is None) != (lps is None and lps_b64 is None):
        return [(at, "token ids and log-probs come together: give both or neither", r)]
    return []


def _rollouts_rules(rollouts: Sequence[RolloutResult], at: Loc) -> list[Broken]:
    """The rules of many rollouts, in one pass: `at` + (index,) names each one that breaks one."""
    broken: list[Broken] = []
    for j, r in enumerate(rollouts):
        found = _rollout_rules(r, ())
        if found:
            broken += [((*at, j, *loc), msg, value) for loc, msg, value in found]
    return broken


class GroupResult(Bulk):
    question_id: RowId
    rollouts: list[RolloutResult] = Field(min_length=1, max_length=1024)
    replay_trajectory_id: RowId | None = Field(None, description="Stored trajectory used as row 0.")

    def _broken_rules(self) -> list[Broken]:
        return _rollouts_rules(self.rollouts, ("rollouts",))


def _groups_rules(groups: Sequence[GroupResult]) -> list[Broken]:
    """The rules of every rollout of a request's groups, named `groups.i.rollouts.j`."""
    if _rules_hold([r for g in groups for r in g.rollouts]):
        return []
    broken: list[Broken] = []
    for i, g in enumerate(groups):
        broken += _rollouts_rules(g.rollouts, ("groups", i, "rollouts"))
    return broken


_REWARDS = frozenset({0.0, 1.0})
#: a rollout's payload fields that are None, as `_rules_hold` sums them (token_ids 1, token_ids_b64
#: 2, logprobs 4, logprobs_b64 8), where the rules hold: none given, or ids and log-probs each as
#: a list or as base64
_PAYLOAD_FORMS = frozenset({15, 2 + 8, 1 + 4, 2 + 4, 1 + 8})


def _rules_hold(rollouts: list[RolloutResult]) -> bool:
    """Whether every rollout keeps `_rollout_rules`, from three comprehensions over all of them
    (no Python call per rollout: 0.6 of the time of the rules one by one): every reward 0 or 1,
    no text with a NUL, every payload in a form the rules allow. Where one does not,
    `_rollout_rules` finds which and says why."""
    if not {r.reward for r in rollouts} <= _REWARDS:
        return False
    if any("\x00" in t for t in [r.text for r in rollouts] if t is not None):
        return False
    forms = {
        (r.token_ids is None)
        + 2 * (r.token_ids_b64 is None)
        + 4 * (r.logprobs is None)
        + 8 * (r.logprobs_b64 is None)
        for r in rollouts
    }
    return forms <= _PAYLOAD_FORMS


class TrajectoryPublic(Strict, _PackedBytes):
    id: int
    question_id: int
    source_run: str | None
    policy_version: int
    step: int
    reward: float
    entropy: float | None
    num_tokens: int
    created_at: datetime
    token_ids_b64: str | None = None
    logprobs_b64: str | None = None
    text: str | None = Field(None, description="The response as text, where its producer sent it.")
    # `_packed` (from `_PackedBytes`): the payload as packed bytes, as stored, when it comes in a
    # binary frame (`exgrpo_client.decode_trajectory` reads either form)


# ----------------------------------------------------------------------------------------- runs
class RunOverrides(Incoming):
    experience_ratio: FiniteFloat | None = Field(None, ge=0, le=1)
    batch_size: int | None = Field(None, ge=1, le=65_536)
    start_threshold: FiniteFloat | None = Field(None, ge=0, le=1)
    max_replay_age: int | None = Field(
        None, ge=1, le=2**31 - 1, description="The pool's max_replay_age for this run; None: the pool's."
    )
    experience: bool = Field(True, description="False runs plain on-policy GRPO (never replays).")


class RunCreate(Incoming):
    name: Name
    seed: int = Field(0, ge=0, le=2**31 - 1)
    overrides: RunOverrides = Field(default_factory=RunOverrides)
    phase: Phase = "on_policy"


class RunUpdate(Incoming):
    phase: Phase | None = None
    overrides: RunOverrides | None = None


class RunPublic(Strict):
    id: int
    name: str
    pool: str
    seed: int
    phase: Phase
    switched_at_step: int | None
    step: int
    policy_version: int
    epoch: int
    cursor: int
    overrides: RunOverrides
    created_at: datetime
    updated_at: datetime


class RunsPublic(Strict):
    data: list[RunPublic]
    count: int


#: Header of every write on a run whose writer holds a lease: `<holder>:<generation>`.
LEASE_HEADER = "X-Run-Lease"


class RunLeaseRequest(Incoming):
    """Ask for the writer lease of a run (`PUT .../runs/{run}/lease`)."""

    holder: Text = Field(min_length=1, max_length=200, description="Who writes (a trainer's id).")
    ttl_s: FiniteFloat = Field(60.0, ge=1, le=3600, description="Seconds the lease lives unless renewed.")
    takeover: bool = Field(False, description="Fence out a live holder (its generation becomes stale).")
    generation: int | None = Field(
        None,
        ge=1,
        le=2**31 - 1,
        description="Renew only: refused (409, naming who took the run) unless the run's lease is still "
        "this holder's with this generation, live or expired with nobody taking it since.",
    )


class RunLease(Strict):
    """The writer lease of a run. Writes carry `X-Run-Lease: <holder>:<generation>`."""

    run: str
    holder: str
    generation: int
    expires_at: datetime
    pool: str | None = None

    @property
    def header(self) -> str:
        """The value of the `X-Run-Lease` header of this lease's writes."""
        return f"{self.holder}:{self.generation}"


class PolicyVersionCreate(Incoming):
    version: Int32
    uri: Text = Field(min_length=1, max_length=4096)
    step: Int32 = 0


class PolicyVersionPublic(Strict):
    version: int
    uri: str
    step: int
    created_at: datetime


class PolicyVersionsPublic(Strict):
    data: list[PolicyVersionPublic]
    count: int


# -------------------------------------------------------------------------------------- batches
class SamplingParams(Incoming):
    """How a generation task is sampled; the trainer sends its own settings with the plan."""

    temperature: FiniteFloat = Field(1.0, ge=0)
    top_p: FiniteFloat = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(8192, ge=1, le=2**31 - 1)
    min_tokens: int = Field(0, ge=0, le=2**31 - 1)


class BatchCreate(Incoming):
    batch_size: int | None = Field(None, ge=1, le=65_536)
    experience_ratio: FiniteFloat | None = Field(None, ge=0, le=1)
    candidates: CandidateMode = Field("all", description="Stored trajectories sent with replays.")
    create_tasks: bool = Field(False, description="Queue generation tasks for remote workers.")
    replan: bool = Field(False, description="Abandon an open uncommitted batch and plan anew.")
    policy_version: Int32 | None = Field(
        None,
        description="The policy version the batch's tasks are generated with; it must be published "
        "for the run (409 otherwise). Default: the run's newest published version.",
    )
    min_policy_version: Int32 | None = Field(
        None,
        description="Asynchronous generation: a worker may generate the tasks with any published "
        "version >= this one (at most `policy_version`). Default: exactly `policy_version`.",
    )
    sampling: SamplingParams | None = Field(
        None,
        description="Sampling settings every task of the batch is generated with (stored with each "
        "task). Default: the worker's own settings.",
    )


class FreshItem(Strict):
    question_id: int
    prompt: list[ChatMessage]
    ground_truth: str
    data_source: str
    num_samples: int


class ReplayItem(FreshItem):
    bucket: int
    probability: float
    candidates: list[TrajectoryPublic]


class BatchPlan(Strict):
    id: str
    run: str
    pool: str
    step: int
    phase: Phase
    status: BatchStatus
    policy_version: int
    k: int
    fresh: list[FreshItem]
    replay: list[ReplayItem]
    num_eligible: int
    skipped_fresh: int
    epoch: int
    created_at: datetime


class BatchCommit(Incoming):
    groups: list[GroupResult] = Field(min_length=1, max_length=65_536)
    policy_version: Int32 | None = None
    metrics: dict[Text, FiniteFloat] = Field(default_factory=dict)
    with_stats: bool = Field(
        False, description="Answer with the run's stats after this commit (`CommitResult.stats`)."
    )

    def _broken_rules(self) -> list[Broken]:
        return _groups_rules(self.groups)


class CommitResult(Strict):
    batch_id: str | None
    run: str
    step: int
    phase: Phase
    switched: bool
    solved_fraction: float
    retired: int
    collected_groups: int
    ignored_groups: int
    stored_trajectories: int
    duplicate_trajectories: int
    bucket_moves: int
    removed_trajectories: int = Field(
        0,
        description="Stored trajectories this request removed: those of questions it retired (in "
        "the scope that owns them; never with sharing shared_trajectories), and those the pool's "
        "capacity limits evicted.",
    )
    stats: RunStats | None = Field(
        None,
        description="The run's stats as this commit left them (what GET .../stats would answer "
        "then), when the commit asked for them with `with_stats`.",
    )


class BatchStatusPublic(Strict):
    id: str
    run: str
    step: int
    status: BatchStatus
    num_tasks: int
    tasks_completed: int
    tasks_pending: int
    tasks_leased: int
    tasks_failed: int
    result: CommitResult | None


class IngestRequest(Incoming):
    groups: list[GroupResult] = Field(min_length=1, max_length=65_536)
    policy_version: Int32 = 0
    step: Int32 | None = None
    prefill: bool = Field(
        False,
        description="Collect even while the run is on_policy (pre-fill the pool before the delayed "
        "start). Without it ingest follows the run's phase like a commit: retirement always, "
        "collection in the mixed phase only.",
    )

    def _broken_rules(self) -> list[Broken]:
        return _groups_rules(self.groups)


class SelectRequest(Incoming):
    n: int = Field(ge=1, le=65_536)
    seed: int | None = None
    candidates: CandidateMode = "all"


class SelectResult(Strict):
    run: str
    num_eligible: int
    replay: list[ReplayItem]


# ---------------------------------------------------------------------------------------- tasks


class TaskClaim(Incoming):
    worker: Text = Field(min_length=1, max_length=256)
    max_tasks: int = Field(1, ge=1, le=1024)
    lease_seconds: FiniteFloat = Field(120.0, gt=0, le=86_400)


class PoolTaskClaim(TaskClaim):
    """A claim over several runs of a pool (a shared worker fleet). The tasks of one answer all
    belong to one run and one policy version; the run is chosen fairly among those with pending
    tasks (the run whose oldest pending task has waited longest, among those with the fewest
    leased tasks)."""

    runs: list[Name] | None = Field(
        None, max_length=1024, description="Runs to serve (default: every run of the pool)."
    )


class TaskPublic(Strict):
    id: int
    batch_id: str
    run: str
    question_id: int
    prompt: list[ChatMessage]
    ground_truth: str
    data_source: str
    num_samples: int
    replayed: bool
    policy_version: int
    """Exact tasks: the version to generate with. Otherwise the oldest version allowed."""
    policy_exact: bool = True
    """Generate with exactly `policy_version` (synchronous mode), or any published version >= it."""
    policy_uri: str | None = None
    """Where `policy_version` of the run is published (None: not published)."""
    sampling: SamplingParams | None = None
    """Sampling settings the trainer asked for (None: the worker's own)."""
    status: TaskStatus
    attempts: int
    lease_token: str | None
    lease_expires_at: datetime | None


class TasksPublic(Strict):
    data: list[TaskPublic]
    count: int


class TaskRenew(Incoming):
    lease_token: Text
    lease_seconds: FiniteFloat = Field(120.0, gt=0, le=86_400)


class TaskComplete(Incoming):
    lease_token: Text
    rollouts: list[RolloutResult] = Field(min_length=1, max_length=1024)
    policy_version: Int32 | None = Field(
        None,
        description="The policy version the rollouts were generated with; required for tasks that "
        "name one (an exact task refuses any other, an asynchronous one any older than allowed).",
    )

    def _broken_rules(self) -> list[Broken]:
        return _rollouts_rules(self.rollouts, ("rollouts",))


class TaskFail(Incoming):
    lease_token: Text
    error: Text = Field(max_length=4000)
    retry: bool = True


class TaskGroupResult(GroupResult):
    """The samples of one completed generation task."""

    replayed: bool = Field(
        False,
        description="The task's question is replayed in the batch: these are its K-1 generated samples.",
    )
    policy_version: int | None = Field(
        None, description="The policy version the samples were generated with (as the worker said)."
    )


# An answer, but what workers sent: its rollouts are checked as a commit checks them (it has no
# datetime field, see `Incoming`).
class BatchResults(Incoming):
    batch_id: str
    complete: bool
    groups: list[TaskGroupResult]

    def _broken_rules(self) -> list[Broken]:
        return _groups_rules(self.groups)


# ---------------------------------------------------------------------------------------- stats
class BucketCount(Strict):
    bucket: int
    questions: int


class RunStats(Strict):
    run: str
    pool: str
    phase: Phase
    step: int
    policy_version: int
    buckets: list[BucketCount]
    eligible: int
    retired: int
    seen: int
    trajectories: int
    replayed_last_step: int
    ingest_per_minute: float


class PoolStats(Strict):
    pool: str
    num_questions: int
    num_trajectories: int
    num_tokens: int
    num_runs: int
    runs: list[RunStats]


class QuestionRunState(Strict):
    run: str
    num_correct: int | None
    bucket: int | None
    retired: bool
    last_step: int | None


class QuestionDetail(QuestionPublic):
    trajectories: list[TrajectoryPublic]
    runs: list[QuestionRunState]


# ---------------------------------------------------------------------------------- run metrics
class RunMetricsCreate(Incoming):
    """Per-step numbers of a run (training curves, held-out accuracy, pool statistics). Values for
    a step merge with what the step already has."""

    step: Int32
    metrics: dict[Text, FiniteFloat] = Field(min_length=1, max_length=1000)


class RunMetricsStep(Strict):
    step: int
    metrics: dict[str, float]
    updated_at: datetime


class RunMetricsPublic(Strict):
    run: str
    data: list[RunMetricsStep]
    count: int


# --------------------------------------------------------------------------------- stored plans
class StoredPick(BaseModel):
    """A replayed question of a stored batch plan, with the ids of the stored trajectories sent
    with it. Plans stored before these names were spelled out used the keys q, b, p and c; they
    still read. Not strict: the values come from the service itself (numpy scalars included)."""

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)
    question_id: int = Field(validation_alias="q")
    bucket: int = Field(validation_alias="b")
    probability: float = Field(validation_alias="p")
    candidates: list[int] = Field(default_factory=list, validation_alias="c")


class StoredPlan(BaseModel):
    """What the service keeps of a planned batch (the batch row's `plan` JSON)."""

    model_config = ConfigDict(extra="forbid")
    k: int
    fresh: list[int]
    replay: list[StoredPick]
    num_eligible: int
    skipped_fresh: int
    epoch: int
    batch_size: int


# ------------------------------------------------------------------------------- export/import
class PoolImported(Strict):
    pool: str
    questions: int
    runs: int
    states: int
    trajectories: int
    duplicates: int


# An export is NDJSON: one record a line, told apart by its `type`. The header comes first, then
# runs (each followed by its policy versions), questions, per-scope states and trajectories. Ids
# are the exporting database's; an import maps them to new ones.
class ExportHeader(Incoming):
    type: Literal["header"] = "header"
    kind: Literal["exgrpo-pool-export"] = "exgrpo-pool-export"
    format_version: Int32 = 1
    pool: PoolCreate
    num_questions: RowId
    num_trajectories: RowId
    num_runs: RowId


class ExportRun(Incoming):
    type: Literal["run"] = "run"
    id: RowId
    name: Name
    seed: Int32
    phase: Phase
    switched_at_step: Int32 | None = None
    step: Int32
    policy_version: Int32
    overrides: RunOverrides = Field(default_factory=RunOverrides)


class ExportPolicyVersion(Incoming):
    type: Literal["policy_version"] = "policy_version"
    run: RowId = Field(description="Id of the exported run (an earlier `run` record).")
    version: Int32
    uri: Text = Field(min_length=1, max_length=4096)
    step: Int32 = 0


class ExportQuestion(QuestionCreate):
    type: Literal["question"] = "question"
    id: RowId


class ExportState(Incoming):
    """A question's state in one scope: a run's id, or 0 for the shared scope of a pooled pool."""

    type: Literal["state"] = "state"
    scope: RowId
    question: RowId
    last_k: Int32
    bucket: Int32 | None = None
    retired: bool
    last_step: Int32


class ExportTrajectory(Incoming):
    type: Literal["trajectory"] = "trajectory"
    question: RowId
    scope: RowId | None = Field(
        None,
        description="The exported run that owns it (sharing per_run), 0 for the pool's shared scope; "
        "absent in older exports (then: its source run in a per_run pool, else the shared scope).",
    )
    source_run: RowId | None = None
    policy_version: Int32
    step: Int32
    token_ids_b64: str = Field(description="base64 of little-endian int32 ids")
    logprobs_b64: str = Field(description="base64 of little-endian float32 log-probs")
    reward: FiniteFloat
    entropy: FiniteFloat | None = None
    text: Text | None = Field(None, max_length=MAX_TEXT_CHARS)


ExportRecord = Annotated[
    ExportHeader | ExportRun | ExportPolicyVersion | ExportQuestion | ExportState | ExportTrajectory,
    Field(discriminator="type"),
]
_EXPORT_RECORD: TypeAdapter[ExportRecord] = TypeAdapter(ExportRecord)


def parse_export_record(line: str | bytes) -> ExportRecord:
    """One line of an export, validated strictly (`pydantic.ValidationError`, a `ValueError`)."""
    return _EXPORT_RECORD.validate_json(line, strict=True)


def export_line(record: ExportRecord) -> bytes:
    """One record as a line of an export (compact JSON and a newline)."""
    return record.model_dump_json().encode() + b"\n"


# ------------------------------------------------------------------------------- packed arrays
# The one codec of payload arrays: base64 of little-endian int32 token ids and float32 log-probs.
# The service stores the same bytes (unencoded) in its trajectory rows.
ID_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

IdsLike = Sequence[int] | npt.NDArray[np.integer[Any]]
LogprobsLike = Sequence[float] | npt.NDArray[np.floating[Any]]


def encode_b64(raw: bytes) -> str:
    """base64 text of packed bytes (as stored by the service), by a SIMD codec: the standard
    library's text, 10x faster."""
    return pybase64.b64encode(raw).decode("ascii")


def decode_b64(text: str) -> bytes:
    """Packed bytes of base64 text; `ValueError` (binascii.Error) on anything but base64. A SIMD
    codec decodes (30x the standard library on megabytes); what it refuses is decoded again by the
    standard library, so an error is the standard library's, word for word."""
    try:
        return pybase64.b64decode(text, validate=True)
    except ValueError:
        return base64.b64decode(text, validate=True)


def ids_bytes(ids: IdsLike) -> bytes:
    """Token ids as little-endian int32 bytes; `ValueError` for non-integers or ids beyond int32."""
    arr = np.asarray(ids)
    if arr.dtype == object:  # Python ints beyond int64, or a mix of types
        raise ValueError("token ids must be integers that fit in int32")
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX:
        raise ValueError("token ids must fit in int32")
    return arr.astype(ID_DTYPE).tobytes()


def logprobs_bytes(values: LogprobsLike) -> bytes:
    """Log-probs as little-endian float32 bytes; `ValueError` unless finite in float32."""
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"log-probs must be one-dimensional, got shape {arr.shape}")
    with np.errstate(over="ignore"):
        packed = arr.astype(LOGPROB_DTYPE)
    if not np.isfinite(packed).all():
        raise ValueError("log-probs must be finite float32 numbers")
    return packed.tobytes()


def _array(b64: str, dtype: np.dtype[Any], field: str) -> npt.NDArray[Any]:
    raw = decode_b64(b64)
    if len(raw) % dtype.itemsize:
        raise ValueError(f"{field} length is not a multiple of {dtype.itemsize} bytes ({dtype.name})")
    return np.frombuffer(raw, dtype=dtype)


def decode_ids(b64: str) -> npt.NDArray[np.int32]:
    """Token ids of base64 packed int32 (a read-only array: copy it to modify it)."""
    return _array(b64, ID_DTYPE, "token_ids_b64")


def decode_logprobs(b64: str) -> npt.NDArray[np.float32]:
    """Log-probs of base64 packed float32 (a read-only array: copy it to modify it)."""
    return _array(b64, LOGPROB_DTYPE, "logprobs_b64")


def pack_ids(ids: IdsLike) -> str:
    """base64 of little-endian int32 token ids (a list or an integer array)."""
    return encode_b64(ids_bytes(ids))


def pack_logprobs(values: LogprobsLike) -> str:
    """base64 of little-endian float32 log-probs (a list or a float array)."""
    return encode_b64(logprobs_bytes(values))


def unpack_ids(b64: str) -> list[int]:
    return cast("list[int]", decode_ids(b64).tolist())


def unpack_logprobs(b64: str) -> list[float]:
    return cast("list[float]", decode_logprobs(b64).tolist())
