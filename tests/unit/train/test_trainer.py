"""The trainer step: micro-batching equals one big batch; versions count optimizer steps."""

from __future__ import annotations

import random

import pytest
import torch

from tandemrl.algo.presets import AlgoConfig
from tandemrl.tasks.tiny import build_model, build_tokenizer
from tandemrl.train.config import TrainerConfig
from tandemrl.train.trainer import Trainer, disable_dropout, lr_factor, mean_over_iterations, mix_into
from tandemrl.types import Batch, Completion, Example, Group, Rollout, TokenTrace


def make_batch(seed: int = 0, groups: int = 3, group_size: int = 4) -> Batch:
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        rollouts = []
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(2, 6))]
        for _ in range(group_size):
            trace = TokenTrace()
            trace.append_context(prompt)
            n = rng.randint(1, 7)
            trace.append_sampled(Completion(
                token_ids=[rng.randrange(3, 300) for _ in range(n)], logprobs=[-5.0] * n, finish_reason="stop", policy_versions=[0] * n,
            ))
            rollouts.append(Rollout(example=Example(prompt="p"), trace=trace))
        out.append(Group(example=Example(prompt="p"), rollouts=rollouts, advantages=[rng.uniform(-1, 1) for _ in range(group_size)]))
    return Batch(groups=out, policy_version=0)


def train_once(max_tokens: int, loss_type: str, **algo) -> dict[str, torch.Tensor]:
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=1)
    config = TrainerConfig(learning_rate=1e-2, max_tokens_per_microbatch=max_tokens)
    trainer = Trainer(config, AlgoConfig(loss_type=loss_type, **algo), model, max_steps=2)
    trainer.train_step(make_batch())
    return {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_microbatches_give_the_gradient_of_one_big_batch(loss_type):
    big, small = train_once(10_000, loss_type), train_once(12, loss_type)
    assert any(g.abs().max() > 1e-4 for g in big.values())
    for name in big:
        torch.testing.assert_close(small[name], big[name], rtol=1e-4, atol=1e-7)


def test_each_iteration_is_one_optimizer_step_and_one_version():
    tokenizer = build_tokenizer()
    trainer = Trainer(TrainerConfig(learning_rate=1e-3), AlgoConfig(num_iterations=3), build_model(tokenizer), max_steps=5)
    metrics = trainer.train_step(make_batch())
    assert trainer.policy_version == 3 and metrics["policy_version"] == 3.0
    assert 0.0 <= metrics["clip_ratio/region_mean"] <= 1.0 and metrics["entropy"] > 0


def test_kl_to_reference_is_zero_before_the_first_step_and_positive_after():
    tokenizer = build_tokenizer()
    trainer = Trainer(TrainerConfig(learning_rate=1e-2), AlgoConfig(beta=0.1), build_model(tokenizer), max_steps=5)
    first = trainer.train_step(make_batch())
    second = trainer.train_step(make_batch(seed=1))
    assert first["kl"] == pytest.approx(0.0, abs=1e-7) and second["kl"] > 1e-6


def test_truncated_completions_are_masked_when_asked():
    from tandemrl.types import RolloutStatus

    batch = make_batch()
    for g in batch.groups:
        for r in g.rollouts:
            r.status = RolloutStatus.TRUNCATED
    tokenizer = build_tokenizer()
    trainer = Trainer(TrainerConfig(), AlgoConfig(mask_truncated_completions=True), build_model(tokenizer), max_steps=1)
    assert trainer.train_step(batch) == {"train/num_trained_tokens": 0.0}


def test_warmup_then_cosine_schedule():
    config = TrainerConfig(warmup_steps=2, lr_scheduler_type="cosine")
    assert [round(lr_factor(s, config, 6), 3) for s in range(7)] == [0.5, 1.0, 1.0, 0.854, 0.5, 0.146, 0.0]


def test_master_weights_default_to_float32_because_bf16_drops_small_updates():
    assert TrainerConfig().dtype == "float32"
    weight = torch.full((4,), 0.02)
    assert torch.equal((weight.bfloat16() - 1e-6).float(), weight.bfloat16().float())  # lost in bfloat16
    assert not torch.equal(weight - 1e-6, weight)  # kept in float32


def test_bfloat16_master_weights_are_accepted_and_other_dtypes_refused():
    assert TrainerConfig(dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="--dtype must be float32 or bfloat16"):
        TrainerConfig(dtype="float16")


def test_a_non_finite_step_is_skipped_and_too_many_in_a_row_stop_with_the_reason():
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    trainer = Trainer(TrainerConfig(learning_rate=1e-2, max_skipped_steps=2), AlgoConfig(), model, max_steps=5)
    poisoned = make_batch()
    poisoned.groups[0].advantages[0] = float("inf")  # what a reward of inf or 1e308 becomes
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    metrics = trainer.train_step(poisoned)
    assert metrics["train/skipped_steps"] == 1.0 and trainer.policy_version == 0
    assert all(torch.equal(before[k], p) for k, p in model.named_parameters())  # nothing applied, no NaN
    trainer.train_step(make_batch())  # a finite step resets the count
    assert trainer.policy_version == 1 and trainer.num_skipped_steps == 0
    trainer.train_step(poisoned)
    with pytest.raises(ValueError, match="2 optimizer steps in a row had a non-finite loss"):
        trainer.train_step(poisoned)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_metrics_of_several_iterations_are_their_means_as_trl_logs_them():
    steps = [
        {"loss": 1.0, "clip_ratio/high_max": 0.2, "policy_version": 1.0, "learning_rate": 1e-3},
        {"loss": 3.0, "clip_ratio/high_max": 0.4, "policy_version": 2.0, "learning_rate": 5e-4},
    ]
    assert mean_over_iterations(steps) == pytest.approx(
        {"loss": 2.0, "clip_ratio/high_max": 0.3, "policy_version": 2.0, "learning_rate": 5e-4}
    )


def test_top_entropy_quantile_trains_fewer_tokens():
    full, top = train_once(10_000, "grpo"), train_once(10_000, "grpo", top_entropy_quantile=0.2)
    assert any(not torch.allclose(full[k], top[k]) for k in full)


def test_warmup_ratio_is_a_fraction_of_all_steps_and_warmup_steps_wins():
    assert [lr_factor(s, TrainerConfig(warmup_ratio=0.25), 8) for s in range(3)] == [0.5, 1.0, 1.0]
    assert lr_factor(0, TrainerConfig(warmup_ratio=0.25, warmup_steps=4), 8) == 0.25


def test_disable_dropout_zeroes_every_dropout():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.3))
    model[0].attention_dropout = 0.1
    disable_dropout(model)
    assert model[1].p == 0.0 and model[0].attention_dropout == 0.0


def test_sync_ref_model_mixes_the_policy_into_the_reference_every_sync_steps():
    tokenizer = build_tokenizer()
    algo = AlgoConfig(beta=0.1, sync_ref_model=True, ref_model_mixup_alpha=0.5, ref_model_sync_steps=2)
    trainer = Trainer(TrainerConfig(learning_rate=1e-2), algo, build_model(tokenizer, seed=1), max_steps=4)
    before = [p.clone() for p in trainer.reference.parameters()]
    trainer.train_step(make_batch())
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.reference.parameters()))  # 1 step: not yet
    trainer.train_step(make_batch(seed=1))
    for old, ref, new in zip(before, trainer.reference.parameters(), trainer.model.parameters()):
        torch.testing.assert_close(ref, 0.5 * old + 0.5 * new)
    a, b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    mix_into(a, b, alpha=1.0)
    assert torch.equal(a.weight, b.weight)


def test_entropy_coef_adds_the_entropy_gradient():
    plain, bonus = train_once(10_000, "grpo"), train_once(10_000, "grpo", entropy_coef=0.5)
    assert any(not torch.allclose(plain[k], bonus[k]) for k in plain)


def test_entropy_bonus_is_the_mean_over_the_kept_tokens_times_the_share():
    from tandemrl.algo.loss import entropy_bonus

    assert entropy_bonus(torch.tensor([1.0, 3.0, 9.0]), torch.tensor([True, True, False]), share=0.5).item() == 1.0


def test_a_microbatch_with_no_trained_token_adds_nothing_and_crashes_nothing():
    """--mask_truncated_completions with the longest (truncated) completions packed together: a micro-batch
    with no trained token used to raise in backward ("does not require grad"). Its traces add nothing:
    the step equals the one-micro-batch step, metrics (KL, entropy) included."""
    from tandemrl.types import RolloutStatus

    def step(max_tokens: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        batch = make_batch(groups=2)
        for g in batch.groups:  # the longest completion of each group is truncated
            longest = max(g.rollouts, key=lambda r: len(r.trace.token_ids))
            longest.status = RolloutStatus.TRUNCATED
        model = build_model(build_tokenizer(), seed=1)
        config = TrainerConfig(learning_rate=1e-2, max_tokens_per_microbatch=max_tokens)
        trainer = Trainer(config, AlgoConfig(mask_truncated_completions=True, beta=0.1), model, max_steps=2)
        return trainer.train_step(batch), {k: p.grad.clone() for k, p in model.named_parameters()}

    lengths = sorted((len(r.trace.token_ids) for g in make_batch(groups=2).groups for r in g.rollouts), reverse=True)
    small_metrics, small = step(lengths[0])  # the longest trace fills a micro-batch on its own
    big_metrics, big = step(10_000)
    assert small_metrics["policy_version"] == 1.0
    for key in ("loss", "entropy", "kl", "sampling/sampling_logp_difference/mean"):
        assert small_metrics[key] == pytest.approx(big_metrics[key], rel=1e-4, abs=1e-7), key
    assert any(g.abs().max() > 1e-4 for g in big.values())
    for name in big:
        torch.testing.assert_close(small[name], big[name], rtol=1e-4, atol=1e-7)
