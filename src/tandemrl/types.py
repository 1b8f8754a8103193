"""The nouns of tandem: small typed records that cross every boundary. Pure data, no torch.

Legend: L tokens of a whole conversation, T sampled tokens of one completion, G group size.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
Message = dict[str, Any]


# The one sampling contract: every limit and rule of SamplingParams is here. The server's schemas
# (server/wire.py, server/openai.py) state the same ranges from SAMPLING_BOUNDS and convert to
# SamplingParams, so whatever a caller builds is legal for every Generator and every server.
# Every field is bounded above too, so no request can overflow a step of the engine (a top_k of 10**20
# once did, and failed every request in flight with it); NaN fails every comparison, so it is refused.
MAX_TOKENS = 2**31 - 1
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_TOP_K = 2**31 - 1  # past the vocabulary it filters nothing
MAX_SEED = 2**63 - 1
MAX_STOP_CHARS = 1024  # per stop string: the engine detokenizes that many tokens after every step
GREEDY_EPS = 1e-5  # below this a temperature is greedy: dividing logits by it overflows float32 (vLLM draws the same line)
SAMPLING_BOUNDS: dict[str, dict[str, float]] = {  # numeric fields: pydantic's ge/gt/le, inclusive unless gt
    "max_tokens": {"ge": 1, "le": MAX_TOKENS},
    "temperature": {"ge": 0, "le": MAX_TEMPERATURE},
    "top_p": {"gt": 0, "le": 1},
    "top_k": {"ge": -1, "le": MAX_TOP_K},  # -1 = off; 0 is illegal (see __post_init__)
    "min_p": {"ge": 0, "le": 1},
    # 1 = off; as far below 1 as the cap is above it: a penalty near 0 divides logits into inf (then NaN)
    "repetition_penalty": {"ge": 1 / MAX_REPETITION_PENALTY, "le": MAX_REPETITION_PENALTY},
    "seed": {"ge": 0, "le": MAX_SEED},
}
MAX_BATCH_ITEMS = 1024  # items of one POST /generate_batch: the server's schema takes this many, the client splits larger ticks
MAX_TOP_LOGPROBS = 20  # OpenAI's limit; the OpenAI routes name it `logprobs` (completions) and `top_logprobs` (chat)
SAMPLING_MAX_ITEMS: dict[str, int] = {"stop_token_ids": 64, "stop": 16}


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingParams:
    """How one completion is sampled. Validated here, so every Generator sees only legal values, and
    a temperature below GREEDY_EPS becomes 0 (greedy)."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 penalises tokens of the prompt and completion (transformers', vLLM's)
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    top_logprobs: int = 0  # the most likely tokens (and logprobs) to report at each sampled position

    def __post_init__(self) -> None:
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        for name in SAMPLING_BOUNDS:
            _check_bound(name, getattr(self, name))
        for name, most in SAMPLING_MAX_ITEMS.items():
            if len(getattr(self, name)) > most:
                raise ValueError(f"{name} takes at most {most} items, got {len(getattr(self, name))}")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop strings take at most {MAX_STOP_CHARS} characters each")
        if 0 < self.temperature < GREEDY_EPS:
            object.__setattr__(self, "temperature", 0.0)  # frozen: the one rewrite, at construction

    def with_seed(self, seed: int | None) -> SamplingParams:
        """These params with only `seed` changed, which is checked as __post_init__ checks it: what
        dataclasses.replace(self, seed=seed) returns, in ~3.5 us where the replace (every field validated
        again) took ~12 us, for every rollout at the start of a step."""
        _check_bound("seed", seed)
        copy = object.__new__(SamplingParams)
        for name in SamplingParams.__slots__:
            object.__setattr__(copy, name, getattr(self, name))
        object.__setattr__(copy, "seed", seed)
        return copy

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def top_k_or(self, off: int) -> int:
        """top_k, or `off` where top-k is off (-1): the vocab size for the engine, 0 for transformers."""
        return off if self.top_k == -1 else self.top_k

    @property
    def top_k_alone(self) -> int:
        """top_k where it is the only filter (the trainer then keeps its own top_k: algo/logprobs.py), else 0."""
        return self.top_k if self.top_k != -1 and self.top_p >= 1.0 and self.min_p <= 0.0 else 0

    @property
    def filters(self) -> bool:
        """True when top-k, top-p or min-p excludes tokens (plain temperature sampling does not)."""
        return self.top_p < 1.0 or self.min_p > 0.0 or self.top_k != -1


def _check_bound(name: str, value: float | None) -> None:
    bound = SAMPLING_BOUNDS[name]
    if value is not None and not _within(value, bound):
        raise ValueError(f"{name} must be {_describe(bound)}, got {value}")


def _within(value: float, bound: dict[str, float]) -> bool:
    return (
        ("ge" not in bound or value >= bound["ge"])
        and ("gt" not in bound or value > bound["gt"])
        and ("le" not in bound or value <= bound["le"])
    )


def _describe(bound: dict[str, float]) -> str:
    """Example: {"gt": 0, "le": 1} -> "> 0 and <= 1"."""
    return " and ".join(f"{ {'ge': '>=', 'gt': '>', 'le': '<='}[k]} {v}" for k, v in bound.items())


def route_itemsize(num_experts: int) -> int:
    """Bytes of one expert id in Completion.routes: 1 (uint8) up to 256 experts, else 2 (int16 little-endian)."""
    return 1 if num_experts <= 256 else 2


def every_steps(value: float, max_steps: int) -> int:
    """A --logging_steps/--save_steps/--eval_steps value in steps: below 1 it is TRL's ratio of the run's steps
    (ceil, at least 1), taken of the steps the run has once --num_train_epochs and the data fixed them.

    Example: every_steps(0.5, 5) -> 3; every_steps(50, 5) -> 50; every_steps(0, 5) -> 0
    """
    return max(1, math.ceil(value * max_steps)) if 0 < value < 1 else int(value)


def steps_or_ratio(flag: str, value: float, *, zero: str | None) -> float:
    """`value` checked as every_steps takes it: whole steps (0 only where `zero` says what it means), or a
    ratio below 1; whole values come back as int (so config.yaml says 50, not 50.0)."""
    if not math.isfinite(value) or value < 0 or (value == 0 and zero is None) or (value >= 1 and not float(value).is_integer()):
        allowed = f"0 ({zero}), " if zero else ""
        raise ValueError(f"--{flag} must be {allowed}whole steps or a ratio of the run's steps below 1 (TRL's form), got {value:g}")
    return int(value) if value >= 1 or value == 0 else value


NO_FLOOR = float("-inf")  # a token the sampler chose from the whole (tempered) vocabulary


@dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    """One generate() output. Written by a Generator only; never re-tokenized downstream."""

    token_ids: list[int]  # [T] exactly as sampled
    logprobs: list[float]  # [T] under the distribution actually sampled from
    finish_reason: FinishReason
    policy_versions: list[int]  # [T] version of the weights that produced each token
    top_logprobs: list[dict[int, float]] | None = None  # [T] {token id: logprob}, when SamplingParams.top_logprobs > 0
    # [T, sparse layers, experts per token] expert ids (uint8, or int16 little-endian past 256 experts) of
    # the forward that sampled each token, when the generator records routes (--routing_replay)
    routes: bytes | None = None
    # [T] the lowest tempered logit (logit / temperature) the sampler kept for each token under top-k,
    # top-p and min-p: the trainer keeps the same tokens and renormalises over them, so its logprobs are
    # of the distribution sampled from. None when nothing was filtered (plain temperature, greedy).
    logit_floors: list[float] | None = None

    def __post_init__(self) -> None:
        assert len(self.token_ids) == len(self.logprobs) == len(self.policy_versions)
        assert self.top_logprobs is None or len(self.top_logprobs) == len(self.token_ids)
        assert self.logit_floors is None or len(self.logit_floors) == len(self.token_ids)


REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")
"""What reward functions receive besides the dataset's columns (rewards/base.py): no column may take one of these names."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Example:
    """A dataset row. Written by data loading only.

    `prompt` is a plain string (used as is) or chat messages (the tokenizer's chat template is applied);
    `columns` holds every other column of the row and is passed to the reward functions by name.
    """

    prompt: str | list[Message]
    columns: dict[str, Any] = field(default_factory=dict)
    index: int = 0  # position in the dataset, for logs and resume


@dataclass(kw_only=True, slots=True)
class TokenTrace:
    """A whole conversation as the trainer sees it: sampled tokens are trained, context is not.

    Written by the rollout runner only, through the two append methods.
    """

    token_ids: list[int] = field(default_factory=list)  # [L]
    loss_mask: list[bool] = field(default_factory=list)  # [L]
    logprobs: list[float] = field(default_factory=list)  # [L], 0.0 where loss_mask is False
    policy_versions: list[int] = field(default_factory=list)  # [L], -1 where loss_mask is False
    routes: list[tuple[int, bytes]] = field(default_factory=list)  # (trace index of its first token, Completion.routes) per routed completion
    logit_floors: list[float] = field(default_factory=list)  # [L] Completion.logit_floors, -inf where nothing was filtered

    def append_sampled(self, completion: Completion) -> None:
        if completion.routes is not None:
            self.routes.append((len(self.token_ids), completion.routes))
        self.token_ids += completion.token_ids
        self.loss_mask += [True] * len(completion.token_ids)
        self.logprobs += completion.logprobs
        self.policy_versions += completion.policy_versions
        self.logit_floors += completion.logit_floors or [NO_FLOOR] * len(completion.token_ids)

    def append_context(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [False] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.policy_versions += [-1] * len(token_ids)
        self.logit_floors += [NO_FLOOR] * len(token_ids)

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)


class RolloutStatus(enum.Enum):
    OK = "ok"
    TRUNCATED = "truncated"  # hit max tokens: may be masked out of the loss
    ERROR = "error"  # the rollout raised; logged with its traceback, never trained


@dataclass(frozen=True, kw_only=True, slots=True)
class Turn:
    """One assistant turn of a rollout: where its sampled tokens sit in the trace, and who sampled them."""

    start: int  # its first token's index in the trace
    end: int  # one past its last token
    policy_version: int  # version of the weights that produced its first token
    finish_reason: FinishReason


@dataclass(kw_only=True, slots=True)
class Rollout:
    """A conversation played to its end. The rollout runner writes trace, text (single-turn: a multi-turn
    rollout's is decoded where shown, rollout.run.completion_text), messages, turns and status; the rewards step writes `rewards` (one entry per reward function, None = not applicable)
    and `reward` (their weighted sum; None when every function returned None: unscorable, advantage 0).
    `messages` (multi-turn only) is the conversation after the prompt, as chat messages:
    assistant turns (with the `tool_calls` parsed from them) and the environment's answers."""

    example: Example
    trace: TokenTrace
    completion_text: str = ""
    finish_reason: FinishReason = "stop"
    status: RolloutStatus = RolloutStatus.OK
    messages: list[Message] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    rewards: dict[str, float | None] = field(default_factory=dict)
    reward: float | None = 0.0
    extra: dict[str, Any] = field(default_factory=dict)  # columns reward functions logged for it (TRL's log_extra): completions.jsonl's


@dataclass(kw_only=True, slots=True)
class Group:
    """G rollouts of one example. `advantages` is written by the group-relative advantage step; `error`
    (why its rollouts failed, none kept) by the group runner."""

    example: Example
    rollouts: list[Rollout]
    advantages: list[float] = field(default_factory=list)  # [G]
    error: str = ""
    logged: dict[str, float] = field(default_factory=dict)  # means of what reward functions logged scoring it (TRL's log_metric)

    @property
    def rewards(self) -> list[float | None]:
        return [r.reward for r in self.rollouts]


class RunStopped(RuntimeError):
    """The run cannot go on (every rollout of a step failed, a weight push failed); the message says why.
    `tandem` prints it as one line and exits 1."""


@dataclass(kw_only=True, slots=True)
class Batch:
    """What one optimizer step trains on: the groups of that step. Written by the pipeline only."""

    groups: list[Group]
    policy_version: int  # version of the weights being trained (before the step)

    def traces(self) -> list[TokenTrace]:
        return [r.trace for g in self.groups for r in g.rollouts]

    def advantages(self) -> list[float]:
        return [a for g in self.groups for a in g.advantages]
