"""The step's seconds split on the trainer's critical path (they add up), and TRL's terminated lengths."""

from __future__ import annotations

from types import SimpleNamespace

from tandemrl.pipeline.loop import critical_path
from tandemrl.pipeline.producer import terminated_lengths


def test_reward_time_counts_only_what_ran_after_generation_and_within_the_wait():
    times = {"time/reward": 0.3, "rollout/reward_s": 2.1, "rollout/generate_s": 0.9}
    split = critical_path(times, 1.0)
    assert (split["time/generate"], split["time/reward"]) == (0.7, 0.3) and split["rollout/reward_s"] == 2.1
    ahead = critical_path(times, 0.1)  # generated during the previous step (--max_staleness): only the wait counts
    assert ahead["time/generate"] + ahead["time/reward"] == 0.1 and ahead["time/reward"] == 0.1


def rollout(length: int, finish: str) -> SimpleNamespace:
    return SimpleNamespace(trace=SimpleNamespace(num_sampled=length), finish_reason=finish)


def test_terminated_lengths_leave_out_completions_cut_at_the_limit_and_are_0_without_any():
    got = terminated_lengths([rollout(3, "stop"), rollout(8, "length"), rollout(5, "stop")])
    assert got == {"completions/mean_terminated_length": 4.0, "completions/min_terminated_length": 3.0, "completions/max_terminated_length": 5.0}
    assert set(terminated_lengths([rollout(8, "length")]).values()) == {0.0}


def test_a_constant_reward_is_warned_at_its_first_step_and_when_it_lasts(caplog):
    from tandemrl.pipeline.loop import warn_constant_reward

    for run, step in zip(range(1, 12), range(5, 16)):
        warn_constant_reward(run, step)
    warned = [r.message for r in caplog.records if "rewards are equal" in r.message]
    assert len(warned) == 2 and warned[0].startswith("step 5:") and "the last 10 steps" in warned[1]
