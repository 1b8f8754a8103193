import math

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
