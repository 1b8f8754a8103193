"""The trainer step: micro-batching equals one big batch; versions count optimizer steps."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tandemrl.algo.presets import AlgoConfig
from tandemrl.tasks.tiny import build_model, build_tokenizer
from tandemrl.train.config import TrainerConfig
from tandemrl.train.trainer import Trainer, build_optimizer, disable_dropout, lr_factor, mean_over_iterations, mix_into
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


@pytest.mark.parametrize("on_cpu", [False, True], ids=["adamw", "cpu_optimizer"])
def test_adamw_takes_trls_betas_epsilon_and_weight_decay(on_cpu):
    """TRL's adam_beta1, adam_beta2, adam_epsilon (once ignored: eps stayed 1e-8) and weight_decay reach either optimizer."""
    config = TrainerConfig(adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-5, weight_decay=0.1)
    group = build_optimizer(config, build_model(build_tokenizer()), torch.device("cpu"), on_cpu=on_cpu).param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.8, 0.95), 1e-5, 0.1)
    assert build_optimizer(TrainerConfig(), build_model(build_tokenizer()), torch.device("cpu"), on_cpu=on_cpu).param_groups[0]["eps"] == 1e-8


def test_max_grad_norm_clips_the_global_gradient_norm_to_it():
    trainer = Trainer(TrainerConfig(max_grad_norm=0.5), AlgoConfig(), build_model(build_tokenizer()), max_steps=1)
    for p in trainer.model.parameters():
        p.grad = torch.ones_like(p)
    assert trainer._clip_gradients() > 0.5  # the norm before clipping
    assert float(torch.nn.utils.get_total_norm([p.grad for p in trainer.model.parameters()])) == pytest.approx(0.5, rel=1e-4)


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


def test_the_streak_of_skipped_steps_is_in_the_trainer_state_and_an_older_state_without_it_loads_as_none():
    tokenizer = build_tokenizer()
    trainer = Trainer(TrainerConfig(learning_rate=1e-2, max_skipped_steps=3), AlgoConfig(), build_model(tokenizer), max_steps=5)
    poisoned = make_batch()
    poisoned.groups[0].advantages[0] = float("inf")
    trainer.train_step(poisoned)
    state = trainer.state_dict()
    resumed = Trainer(TrainerConfig(learning_rate=1e-2, max_skipped_steps=3), AlgoConfig(), build_model(tokenizer), max_steps=5)
    resumed.load_state_dict(state)
    assert resumed.num_skipped_steps == 1
    resumed.load_state_dict({k: v for k, v in state.items() if k != "num_skipped_steps"})  # a checkpoint from before the field
    assert resumed.num_skipped_steps == 0


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


def _traced_batch(seed: int) -> Batch:
    """Groups of multi-turn rollouts (sampled, context, sampled), some truncated, one group of zero advantages."""
    from tandemrl.types import RolloutStatus

    rng = random.Random(seed)
    groups = []
    for g in range(3):
        rollouts, prompt = [], [rng.randrange(3, 300) for _ in range(rng.randint(2, 6))]
        for _ in range(3):
            trace = TokenTrace()
            trace.append_context(prompt)
            for turn in range(rng.choice([1, 2])):
                if turn:
                    trace.append_context([rng.randrange(3, 300) for _ in range(rng.randint(1, 3))])
                n = rng.randint(1, 7)
                trace.append_sampled(Completion(
                    token_ids=[rng.randrange(3, 300) for _ in range(n)], logprobs=[-rng.uniform(4, 7) for _ in range(n)],
                    finish_reason="stop", policy_versions=[0] * n,
                ))  # fmt: skip
            truncated = rng.random() < 0.3
            rollouts.append(Rollout(example=Example(prompt="p"), trace=trace, status=RolloutStatus.TRUNCATED if truncated else RolloutStatus.OK))
        advantages = [rng.uniform(-1, 1) for _ in range(3)] if g else [0.0] * 3
        groups.append(Group(example=Example(prompt="p"), rollouts=rollouts, advantages=advantages))
    return Batch(groups=groups, policy_version=0)


def _per_trace_reference(model, reference, batch: Batch, algo: AlgoConfig, temperature: float) -> torch.Tensor:
    """The step loss from each trace's own unpacked forward, in float64 loops (TRL's formula; num_iterations 1,
    so the ratio is 1 with the policy gradient; one micro-batch, so the entropy quantile is the whole step's)."""
    from tandemrl.algo.presets import loss_config
    from tandemrl.types import RolloutStatus

    config = loss_config(algo)
    rows = []
    for group in batch.groups:
        for rollout, advantage in zip(group.rollouts, group.advantages):
            ids = rollout.trace.token_ids
            masked = algo.mask_truncated_completions and rollout.status is RolloutStatus.TRUNCATED
            at = [j for j in range(len(ids) - 1) if rollout.trace.loss_mask[j + 1] and not masked]
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].double() / temperature, -1)
            entropy = -(logp.exp() * logp).sum(-1)
            with torch.no_grad():
                ref = torch.log_softmax(reference(input_ids=torch.tensor([ids])).logits[0].double() / temperature, -1)
            rows.append([(logp[j, ids[j + 1]], ref[j, ids[j + 1]], rollout.trace.logprobs[j + 1], entropy[j]) for j in at])
    tokens = [t for row in rows for t in row]
    threshold = torch.quantile(torch.stack([t[3].detach() for t in tokens]).float(), 1 - algo.top_entropy_quantile).item()
    loss, kept = torch.zeros((), dtype=torch.float64), []
    for row, advantage in zip(rows, [a for g in batch.groups for a in g.advantages]):
        n = len(row)
        sequence_ratio = torch.exp(sum((lp - lp.detach() for lp, *_ in row), torch.zeros((), dtype=torch.float64)) / max(n, 1))
        sequence_is = math.exp(sum(lp.item() - behaviour for lp, _, behaviour, _ in row))
        for lp, ref, behaviour, entropy in row:
            ratio = sequence_ratio if config.ratio_level == "sequence" else torch.exp(lp - lp.detach())
            term = -torch.min(ratio * advantage, ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * advantage)
            weight = sequence_is if config.tis_mode.startswith("sequence") else math.exp(lp.item() - behaviour)
            if algo.tis_cap:
                weight = min(weight, algo.tis_cap) if config.tis_mode.endswith("truncate") else weight * (weight <= algo.tis_cap)
            keep = entropy.item() >= threshold - 1e-6
            kept += [entropy] if keep else []
            d = ref - lp
            kl = (torch.exp(d) - d - 1) * (ratio if config.kl_bias_correction else 1.0)
            term = term * weight * keep + algo.beta * kl
            normaliser = {"token_mean": len(tokens), "seq_mean_token_mean": n * len(rows)}.get(config.aggregation, len(rows) * algo.max_completion_length)
            loss = loss + term / normaliser
    return loss - algo.entropy_coef * sum(kept) / len(kept)


@pytest.mark.parametrize(
    "algo, max_tokens, temperature",
    [
        (dict(loss_type="grpo", mask_truncated_completions=True, beta=0.3), 14, 1.0),
        (dict(loss_type="dr_grpo", max_completion_length=9, entropy_coef=0.2, tis_mode="token_mask", tis_cap=3.0), 14, 1.0),
        (dict(loss_type="gspo", beta=0.3, mask_truncated_completions=True), 14, 0.7),
        (dict(loss_type="bnpo", mask_truncated_completions=True, entropy_coef=0.3, tis_mode="sequence_truncate"), 14, 1.0),
        (dict(loss_type="dapo", top_entropy_quantile=0.4, entropy_coef=0.3, use_bias_correction_kl=False, beta=0.3), 10_000, 0.7),
    ],
    ids=["grpo-masked-kl", "dr_grpo-entropy-mask_is", "gspo-kl", "bnpo-masked-entropy", "dapo-top_entropy"],
)
def test_step_loss_and_gradient_equal_a_per_trace_reference(algo, max_tokens, temperature):
    """The whole trainer (packing, micro-batches, global counts, masked truncated traces still counted as
    sequences, entropy bonus, KL to a reference that differs) against unpacked per-trace forwards."""
    import copy

    algo = AlgoConfig(**algo)
    model = build_model(build_tokenizer(), seed=1)
    expected_model = copy.deepcopy(model).double()
    config = TrainerConfig(learning_rate=1e-2, max_tokens_per_microbatch=max_tokens, max_grad_norm=0.0)
    trainer = Trainer(config, algo, model, max_steps=2, temperature=temperature)
    reference = expected_model
    if algo.beta:
        generator = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in trainer.reference.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=generator))
        reference = copy.deepcopy(trainer.reference).double()
    batch = _traced_batch(seed=3)
    metrics = trainer.train_step(batch)
    expected = _per_trace_reference(expected_model, reference, batch, algo, temperature)
    expected.backward()

    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
    for (name, p), q in zip(model.named_parameters(), expected_model.parameters()):
        torch.testing.assert_close(p.grad.double(), q.grad, rtol=1e-3, atol=1e-6, msg=name)
