"""Loading reward functions by name and scoring completions with all of them at once.

Invariant: `score` returns one total (None where every function returned None) and, per function, one value (float or None) for every completion,
or raises a one-line ValueError that names the function at fault. Every value and total is finite,
unless asked to keep non-finite ones as NaN (`nonfinite="skip"`: the caller drops their groups).
Every call has a deadline: an async function past it is cancelled, a sync one (run in a daemon thread
of its own) is abandoned, so a hung reward can neither hang the run nor block its exit. A generative judge is one more
reward function (an `async def` that calls a Generator), loaded and scored like any other.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandemrl.plugins import load_object
from tandemrl.rewards.builtins import BUILTINS
from tandemrl.threads import Escaped, in_daemon_thread, still_running_abandoned
from tandemrl.types import REWARD_KEYWORDS

MAX_HUNG_CALLS = 16
"""Sync calls of one reward function still running past their deadline at which the run stops: each holds a
thread (and what it holds) until the process exits; a function that keeps hanging would pile them up."""


class HungRewardError(ValueError):
    """Too many calls of one reward function still run past their deadline (MAX_HUNG_CALLS): the run stops."""


class RewardTimeoutError(TimeoutError):
    """A reward function did not return within its deadline; the groups it was scoring are not trained."""


USAGE = "use one of math_accuracy, format, length, or module:function / path/file.py:function"


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerState:
    """What a reward function receives as `trainer_state` (the fields of TRL's TrainerState it reads).

    global_step: optimizer steps done before the step being scored; epoch: passes over the data so far
    (fractional); max_steps: the run's steps. Lets a reward shape itself by training progress.
    """

    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardFunc:
    """A named reward function, called with keywords as TRL calls it, sync or async:
    `fn(prompts=, completions=, completion_ids=, trainer_state=, log_metric=, log_extra=, **columns) -> list[float | None]`.

    `name` keys its metrics (`rewards/<name>`) and its entry in `Rollout.rewards`.
    """

    name: str
    fn: Callable[..., Any]


@dataclass(kw_only=True, slots=True)
class RewardLogs:
    """What reward functions logged during one `score` call through the keywords TRL 1.16 passes them:
    `log_metric(name, value)`, a scalar (the step logs the mean of its values under `name`, as TRL), and
    `log_extra(column, values)`, one value per completion of the call (a column of completions.jsonl, as
    TRL's completions table)."""

    metrics: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list[Any]] = field(default_factory=dict)


COMPLETION_COLUMNS = ("step", "prompt", "completion", "reward", "advantage")  # what log_extra may not name


def score_columns(rewards: dict[str, Any]) -> dict[str, Any]:
    """Each function's score as a completions.jsonl column: its name, or rewards/<name> where a column above
    has it (TRL's `def reward(completions, **kwargs)` would overwrite the weighted total).

    Example: {"reward": 0.5, "brevity": 0.1} -> {"rewards/reward": 0.5, "brevity": 0.1}
    """
    return {f"rewards/{name}" if name in COMPLETION_COLUMNS else name: value for name, value in rewards.items()}


def load_reward_funcs(names: list[str]) -> list[RewardFunc]:
    """Resolves each name: a built-in, `module:function`, or `path/to/file.py:function`.

    Example: ["math_accuracy", "my_rewards:brevity"] -> [RewardFunc(name="math_accuracy", ...),
    RewardFunc(name="brevity", ...)]
    """
    funcs = [_load_one(name) for name in names]
    seen: set[str] = set()
    for func in funcs:
        if func.name in seen:
            raise ValueError(f"reward function '{func.name}' is given twice; list each reward function once")
        seen.add(func.name)
    return funcs


async def score(
    funcs: list[RewardFunc],
    weights: list[float] | None,
    prompts: list[Any],
    completions: list[Any],
    columns: dict[str, list[Any]],
    *,
    completion_ids: list[list[int]] | None = None,
    trainer_state: TrainerState | None = None,
    nonfinite: str = "error",
    timeout_s: float | None = None,
    logs: RewardLogs | None = None,
) -> tuple[list[float | None], dict[str, list[float | None]]]:
    """(weighted total per completion, each function's raw values). Weights default to 1.0 each.

    Every function is called with keywords, as TRL calls it: prompts=, completions= (message lists
    `[{"role": "assistant", "content": text}]` where the prompt is a message list, else strings),
    completion_ids=, trainer_state=, log_metric= and log_extra= (what they log goes to `logs`) and every
    dataset column by name. Async functions are awaited concurrently; sync ones run in worker threads meanwhile. As in TRL (nansum), a None adds nothing to
    the total and the other weights are not renormalised; a completion every function scored None has
    total None (TRL's unscorable: it gets advantage 0 and stays out of its group's baseline).
    Example: values {"a": [1.0, None, None], "b": [0.5, 0.5, None]}, weights [1.0, 2.0] -> [2.0, 1.0, None]
    """
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ValueError(
            f"got {len(weights)} reward weights for {len(funcs)} reward functions; pass one weight per function"
        )
    assert all(len(v) == len(completions) for v in columns.values()), "columns must align with completions"
    assert not set(columns) & set(REWARD_KEYWORDS), "a column may not be named like a keyword (data/load.py refuses it)"
    kwargs = {
        **columns,
        "prompts": prompts,
        "completions": [_as_messages(c) if isinstance(p, list) and isinstance(c, str) else c for p, c in zip(prompts, completions)],
        "completion_ids": completion_ids if completion_ids is not None else [[] for _ in completions],
        "trainer_state": trainer_state or TrainerState(),
        **_loggers(logs if logs is not None else RewardLogs(), len(completions), reserved={*COMPLETION_COLUMNS, *(f.name for f in funcs)}),
    }
    results = await asyncio.gather(*(_call(f, kwargs, len(completions), timeout_s) for f in funcs))
    values = {f.name: result for f, result in zip(funcs, results)}
    totals = [_total(weights, [v[i] for v in results]) for i in range(len(completions))]
    if nonfinite == "error":
        _check_finite(values, totals)
    return [t if t is None or math.isfinite(t) else math.nan for t in totals], values


def _loggers(logs: RewardLogs, num_completions: int, *, reserved: set[str]) -> dict[str, Callable[..., None]]:
    """TRL's `log_metric` and `log_extra` keywords, writing into `logs`. A wrong call raises in the reward
    function, so it is reported as its error, at its line."""

    def log_metric(name: str, value: float) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"log_metric's name must be a non-empty string, got {name!r}")
        try:
            number = float(value)  # a Python or numpy number, a one-element tensor
        except (TypeError, ValueError):
            number = None
        if number is None or isinstance(value, str):
            raise ValueError(f"log_metric({name!r}, ...) takes a number, got {value!r}")
        logs.metrics.setdefault(name, []).append(number)

    def log_extra(column: str, values: list[Any]) -> None:
        if not isinstance(column, str) or not column or column in reserved:
            raise ValueError(f"log_extra's column must be a string naming no other column ({', '.join(sorted(reserved))}), got {column!r}")
        values = list(values)
        if len(values) != num_completions:
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {num_completions} completions; give one per completion")
        plain = [v.item() if hasattr(v, "item") else v for v in values]  # numpy and tensor scalars as Python's
        bad = [v for v in plain if not (v is None or isinstance(v, (str, bool, int, float)))]
        if bad:
            raise ValueError(f"log_extra({column!r}, ...) takes strings, numbers, booleans or None (a completions.jsonl cell), got {bad[0]!r}")
        logs.extra[column] = plain

    return {"log_metric": log_metric, "log_extra": log_extra}


def _as_messages(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def _total(weights: list[float], values: list[float | None]) -> float | None:
    if all(v is None for v in values):
        return None
    return float(sum(w * v for w, v in zip(weights, values) if v is not None))


def _check_finite(values: dict[str, list[float | None]], totals: list[float]) -> None:
    """A non-finite reward would make the loss NaN and every weight after it (issue 15): stop, naming it."""
    fix = "return finite floats (or None), or pass --reward_nonfinite skip to drop such groups"
    for name, result in values.items():
        for i, value in enumerate(result):
            if value is not None and not math.isfinite(value):
                raise ValueError(f"reward function '{name}' returned {value!r} at position {i}; {fix}")
    for i, total in enumerate(totals):
        if total is not None and not math.isfinite(total):
            raise ValueError(f"the weighted reward of completion {i} overflows to {total!r}; {fix}")


async def _call(func: RewardFunc, kwargs: dict[str, Any], expected: int, timeout_s: float | None) -> list[float | None]:
    synchronous = not inspect.iscoroutinefunction(func.fn)
    if synchronous and (hung := still_running_abandoned(f"reward-{func.name}")) >= MAX_HUNG_CALLS:
        raise HungRewardError(
            f"reward function '{func.name}' has {hung} calls still running past --reward_timeout_s "
            f"({timeout_s:g} s; each holds a thread Python cannot stop): it hangs; make it return (or raise --reward_timeout_s)"
        )
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            if not synchronous:
                result = await func.fn(**kwargs)
            else:
                result = await in_daemon_thread(functools.partial(func.fn, **kwargs), name=f"reward-{func.name}")
                if inspect.isawaitable(result):
                    result = await result
    except Exception as error:  # re-raised as one line naming the function and its line; nothing is swallowed
        if deadline.expired():
            raise RewardTimeoutError(f"reward function '{func.name}' did not return within {timeout_s:g} s (--reward_timeout_s)") from None
        raised = error.error if isinstance(error, Escaped) else error  # a SystemExit in a sync function: said as itself
        message = " ".join(str(raised).split())
        where = user_frame(raised, func.fn)
        raise ValueError(f"reward function '{func.name}' raised {type(raised).__name__}{where}: {message}") from error
    return _check_values(func.name, result, expected)


def user_frame(error: BaseException, fn: Any) -> str:
    """" at file:line" of the deepest frame of `error` in the file that defines `fn` (the user's code,
    not tandem's or a library's), or "" when none is.

    Example: a KeyError raised on line 7 of ./my_rewards.py -> " at my_rewards.py:7"
    """
    try:
        home = inspect.getsourcefile(inspect.unwrap(fn))
    except TypeError:  # a builtin or a callable object without source
        return ""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename == home]
    if not frames:
        return ""
    path = os.path.relpath(frames[-1].filename) if frames[-1].filename.startswith(os.getcwd() + os.sep) else frames[-1].filename
    return f" at {path}:{frames[-1].lineno}"


def _check_values(name: str, result: Any, expected: int) -> list[float | None]:
    if not isinstance(result, (list, tuple)):
        kind = type(result).__name__
        raise ValueError(f"reward function '{name}' must return a list of {expected} floats or None, got {kind}")
    if len(result) != expected:
        raise ValueError(
            f"reward function '{name}' returned {len(result)} values for {expected} completions; return one per completion"
        )
    for i, value in enumerate(result):
        if value is not None and not isinstance(value, numbers.Real):
            raise ValueError(
                f"reward function '{name}' returned {value!r} at position {i}; return floats, or None where not applicable"
            )
    return [None if value is None else _as_float(value) for value in result]


def _as_float(value: numbers.Real) -> float:
    """float(value); an int past the float range is the infinity of its sign (a non-finite reward, said as one)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _load_one(name: str) -> RewardFunc:
    if name in BUILTINS:
        return RewardFunc(name=name, fn=BUILTINS[name])
    if ":" not in name:
        raise ValueError(f"unknown reward function '{name}'; {USAGE}")
    fn = load_object(name, what="reward function")
    if not callable(fn):
        raise ValueError(f"reward function '{name}' is not a function; name a function after the colon")
    return RewardFunc(name=name.rsplit(":", 1)[1], fn=fn)
