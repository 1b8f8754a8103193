import math
from types import SimpleNamespace

import pytest
import torch

from tandemrl.algo.loss import (
    clipped_surrogate,
    kl_k3,
    policy_loss,
    sequence_importance_weights,
    sequence_level_ratio_logprobs,
    token_weights,
    truncated_importance_weights,
)
from tandemrl.algo.presets import DAPO, GRPO, LossConfig

T, F = True, False


def _surrogate(ratio: float, advantage: float, config: LossConfig) -> tuple[float, float, float]:
    """(loss, clipped, d loss / d logprob) of one token at `ratio`."""
    logprobs = torch.tensor([math.log(ratio)], requires_grad=True)
    loss, clipped = clipped_surrogate(
        logprobs, torch.zeros(1), torch.tensor([advantage]), clip_low=config.clip_low, clip_high=config.clip_high
    )
    loss.sum().backward()
    return loss.item(), clipped.item(), logprobs.grad.item()


@pytest.mark.parametrize(
    "aggregation, expected",
    [
        ("token_mean", [0, 1 / 6, 1 / 6, 1 / 6, 0]),
        ("seq_mean_token_mean", [0, 1 / 8, 1 / 8, 1 / 4, 0]),
        ("seq_mean_token_sum_norm", [0, 1 / 40, 1 / 40, 1 / 40, 0]),
    ],
)
def test_token_weights_normalise_by_whole_step_counts(aggregation, expected):
    # sequence 0 has 2 trained tokens, sequence 1 has 1; the step has 4 sequences and 6 trained tokens
    weights = token_weights(
        torch.tensor([0, 0, 0, 1, 1]),
        torch.tensor([F, T, T, T, F]),
        aggregation=aggregation,
        num_sequences=4,
        num_tokens=6,
        max_completion_length=10,
    )
    torch.testing.assert_close(weights, torch.tensor(expected))


def test_ratio_one_gives_plain_policy_gradient():
    assert _surrogate(1.0, 2.0, GRPO) == pytest.approx((-2.0, 0.0, -2.0))


def test_grpo_clips_positive_ratio_at_one_plus_epsilon():
    assert _surrogate(1.5, 1.0, GRPO) == pytest.approx((-1.2, 1.0, 0.0))


def test_dapo_clip_higher_lets_positive_ratios_rise_further():
    assert _surrogate(1.25, 1.0, GRPO) == pytest.approx((-1.2, 1.0, 0.0))
    assert _surrogate(1.25, 1.0, DAPO) == pytest.approx((-1.25, 0.0, -1.25))


def test_negative_advantage_clips_ratio_below_one_minus_epsilon():
    assert _surrogate(0.5, -1.0, GRPO) == pytest.approx((0.8, 1.0, 0.0))


def test_pessimistic_bound_keeps_gradient_when_ratio_moves_against_advantage():
    assert _surrogate(1.5, -1.0, GRPO) == pytest.approx((1.5, 0.0, 1.5))
    assert _surrogate(0.5, 1.0, GRPO) == pytest.approx((-0.5, 0.0, -0.5))


def test_sequence_ratio_is_mean_log_ratio_of_trained_tokens_with_token_gradients():
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    old = torch.tensor([-1.1, -2.3, -0.9, 0.0])
    out = sequence_level_ratio_logprobs(logprobs, old, torch.tensor([0, 0, 1, 1]), torch.tensor([T, T, T, F]))
    torch.testing.assert_close(out, torch.tensor([0.2, 0.2, 0.4, 0.4]))  # the untrained token is left out
    (out * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_gspo_token_loss_equals_sequence_level_objective_in_value_and_gradient():
    # two sequences: s_0 = exp(0.2) inside the clip range 0.3, s_1 = exp(0.4) clipped (advantage > 0)
    config = LossConfig(clip_low=0.3, clip_high=0.3, aggregation="seq_mean_token_mean", ratio_level="sequence")
    seq_index, mask = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([F, T, T, T, T])
    old = torch.tensor([0.0, -1.1, -2.3, -0.9, -0.5])
    advantages = torch.tensor([1.0, 1.0, 1.0, 2.0, 2.0])
    batch = SimpleNamespace(
        loss_mask=mask, old_logprobs=old, behaviour_logprobs=old, advantages=advantages, seq_index=seq_index
    )
    weights = token_weights(
        seq_index, mask, aggregation="seq_mean_token_mean", num_sequences=2, num_tokens=4, max_completion_length=8
    )
    logprobs = torch.tensor([-7.0, -1.0, -2.0, -0.5, -0.1], requires_grad=True)
    loss, metrics = policy_loss(
        batch, logprobs, config=config, weights=weights, ref_logprobs=None, beta=0.0, tis_cap=2.0
    )
    loss.backward()
    reference = torch.tensor([-7.0, -1.0, -2.0, -0.5, -0.1], requires_grad=True)
    s = torch.stack([(reference[1:3] - old[1:3]).mean().exp(), (reference[3:] - old[3:]).mean().exp()])  # [2]
    a = torch.tensor([1.0, 2.0])
    expected = -torch.min(s * a, s.clamp(0.7, 1.3) * a).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logprobs.grad, reference.grad)
    assert metrics["clip_ratio"].item() == pytest.approx(0.5)  # half the (sequence-mean) weight is clipped


def test_kl_k3_hand_values_and_zero_at_reference():
    expected = torch.tensor([1 - math.log(2)])
    torch.testing.assert_close(kl_k3(torch.tensor([math.log(0.5)]), torch.tensor([0.0])), expected)
    torch.testing.assert_close(kl_k3(torch.tensor([-0.3, -2.0]), torch.tensor([-0.3, -2.0])), torch.zeros(2))
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_truncated_importance_weight_is_capped_and_carries_no_gradient():
    old = torch.tensor([math.log(3.0), math.log(0.5)], requires_grad=True)
    weights = truncated_importance_weights(old, torch.zeros(2), cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([2.0, 0.5]))
    assert not weights.requires_grad


def test_truncated_importance_weight_cap_zero_turns_it_off():
    assert torch.equal(truncated_importance_weights(torch.tensor([1.0, -5.0]), torch.zeros(2), cap=0.0), torch.ones(2))


def test_policy_loss_adds_tis_weighted_surrogate_and_beta_k3_kl():
    # ratio 1, A = 1: surrogate -1 per token; tis = min(exp(0 - ln 0.5), 1.5) = 1.5 and 1;
    # kl = 0.5 + ln 2 - 1 on token 0 (ref = ln 0.5), 0 on token 1; beta 0.1; token_mean weights 0.5
    batch = SimpleNamespace(
        loss_mask=torch.tensor([T, T]),
        old_logprobs=torch.zeros(2),
        behaviour_logprobs=torch.tensor([math.log(0.5), 0.0]),
        advantages=torch.ones(2),
        seq_index=torch.zeros(2, dtype=torch.long),
    )
    kl0 = 0.5 + math.log(2) - 1
    loss, metrics = policy_loss(
        batch, torch.zeros(2), config=GRPO, weights=torch.full((2,), 0.5),
        ref_logprobs=torch.tensor([math.log(0.5), 0.0]), beta=0.1, tis_cap=1.5,
    )  # fmt: skip
    assert loss.item() == pytest.approx(0.5 * (-1.5 + 0.1 * kl0) + 0.5 * -1.0)
    assert metrics["kl"].item() == pytest.approx(0.5 * kl0)
    assert metrics["tis_weight"].item() == pytest.approx(1.25)
    assert (metrics["clip_ratio"].item(), metrics["ratio"].item()) == pytest.approx((0.0, 1.0))


def test_untrained_positions_cannot_turn_the_loss_nan():
    # an untrained (weight 0) position whose ratio would overflow exp: loss and gradient stay finite
    batch = SimpleNamespace(
        loss_mask=torch.tensor([T, F]),
        old_logprobs=torch.tensor([0.0, -200.0]),
        behaviour_logprobs=torch.tensor([0.0, 0.0]),
        advantages=torch.ones(2),
        seq_index=torch.zeros(2, dtype=torch.long),
    )
    logprobs = torch.tensor([0.0, -1.0], requires_grad=True)
    weights = torch.tensor([1.0, 0.0])
    loss, _ = policy_loss(batch, logprobs, config=GRPO, weights=weights, ref_logprobs=None, beta=0.0, tis_cap=2.0)
    loss.backward()
    assert loss.item() == -1.0 and torch.isfinite(logprobs.grad).all()


def test_sequence_importance_weight_is_the_capped_sequence_likelihood_ratio():
    old = torch.tensor([math.log(2.0), math.log(1.5), 0.0, 5.0])
    weights = sequence_importance_weights(
        old, torch.zeros(4), torch.tensor([0, 0, 1, 1]), torch.tensor([T, T, T, F]), cap=4.0
    )  # the untrained token of sequence 1 is left out of its sum
    torch.testing.assert_close(weights, torch.tensor([3.0, 3.0, 1.0, 1.0]))


def test_gspo_with_tis_weights_each_sequence_by_its_own_sequence_weight():
    # sampler mismatch differs token by token: a token-level weight would bring token weights back into
    # GSPO's sequence-level objective. TRL's form: w_i = min(exp(sum_t (old - behaviour)), cap) per sequence.
    config = LossConfig(clip_low=0.3, clip_high=0.3, aggregation="seq_mean_token_mean", ratio_level="sequence")
    seq_index, mask = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([F, T, T, T, T])
    old = torch.tensor([0.0, -1.1, -2.3, -0.9, -0.5])
    behaviour = old - torch.tensor([0.0, 0.4, -0.3, 0.5, 0.6])  # w_0 = exp(0.1), w_1 = min(exp(1.1), 2) = 2
    batch = SimpleNamespace(loss_mask=mask, old_logprobs=old, behaviour_logprobs=behaviour, advantages=torch.tensor([1.0, 1.0, 1.0, -2.0, -2.0]), seq_index=seq_index)
    weights = token_weights(seq_index, mask, aggregation="seq_mean_token_mean", num_sequences=2, num_tokens=4, max_completion_length=8)
    logprobs = torch.tensor([-7.0, -1.0, -2.0, -0.8, -0.6], requires_grad=True)
    loss, metrics = policy_loss(batch, logprobs, config=config, weights=weights, ref_logprobs=None, beta=0.0, tis_cap=2.0)
    loss.backward()
    reference = logprobs.detach().clone().requires_grad_(True)
    s = torch.stack([(reference[1:3] - old[1:3]).mean().exp(), (reference[3:] - old[3:]).mean().exp()])  # [2]
    a, w = torch.tensor([1.0, -2.0]), torch.tensor([math.exp(0.1), 2.0])
    expected = (-torch.min(s * a, s.clamp(0.7, 1.3) * a) * w).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logprobs.grad, reference.grad)
