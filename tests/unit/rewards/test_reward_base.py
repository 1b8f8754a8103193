"""Loading reward functions by name and scoring with them, including every error path."""

from __future__ import annotations

import asyncio
import re
import sys
import textwrap
import threading
import time
import types

import pytest

from tandemrl.rewards.base import RewardFunc, RewardLogs, TrainerState, load_reward_funcs, score


def _run(funcs, weights, completions, columns=None):
    columns = columns if columns is not None else {}
    return asyncio.run(score(funcs, weights, ["p"] * len(completions), completions, columns))


def test_loads_builtins_modules_and_files(tmp_path, monkeypatch) -> None:
    (tmp_path / "my_rewards.py").write_text("def brevity(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    (tmp_path / "other.py").write_text("def shout(prompts, completions, **kw):\n    return [0.5] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    funcs = load_reward_funcs(["math_accuracy", "my_rewards:brevity", f"{tmp_path / 'other.py'}:shout"])
    assert [f.name for f in funcs] == ["math_accuracy", "brevity", "shout"]
    assert funcs[2].fn(["p"], ["c"]) == [0.5]


def test_unknown_name_lists_the_choices() -> None:
    message = "unknown reward function 'x'; use one of math_accuracy, format, length, or module:function / path/file.py:function"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        load_reward_funcs(["x"])


def test_bad_module_file_or_attribute_say_the_fix(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot import 'no_such_module_xyz'"):
        load_reward_funcs(["no_such_module_xyz:f"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reward_funcs([f"{tmp_path / 'missing.py'}:f"])
    with pytest.raises(ValueError, match="has no function 'nope'"):
        load_reward_funcs(["tandemrl.rewards.builtins:nope"])
    with pytest.raises(ValueError, match="given twice"):
        load_reward_funcs(["format", "tandemrl.rewards.builtins:format"])


def test_score_weights_sum_and_none_adds_nothing() -> None:
    funcs = [
        RewardFunc(name="a", fn=lambda completions, **kw: [1.0, None]),
        RewardFunc(name="b", fn=lambda completions, **kw: [0.5, 0.5]),
    ]
    totals, values = _run(funcs, [1.0, 2.0], ["x", "y"])
    assert totals == [2.0, 1.0]
    assert values == {"a": [1.0, None], "b": [0.5, 0.5]}
    assert _run(funcs, None, ["x", "y"])[0] == [1.5, 0.5]


def test_score_passes_columns_by_name() -> None:
    funcs = load_reward_funcs(["math_accuracy"])
    totals, _ = _run(funcs, None, ["\\boxed{3}", "\\boxed{4}"], {"answer": ["#### 3", "#### 3"], "id": [1, 2]})
    assert totals == [1.0, 0.0]


def test_async_functions_run_concurrently_with_sync_ones_in_threads() -> None:
    async def slow_async(prompts, completions, **kw):
        await asyncio.sleep(0.2)
        return [1.0] * len(completions)

    def sync_in_thread(prompts, completions, **kw):
        time.sleep(0.2)
        return [float(threading.current_thread() is not threading.main_thread())] * len(completions)

    funcs = [RewardFunc(name=f"a{i}", fn=slow_async) for i in range(3)] + [RewardFunc(name="s", fn=sync_in_thread)]
    start = time.perf_counter()
    totals, values = _run(funcs, None, ["x"])
    assert time.perf_counter() - start < 0.6
    assert totals == [4.0] and values["s"] == [1.0]


def test_async_function_loaded_from_a_file(tmp_path) -> None:
    path = tmp_path / "judge.py"
    path.write_text(textwrap.dedent("""
        import asyncio
        async def judge(prompts, completions, **kw):
            await asyncio.sleep(0)
            return [float(len(c)) for c in completions]
    """))
    totals, _ = _run(load_reward_funcs([f"{path}:judge"]), None, ["ab", "c"])
    assert totals == [2.0, 1.0]


def test_a_raising_function_becomes_one_line_naming_it() -> None:
    def broken(prompts, completions, **kw):
        raise RuntimeError("no column\n'answer'")

    with pytest.raises(ValueError, match=r"^reward function 'broken' raised RuntimeError at \S*test_reward_base.py:\d+: no column 'answer'$"):
        _run([RewardFunc(name="broken", fn=broken)], None, ["x"])


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ([1.0], "reward function 'f' returned 1 values for 2 completions; return one per completion"),
        (1.0, "reward function 'f' must return a list of 2 floats or None, got float"),
        ([1.0, "yes"], "reward function 'f' returned 'yes' at position 1; return floats, or None where not applicable"),
    ],
)
def test_wrong_length_or_types_name_the_function(result, message) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _run([RewardFunc(name="f", fn=lambda completions, **kw: result)], None, ["x", "y"])


def test_weights_must_match_functions() -> None:
    funcs = load_reward_funcs(["format", "length"])
    message = "got 1 reward weights for 2 reward functions; pass one weight per function"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _run(funcs, [1.0], ["x"])


def test_bools_and_ints_become_floats() -> None:
    totals, values = _run([RewardFunc(name="f", fn=lambda completions, **kw: [True, 0])], None, ["x", "y"])
    assert values["f"] == [1.0, 0.0] and all(type(v) is float for v in values["f"])


SKIP_FIX = "return finite floats (or None), or pass --reward_nonfinite skip to drop such groups"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_reward_is_an_error_naming_the_function(bad) -> None:
    message = f"reward function 'f' returned {bad!r} at position 1; {SKIP_FIX}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _run([RewardFunc(name="f", fn=lambda completions, **kw: [1.0, bad])], None, ["x", "y"])


def test_an_int_past_the_float_range_is_a_non_finite_reward_naming_the_function() -> None:
    """float(10**400) raises OverflowError: it escaped as itself, not as one line naming the function."""
    message = f"reward function 'f' returned inf at position 1; {SKIP_FIX}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        _run([RewardFunc(name="f", fn=lambda completions, **kw: [1, 10**400])], None, ["x", "y"])
    funcs = [RewardFunc(name="f", fn=lambda completions, **kw: [1, -(10**400)])]
    totals, values = asyncio.run(score(funcs, None, ["p", "p"], ["x", "y"], {}, nonfinite="skip"))
    assert totals[0] == 1.0 and totals[1] != totals[1] and values["f"] == [1.0, -float("inf")]


def test_a_weighted_total_that_overflows_is_an_error_too() -> None:
    with pytest.raises(ValueError, match=re.escape(f"the weighted reward of completion 0 overflows to inf; {SKIP_FIX}")):
        _run([RewardFunc(name="f", fn=lambda completions, **kw: [1e308])], [10.0], ["x"])


def test_with_skip_non_finite_totals_come_back_as_nan() -> None:
    funcs = [RewardFunc(name="f", fn=lambda completions, **kw: [1.0, float("inf")])]
    totals, values = asyncio.run(score(funcs, None, ["p", "p"], ["x", "y"], {}, nonfinite="skip"))
    assert totals[0] == 1.0 and totals[1] != totals[1] and values["f"] == [1.0, float("inf")]


def test_called_with_keywords_as_trl_documents() -> None:
    """TRL's docs write `def reward(completions, **kwargs)`: that must work (it failed when called positionally)."""
    seen = {}

    def reward(completions, **kwargs):
        seen.update(kwargs, completions=completions)
        return [float(len(c)) for c in completions]

    totals, _ = asyncio.run(score(
        [RewardFunc(name="r", fn=reward)], None, ["p1", "p2"], ["ab", "c"], {"answer": ["1", "2"]},
        completion_ids=[[5, 6], [7]], trainer_state=TrainerState(global_step=3, epoch=0.5, max_steps=10),
    ))
    assert totals == [2.0, 1.0]
    assert seen["prompts"] == ["p1", "p2"] and seen["completions"] == ["ab", "c"] and seen["answer"] == ["1", "2"]
    assert seen["completion_ids"] == [[5, 6], [7]]
    assert (seen["trainer_state"].global_step, seen["trainer_state"].epoch) == (3, 0.5)


def test_conversational_prompts_give_message_completions() -> None:
    seen = {}

    def reward(prompts, completions, **kwargs):
        seen["completions"] = completions
        return [1.0] * len(completions)

    prompt = [{"role": "user", "content": "2 + 2?"}]
    asyncio.run(score([RewardFunc(name="r", fn=reward)], None, [prompt], ["\\boxed{4}"], {}))
    assert seen["completions"] == [[{"role": "assistant", "content": "\\boxed{4}"}]]
    # the built-ins read message completions too
    totals, _ = asyncio.run(score(load_reward_funcs(["math_accuracy"]), None, [prompt], ["\\boxed{4}"], {"answer": ["4"]}))
    assert totals == [1.0]


def test_a_completion_every_function_scored_none_has_total_none() -> None:
    funcs = [RewardFunc(name="a", fn=lambda completions, **kw: [1.0, None]), RewardFunc(name="b", fn=lambda completions, **kw: [None, None])]
    assert _run(funcs, None, ["x", "y"])[0] == [1.0, None]


@pytest.mark.parametrize("kind", [SystemExit, KeyboardInterrupt])
def test_a_sync_function_raising_systemexit_or_keyboardinterrupt_is_one_line_at_once(kind) -> None:
    """It ended its worker thread without a word, and the step waited the whole --reward_timeout_s."""

    def leaves(prompts, completions, **kw):
        raise kind(3)

    started = time.monotonic()
    with pytest.raises(ValueError, match=rf"^reward function 'leaves' raised {kind.__name__} at \S*test_reward_base.py:\d+: 3$"):
        asyncio.run(score([RewardFunc(name="leaves", fn=leaves)], None, ["p"], ["x"], {}, timeout_s=30))
    assert time.monotonic() - started < 5


TRL_LOGGING = """
def reward(completions, log_metric, log_extra, **kwargs):  # TRL 1.16's signature: both keywords taken by name
    lengths = [len(c) for c in completions]
    log_metric("mean_chars", sum(lengths) / len(lengths))
    log_extra("chars", lengths)
    log_extra("head", [c[:1] for c in completions])
    return [float(n) for n in lengths]

def wrong_length(completions, log_extra, **kwargs):
    log_extra("chars", [1])
    return [0.0] * len(completions)

def not_a_number(completions, log_metric, **kwargs):
    log_metric("acc", "high")
    return [0.0] * len(completions)

def clobbers_a_column(completions, log_extra, **kwargs):
    log_extra("reward", [0] * len(completions))
    return [0.0] * len(completions)
"""


def test_trl_log_metric_and_log_extra_are_passed_and_collected(tmp_path) -> None:
    """TRL 1.16 passes log_metric and log_extra to reward functions; one that took them failed (TypeError:
    missing arguments, issue 36). What they log lands in `logs`; a wrong call is the function's error, at its line."""
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_LOGGING)
    logs = RewardLogs()
    funcs = load_reward_funcs([f"{path}:reward"])
    totals, _ = asyncio.run(score(funcs, None, ["p", "p"], ["ab", "cde"], {}, logs=logs))
    assert totals == [2.0, 3.0]
    assert logs.metrics == {"mean_chars": [2.5]} and logs.extra == {"chars": [2, 3], "head": ["a", "c"]}
    asyncio.run(score(funcs, None, ["p"], ["x"], {}))  # no logs asked for: still passed, and dropped
    for name, line, message in [
        ("wrong_length", 10, "log_extra('chars', ...) got 1 values for 2 completions; give one per completion"),
        ("not_a_number", 14, "log_metric('acc', ...) takes a number, got 'high'"),
        ("clobbers_a_column", 18, "log_extra's column must be a string naming no other column (advantage, clobbers_a_column, completion, "),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"reward function '{name}' raised ValueError at {path}:{line}: {message}")):
            asyncio.run(score(load_reward_funcs([f"{path}:{name}"]), None, ["p", "p"], ["ab", "cde"], {}))

def test_a_sync_function_that_keeps_hanging_stops_the_run_once_its_abandoned_calls_pile_up() -> None:
    """Each timed-out sync call leaves a thread Python cannot stop; at MAX_HUNG_CALLS still running, the next call is
    one line at once instead of another thread (before: threads piled up for as long as the run went on)."""
    from tandemrl.rewards.base import MAX_HUNG_CALLS, HungRewardError, RewardTimeoutError

    release = threading.Event()

    def hangs(prompts, completions, **kw):
        release.wait(60)
        return [0.0] * len(completions)

    funcs = [RewardFunc(name="hangs", fn=hangs)]
    try:
        for _ in range(MAX_HUNG_CALLS):
            with pytest.raises(RewardTimeoutError):
                asyncio.run(score(funcs, None, ["p"], ["x"], {}, timeout_s=0.05))
        started = time.monotonic()
        with pytest.raises(HungRewardError, match=rf"^reward function 'hangs' has {MAX_HUNG_CALLS} calls still running past --reward_timeout_s"):
            asyncio.run(score(funcs, None, ["p"], ["x"], {}, timeout_s=0.05))
        assert time.monotonic() - started < 0.05
    finally:
        release.set()
    for thread in [t for t in threading.enumerate() if t.name == "reward-hangs"]:
        thread.join(5)
    assert asyncio.run(score(funcs, None, ["p"], ["x"], {}, timeout_s=5))[0] == [0.0]  # ended threads count no more
