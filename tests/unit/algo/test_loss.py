import math
from types import SimpleNamespace

import pytest
import torch

from tandemrl.algo.loss import (
    cispo_surrogate,
    clipped_surrogate,
    combine_metrics,
    high_entropy_mask,
    importance_weights,
    kl_k3,
    policy_loss,
    sequence_log_ratio,
    token_weights,
)
import dataclasses

from tandemrl.algo.presets import CISPO, DAPO, GRPO, LossConfig

T, F = True, False


def _surrogate(ratio: float, advantage: float, config: LossConfig) -> tuple[float, float, float]:
    """(loss, clipped, d loss / d logprob) of one token at `ratio`."""
    logprobs = torch.tensor([math.log(ratio)], requires_grad=True)
    loss, low, high = clipped_surrogate(
        logprobs, torch.zeros(1), torch.tensor([advantage]), clip_low=config.clip_low, clip_high=config.clip_high
    )
    loss.sum().backward()
    return loss.item(), (low + high).item(), logprobs.grad.item()


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


def test_sequence_ratio_is_mean_log_ratio_of_trained_tokens_with_its_full_gradient():
    logprobs = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    old = torch.tensor([-1.1, -2.3, -0.9, 0.0])
    out = sequence_log_ratio(logprobs, old, torch.tensor([0, 0, 1, 1]), torch.tensor([T, T, T, F]))
    torch.testing.assert_close(out, torch.tensor([0.2, 0.2, 0.4, 0.4]))  # the untrained token is left out
    (out * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum().backward()
    # d/d lp_0 of (1 * s_0 + 2 * s_0) with s_0 the mean of two tokens: 3 / 2; sequence 1 has one trained token
    torch.testing.assert_close(logprobs.grad, torch.tensor([1.5, 1.5, 7.0, 0.0]))


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
    assert metrics["clip_ratio/region_mean"].item() == pytest.approx(0.5)  # half the (sequence-mean) weight is clipped


def test_kl_k3_hand_values_and_zero_at_reference():
    expected = torch.tensor([1 - math.log(2)])
    torch.testing.assert_close(kl_k3(torch.tensor([math.log(0.5)]), torch.tensor([0.0])), expected)
    torch.testing.assert_close(kl_k3(torch.tensor([-0.3, -2.0]), torch.tensor([-0.3, -2.0])), torch.zeros(2))
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()


def test_truncated_importance_weight_is_capped_and_carries_no_gradient():
    old = torch.tensor([math.log(3.0), math.log(0.5)], requires_grad=True)
    weights = importance_weights(old, torch.zeros(2), torch.tensor([0, 1]), torch.tensor([T, T]), mode="token_truncate", cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([2.0, 0.5]))
    assert not weights.requires_grad


def test_truncated_importance_weight_cap_zero_turns_it_off():
    ones = importance_weights(torch.tensor([1.0, -5.0]), torch.zeros(2), torch.tensor([0, 1]), torch.tensor([T, T]), mode="token_truncate", cap=0.0)
    assert torch.equal(ones, torch.ones(2))


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
    assert metrics["sampling/importance_sampling_ratio/mean"].item() == pytest.approx(1.25)
    assert (metrics["clip_ratio/region_mean"].item(), metrics["ratio"].item()) == pytest.approx((0.0, 1.0))


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
    weights = importance_weights(
        old, torch.zeros(4), torch.tensor([0, 0, 1, 1]), torch.tensor([T, T, T, F]), mode="sequence_truncate", cap=4.0
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


def _one_sequence(advantages, old=None, behaviour=None):
    n = len(advantages)
    old = torch.zeros(n) if old is None else torch.tensor(old)
    return SimpleNamespace(
        loss_mask=torch.ones(n, dtype=torch.bool), old_logprobs=old,
        behaviour_logprobs=old if behaviour is None else torch.tensor(behaviour),
        advantages=torch.tensor(advantages), seq_index=torch.zeros(n, dtype=torch.long),
    )  # fmt: skip


def test_bias_corrected_kl_is_k3_times_the_ratio_with_its_gradient():
    # TRL's use_bias_correction_kl: beta * k3 * r, r = exp(lp - old) differentiable even where it is 1
    batch, ref = _one_sequence([0.0], old=[-1.0]), torch.tensor([-1.5])
    for correction in (False, True):
        logprobs = torch.tensor([-1.0], requires_grad=True)
        config = dataclasses.replace(GRPO, kl_bias_correction=correction)
        loss, _ = policy_loss(batch, logprobs, config=config, weights=torch.ones(1), ref_logprobs=ref, beta=1.0, tis_cap=0.0)
        loss.backward()
        k3, dk3 = math.exp(-0.5) + 0.5 - 1, -math.exp(-0.5) + 1  # value and d/d lp at lp = old = -1
        assert loss.item() == pytest.approx(k3)
        assert logprobs.grad.item() == pytest.approx(dk3 + (k3 if correction else 0.0))


def test_delta_caps_the_ratio_of_a_negative_advantage():
    # ratio 3, A = -1: plain clipping keeps -min(-3, -1.2) = 3; delta 2 caps it at 2 (INTELLECT-2)
    for delta, expected in ((None, 3.0), (2.0, 2.0)):
        loss, low, high = clipped_surrogate(
            torch.tensor([math.log(3.0)]), torch.zeros(1), torch.tensor([-1.0]), clip_low=0.2, clip_high=0.2, delta=delta
        )
        assert loss.item() == pytest.approx(expected) and (low.item(), high.item()) == (0.0, 0.0)


def test_cispo_keeps_the_gradient_of_capped_tokens_with_a_detached_weight():
    logprobs = torch.tensor([-1.0, -1.0], requires_grad=True)
    loss, clipped = cispo_surrogate(logprobs, torch.tensor([math.log(3.0), 0.0]), torch.tensor([1.0, 1.0]), clip_high=2.0)
    loss.sum().backward()
    torch.testing.assert_close(loss.detach(), torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(logprobs.grad, torch.tensor([-2.0, -1.0]))  # capped, yet it still gets gradient
    assert clipped.tolist() == [1.0, 0.0]
    _, metrics = policy_loss(_one_sequence([1.0]), torch.zeros(1), config=CISPO, weights=torch.ones(1), ref_logprobs=None, beta=0.0, tis_cap=0.0)
    assert "cispo_clip_ratio" in metrics and "clip_ratio/region_mean" not in metrics


def test_clip_metrics_have_trl_names_and_per_sequence_extremes():
    # sequence 0: tokens at ratio 1.5 (A > 0, high-clipped) and 1.0; sequence 1: ratio 0.5 with A < 0 (low-clipped)
    batch = SimpleNamespace(
        loss_mask=torch.tensor([T, T, T]), old_logprobs=torch.zeros(3), behaviour_logprobs=torch.zeros(3),
        advantages=torch.tensor([1.0, 1.0, -1.0]), seq_index=torch.tensor([0, 0, 1]),
    )  # fmt: skip
    logprobs = torch.tensor([math.log(1.5), 0.0, math.log(0.5)])
    mean = torch.full((3,), 1 / 3)
    _, m = policy_loss(batch, logprobs, config=GRPO, weights=mean, ref_logprobs=None, beta=0.0, tis_cap=0.0)
    got = {k: round(v.item(), 6) for k, v in m.items() if k.startswith("clip_ratio/")}
    assert got == {
        "clip_ratio/low_mean": round(1 / 3, 6), "clip_ratio/high_mean": round(1 / 3, 6),
        "clip_ratio/region_mean": round(2 / 3, 6), "clip_ratio/low_min": 0.0, "clip_ratio/high_max": 0.5,
    }  # fmt: skip


def test_combine_metrics_sums_means_and_keeps_extremes():
    total = combine_metrics({}, {"loss": 1.0, "clip_ratio/low_min": 0.5, "clip_ratio/high_max": 0.1})
    combine_metrics(total, {"loss": 2.0, "clip_ratio/low_min": 0.2, "clip_ratio/high_max": 0.4})
    assert total == {"loss": 3.0, "clip_ratio/low_min": 0.2, "clip_ratio/high_max": 0.4}
    tensors = combine_metrics({}, {"loss": torch.tensor(1.0), "x_min": torch.tensor(0.5)})
    combine_metrics(tensors, {"loss": torch.tensor(2.0), "x_min": torch.tensor(0.2)})
    assert (tensors["loss"].item(), tensors["x_min"].item()) == (3.0, pytest.approx(0.2))


def test_high_entropy_mask_keeps_the_top_quantile_of_trained_tokens():
    entropy, mask = torch.tensor([0.1, 0.9, 0.5, 0.3, 2.0]), torch.tensor([T, T, T, T, F])
    assert high_entropy_mask(entropy, mask, quantile=0.5).tolist() == [F, T, T, F, F]
    assert high_entropy_mask(entropy, mask, quantile=1.0).tolist() == [T, T, T, T, F]
    assert high_entropy_mask(entropy, mask, quantile=0.0).tolist() == [F, T, F, F, F]


def _weights(mode: str, old: list[float], seq_index: list[int], *, cap: float = 2.0, min_weight: float = 0.0) -> list[float]:
    n = len(old)
    w = importance_weights(torch.tensor(old), torch.zeros(n), torch.tensor(seq_index), torch.ones(n, dtype=torch.bool), mode=mode, cap=cap, min_weight=min_weight)
    return w.tolist()


@pytest.mark.parametrize(
    "mode, seq_index, expected",
    [
        ("token_truncate", [0, 1], [2.0, 0.5]),
        ("token_mask", [0, 1], [0.0, 0.5]),
        ("sequence_truncate", [0, 0], [1.5, 1.5]),  # 3 * 0.5
        ("sequence_mask", [0, 0], [1.5, 1.5]),
    ],
)
def test_importance_weight_modes_hand_values(mode, seq_index, expected):
    assert _weights(mode, [math.log(3.0), math.log(0.5)], seq_index) == pytest.approx(expected)


def test_sequence_modes_truncate_or_mask_the_whole_sequence():
    old = [math.log(3.0), math.log(2.0), math.log(0.5)]  # sequence 0: ratio 6, sequence 1: 0.5
    assert _weights("sequence_truncate", old, [0, 0, 1]) == pytest.approx([2.0, 2.0, 0.5])
    assert _weights("sequence_mask", old, [0, 0, 1]) == pytest.approx([0.0, 0.0, 0.5])
    assert _weights("sequence_mask", old, [0, 0, 1], min_weight=0.6) == pytest.approx([0.0, 0.0, 0.0])


def test_importance_weights_survive_overflowing_ratios_and_carry_no_gradient():
    old = torch.tensor([500.0, -500.0], requires_grad=True)
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        w = importance_weights(old, torch.zeros(2), torch.tensor([0, 1]), torch.ones(2, dtype=torch.bool), mode=mode, cap=2.0)
        assert torch.isfinite(w).all() and not w.requires_grad


def test_logprob_mismatch_counts_lag0_tokens_apart():
    from tandemrl.algo.loss import logprob_mismatch_kl

    old, behaviour = torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -1.0 - math.log(2.0)])
    m = logprob_mismatch_kl(old, behaviour, torch.tensor([0.5, 0.5]), torch.tensor([True, False]))
    assert m["train/logprob_mismatch_kl"].item() == pytest.approx(0.5 * (2 - math.log(2.0) - 1))  # k3 with r = 2
    assert m["train/logprob_mismatch_kl_lag0"].item() == 0.0 and m["train/frac_lag0"].item() == 0.5
