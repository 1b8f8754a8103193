"""The loop's reward step: unscorable rollouts, group-relative advantages and reward metrics, as TRL's."""

from __future__ import annotations

import asyncio
import math

import pytest

from tandemrl.pipeline.loop import LoopSettings, _batch
from tandemrl.types import Example, Group, Rollout, TokenTrace


def group(*rewards: float | None) -> Group:
    example = Example(prompt="p")
    trace = TokenTrace(token_ids=[1, 2], loss_mask=[False, True], logprobs=[0.0, -1.0], policy_versions=[-1, 0])
    return Group(example=example, rollouts=[Rollout(example=example, trace=trace, reward=r) for r in rewards])


def settings(**overrides) -> LoopSettings:
    values = dict(
        max_steps=1, num_prompts_per_step=1, num_generations=4, scale_rewards="none", drop_zero_variance_groups=False,
        seed=0, sleep_level=0, log_completions_steps=0, save_steps=0, save_total_limit=0,
    )
    return LoopSettings(**{**values, **overrides})


def test_unscorable_rollout_gets_zero_advantage_and_stays_out_of_the_baseline() -> None:
    batch, metrics = _batch([group(1.0, 0.0, None, 0.0)], settings(), version=0)
    # the baseline is the mean of the three scored rewards (1/3), not of four with a 0.0 for the None
    assert batch.groups[0].advantages == pytest.approx([2 / 3, -1 / 3, 0.0, -1 / 3])
    assert metrics["rewards/num_unscorable"] == 1.0
    assert metrics["reward"] == pytest.approx(1 / 3)
    assert metrics["reward_std"] == pytest.approx(math.sqrt(1 / 3))  # Bessel-corrected std of [1, 0, 0]


@pytest.mark.parametrize("scale, expected", [("group", 0.5), ("none", 0.5), ("batch", 0.0)])
def test_frac_reward_zero_std_follows_scale_rewards_as_trl(scale, expected) -> None:
    _, metrics = _batch([group(1.0, 1.0), group(1.0, 0.0)], settings(scale_rewards=scale, num_prompts_per_step=2), version=0)
    assert metrics["frac_reward_zero_std"] == expected
    _, metrics = _batch([group(1.0, 1.0), group(1.0, 1.0)], settings(scale_rewards=scale), version=0)
    assert metrics["frac_reward_zero_std"] == 1.0


def test_zero_variance_groups_are_kept_unless_dropping_is_asked() -> None:
    groups = [group(1.0, 1.0), group(1.0, 0.0)]
    assert len(_batch(groups, settings(num_prompts_per_step=2), version=0)[0].groups) == 2
    assert len(_batch(groups, settings(num_prompts_per_step=2, drop_zero_variance_groups=True), version=0)[0].groups) == 1


def test_per_function_reward_std_is_bessel_corrected() -> None:
    g = group(1.0, 0.0, 0.0)
    for r in g.rollouts:
        r.rewards = {"acc": r.reward}
    _, metrics = _batch([g], settings(), version=0)
    assert metrics["rewards/acc/std"] == pytest.approx(math.sqrt(1 / 3))


def test_dynamic_sampling_refills_the_batch_to_p_informative_groups(monkeypatch) -> None:
    from tandemrl.pipeline import loop

    script = [[group(1.0, 1.0), group(0.0, 1.0), group(1.0, 1.0)], [group(1.0, 0.0), group(0.0, 0.0), group(0.5, 0.0)]]
    calls = []

    async def scripted(parts, settings, step, *, round_=0):
        calls.append(round_)
        return script[round_], {"time/generate": 1.0, "time/reward": 0.5}

    monkeypatch.setattr(loop, "_generate_and_score", scripted)
    s = settings(num_prompts_per_step=3, drop_zero_variance_groups=True, max_dynamic_sampling_rounds=5)
    groups, times = asyncio.run(loop._refill(None, s, 0, script[0], {"time/generate": 1.0, "time/reward": 0.5}))
    assert calls == [1]  # one extra round brought 3 groups with variance
    assert times == {"time/generate": 2.0, "time/reward": 1.0, "dynamic_sampling/rounds": 1.0, "dynamic_sampling/num_groups_sampled": 6.0}
    batch, metrics = _batch(groups, s, version=0)
    assert [g.rewards for g in batch.groups] == [[0.0, 1.0], [1.0, 0.0], [0.5, 0.0]]
    assert metrics["frac_reward_zero_std"] == 0.5  # of all the groups sampled this step


def test_dynamic_sampling_stops_after_its_rounds(monkeypatch) -> None:
    from tandemrl.pipeline import loop

    async def flat(parts, settings, step, *, round_=0):
        return [group(1.0, 1.0)], {"time/generate": 0.0, "time/reward": 0.0}

    monkeypatch.setattr(loop, "_generate_and_score", flat)
    s = settings(num_prompts_per_step=1, drop_zero_variance_groups=True, max_dynamic_sampling_rounds=2)
    groups, times = asyncio.run(loop._refill(None, s, 0, [group(1.0, 1.0)], {"time/generate": 0.0, "time/reward": 0.0}))
    assert times["dynamic_sampling/rounds"] == 2.0 and len(groups) == 3
    assert _batch(groups, s, version=0)[0].groups == []


def test_batch_scaled_advantages_take_the_std_of_the_whole_generation_round() -> None:
    """--steps_per_generation: a step trains P of the round's groups, scaled as TRL's generation batch."""
    import statistics

    first, second = group(1.0, 0.0), group(3.0, 0.0)
    batch, _ = _batch([first], settings(scale_rewards="batch"), version=0, round_groups=[first, second])
    std = statistics.stdev([1.0, 0.0, 3.0, 0.0]) + 1e-4
    assert batch.groups[0].advantages == pytest.approx([0.5 / std, -0.5 / std])


@pytest.mark.parametrize("scale", ["group", "none", "batch"])
def test_frac_reward_zero_std_counts_no_group_with_fewer_than_two_scored_rewards(scale):
    """TRL's std of one scored reward is NaN, not zero: such a group (batch) is not counted zero-std."""
    import torch

    from tandemrl.algo.advantage import zero_variance_groups
    from tandemrl.pipeline.loop import frac_zero_std

    nan = math.nan
    rewards = torch.tensor([[1.0, 1.0], [1.0, nan], [0.0, 1.0]])
    expected = {"group": 1 / 3, "none": 1 / 3, "batch": 0.0}[scale]
    assert frac_zero_std(rewards, zero_variance_groups(rewards), scale) == pytest.approx(expected)
    lone = torch.tensor([[2.0, nan], [nan, nan]])
    assert frac_zero_std(lone, zero_variance_groups(lone), scale) == 0.0


def test_what_rewards_logged_is_the_mean_over_the_groups_and_never_hides_a_metric_of_tandem() -> None:
    """TRL's log_metric: the step logs the mean under the name as given; `reward` stays tandem's own."""
    a, b, c = group(1.0, 0.0), group(1.0, 1.0), group(0.0, 0.0)
    a.logged, b.logged, c.logged = {"acc": 0.5, "reward": 99.0}, {"acc": 1.0}, {}
    _, metrics = _batch([a, b, c], settings(num_prompts_per_step=3), version=0)
    assert metrics["acc"] == 0.75 and metrics["reward"] == 0.5
