import math

import pytest
import torch

from tandemrl.algo.advantage import group_relative_advantages, zero_variance_groups


def test_dr_grpo_advantage_is_reward_minus_group_mean():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 0.0, 1.0, 1.0]])
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]])
    assert torch.equal(group_relative_advantages(rewards, scale="none"), expected)


def test_grpo_advantage_divides_by_unbiased_group_std_plus_eps():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    std = math.sqrt((4 * 0.25) / 3)  # Bessel-corrected, as torch.std and TRL
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / (std + 1e-4)
    torch.testing.assert_close(group_relative_advantages(rewards, scale="group"), expected)


def test_batch_scale_centres_per_group_and_divides_by_batch_std():
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # group means 0.5 and 1.0; batch std of [1, 0, 1, 1]: mean 0.75, var (3 * 0.0625 + 0.5625) / 3 = 0.25
    expected = torch.tensor([[0.5, -0.5], [0.0, 0.0]]) / (0.5 + 1e-4)
    torch.testing.assert_close(group_relative_advantages(rewards, scale="batch"), expected)


def test_all_equal_group_gets_zero_advantage_not_nan():
    rewards = torch.tensor([[3.0, 3.0, 3.0]])
    assert torch.equal(group_relative_advantages(rewards, scale="group"), torch.zeros(1, 3))


def test_group_of_one_gets_zero_advantage_not_nan():
    rewards = torch.tensor([[1.0], [0.0]])
    assert torch.equal(group_relative_advantages(rewards, scale="group"), torch.zeros(2, 1))


def test_zero_variance_groups_are_flagged_for_dynamic_sampling():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert zero_variance_groups(rewards).tolist() == [True, False, True]


def test_nan_rewards_stay_out_of_mean_and_std_and_get_zero_advantage():
    nan = float("nan")
    rewards = torch.tensor([[1.0, 0.0, nan, 1.0]])
    std = math.sqrt((2 * (1 / 3) ** 2 + (2 / 3) ** 2) / 2)  # of [1, 0, 1]
    expected = torch.tensor([[1 / 3, -2 / 3, 0.0, 1 / 3]]) / (std + 1e-4)
    torch.testing.assert_close(group_relative_advantages(rewards, scale="group"), expected)
    assert zero_variance_groups(torch.tensor([[1.0, nan, 1.0]])).tolist() == [True]


def _loop_advantages(rows: list[list[float]], scale: str) -> list[list[float]]:
    """TRL's formula as a loop: r - mean(group), over (std + 1e-4) of the group or of every reward; NaN
    rewards left out of both and given 0; std of fewer than two rewards is 0."""
    import statistics

    def std(values):
        return statistics.stdev(values) if len(values) >= 2 else 0.0

    every = [x for row in rows for x in row if not math.isnan(x)]
    out = []
    for row in rows:
        scored = [x for x in row if not math.isnan(x)]
        divisor = {"group": std(scored) + 1e-4, "batch": std(every) + 1e-4, "none": 1.0}[scale]
        out.append([0.0 if math.isnan(x) else (x - sum(scored) / len(scored)) / divisor for x in row])
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_a_loop_on_random_groups_with_nan_equal_rewards_and_groups_of_one(scale):
    import random

    rng = random.Random(0)
    for _ in range(30):
        size = rng.choice([1, 2, 4])
        rows = [[1.0] * size if rng.random() < 0.2 else [rng.choice([0.0, 1.0, rng.gauss(0, 2)]) for _ in range(size)] for _ in range(rng.randint(1, 5))]
        for row in rows:
            if rng.random() < 0.3:
                row[rng.randrange(size)] = float("nan")
        got = group_relative_advantages(torch.tensor(rows, dtype=torch.float64), scale=scale)
        torch.testing.assert_close(got.double(), torch.tensor(_loop_advantages(rows, scale), dtype=torch.float64), atol=1e-4, rtol=1e-5)
        flat = [len({x for x in row if not math.isnan(x)}) <= 1 for row in rows]
        assert zero_variance_groups(torch.tensor(rows, dtype=torch.float64)).tolist() == flat
