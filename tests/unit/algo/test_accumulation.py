"""Gradient accumulation equals one big batch, for every aggregation: the loss's central invariant.

The reference is written the way TRL writes it, on a padded [S, T] batch, independently of token_weights.
"""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.nn.utils.rnn import pad_sequence

from tandemrl.algo.logprobs import logprobs_and_entropy
from tandemrl.algo.loss import policy_loss, token_weights
from tandemrl.algo.presets import DAPO, DR_GRPO, GRPO, LossConfig
from tandemrl.train.batching import pack, plan_microbatches
from tandemrl.types import Completion, TokenTrace

VOCAB, HIDDEN, MAX_COMPLETION_LENGTH, BETA, TIS_CAP = 30, 8, 12, 0.05, 1.5
GSPO_WIDE = LossConfig(clip_low=0.05, clip_high=0.05, aggregation="seq_mean_token_mean", ratio_level="sequence")


def _traces(num_sequences: int, generator: torch.Generator) -> list[TokenTrace]:
    """Random multi-turn traces: context, sampled, context, sampled; sampled logprobs random."""

    def ints(low, high, size=()):
        return torch.randint(low, high, size, generator=generator).tolist()

    traces = []
    for _ in range(num_sequences):
        trace = TokenTrace()
        for turn in range(2):
            trace.append_context(ints(0, VOCAB, (ints(1 - turn, 3),)))
            ids = ints(0, VOCAB, (ints(1, 6),))
            logprobs = (-torch.rand(len(ids), generator=generator)).tolist()
            versions = [0] * len(ids)
            completion = Completion(token_ids=ids, logprobs=logprobs, finish_reason="stop", policy_versions=versions)
            trace.append_sampled(completion)
        traces.append(trace)
    return traces


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Linear(HIDDEN, VOCAB, bias=False))


def _score(model, batch) -> torch.Tensor:
    return logprobs_and_entropy(model[0](batch.input_ids[0]), model[1], batch.target_ids, chunk_size=7)[0]  # [N]


def _accumulated(policy, old, ref, traces, advantages, config, max_tokens):
    """Sum of policy_loss over micro-batches, each backwarded on its own, as the trainer does."""
    plan = plan_microbatches([len(t.token_ids) for t in traces], max_tokens)
    num_tokens = sum(t.num_sampled for t in traces)
    total, clipped = torch.zeros(()), torch.zeros(())
    for micro in plan:
        batch = pack([traces[i] for i in micro], [advantages[i] for i in micro])
        with torch.no_grad():
            batch.old_logprobs, ref_logprobs = _score(old, batch), _score(ref, batch)
        weights = token_weights(
            batch.seq_index, batch.loss_mask, aggregation=config.aggregation, num_sequences=len(traces),
            num_tokens=num_tokens, max_completion_length=MAX_COMPLETION_LENGTH,
        )  # fmt: skip
        loss, metrics = policy_loss(  # fmt: skip
            batch, _score(policy, batch), config=config, weights=weights,
            ref_logprobs=ref_logprobs, beta=BETA, tis_cap=TIS_CAP,
        )
        loss.backward()
        total, clipped = total + loss.detach(), clipped + metrics["clip_ratio/region_mean"]
    return total, len(plan), clipped


def _padded(values: torch.Tensor, batch) -> torch.Tensor:
    """[N] -> [S, T_max] of trained tokens only, zero padded."""
    rows = [values[(batch.seq_index == s) & batch.loss_mask] for s in range(batch.num_sequences)]
    return pad_sequence(rows, batch_first=True)


def _one_big_batch(policy, old, ref, traces, advantages, config):
    """The TRL-style loss of the whole step at once on a padded batch."""
    batch = pack(traces, advantages)
    with torch.no_grad():
        old_lp, ref_lp = _padded(_score(old, batch), batch), _padded(_score(ref, batch), batch)
    lp, behaviour = _padded(_score(policy, batch), batch), _padded(batch.behaviour_logprobs, batch)
    mask = _padded(torch.ones_like(batch.advantages), batch)  # [S, T]
    adv = torch.tensor(advantages)[:, None]  # [S, 1]
    log_ratio = lp - old_lp
    if config.ratio_level == "sequence":
        seq = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
        log_ratio = seq.detach() + lp - lp.detach()
    ratio = log_ratio.exp()
    surrogate = -torch.min(ratio * adv, ratio.clamp(1 - config.clip_low, 1 + config.clip_high) * adv)
    tis = (old_lp - behaviour).exp().clamp(max=TIS_CAP)
    if config.ratio_level == "sequence":  # TRL's sequence_truncate: one weight per sequence
        tis = ((old_lp - behaviour) * mask).sum(-1, keepdim=True).exp().clamp(max=TIS_CAP)
    per_token = (surrogate * tis + BETA * ((ref_lp - lp).exp() - (ref_lp - lp) - 1)) * mask
    if config.aggregation == "token_mean":
        return per_token.sum() / mask.sum()
    if config.aggregation == "seq_mean_token_mean":
        return (per_token.sum(-1) / mask.sum(-1)).mean()
    return per_token.sum() / (len(traces) * MAX_COMPLETION_LENGTH)


@pytest.mark.parametrize(
    "config", [GRPO, DAPO, DR_GRPO, GSPO_WIDE], ids=["seq_mean_token_mean", "token_mean", "token_sum_norm", "gspo"]
)
def test_microbatch_accumulation_equals_one_big_batch_in_loss_and_gradient(config):
    generator = torch.Generator().manual_seed(1)
    traces = _traces(7, generator)
    advantages = torch.randn(7, generator=generator).tolist()
    policy, old, ref = _model(0), _model(0), _model(2)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))  # ratios spread, some tokens clipped

    total, num_micro, clipped = _accumulated(policy, old, ref, traces, advantages, config, max_tokens=16)
    grads = [p.grad.clone() for p in policy.parameters()]
    policy.zero_grad()
    expected = _one_big_batch(policy, old, ref, traces, advantages, config)
    expected.backward()

    assert num_micro >= 3 and 0 < clipped < 1  # several micro-batches; some tokens clipped, not all
    torch.testing.assert_close(total, expected.detach(), atol=1e-6, rtol=1e-5)
    for grad, p in zip(grads, policy.parameters()):
        assert p.grad.abs().sum() > 0
        torch.testing.assert_close(grad, p.grad, atol=1e-6, rtol=1e-5)


def _loop_reference(seqs, logprobs, config, *, beta, tis_cap, num_sequences, num_tokens, keep):
    """The step loss as a float64 loop over sequences and tokens, straight from TRL's documented formula."""
    total = torch.zeros((), dtype=torch.float64)
    for s, lp, kept in zip(seqs, logprobs, keep):
        trained = [t for t, m in enumerate(s["mask"]) if m]
        n = len(trained)
        if n == 0:
            continue
        sequence_log_ratio = sum(lp[t] - s["old"][t] for t in trained) / n
        sequence_log_is = sum(s["old"][t] - s["behaviour"][t] for t in trained)
        for t in trained:
            ratio = torch.exp(sequence_log_ratio if config.ratio_level == "sequence" else lp[t] - s["old"][t])
            if config.objective == "cispo":
                term = -min(ratio.item(), config.clip_high) * s["advantage"] * lp[t]
            else:
                capped = ratio if config.delta is None else torch.clamp(ratio, max=config.delta)
                clipped = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
                term = -torch.min(capped * s["advantage"], clipped * s["advantage"])
            term = term * kept[t]
            w = math.exp(sequence_log_is if config.tis_mode.startswith("sequence") else s["old"][t] - s["behaviour"][t])
            if config.tis_mode.endswith("truncate"):
                w = min(max(w, config.tis_min), tis_cap)
            else:
                w = w if config.tis_min <= w <= tis_cap else 0.0
            d = s["ref"][t] - lp[t]
            kl = torch.exp(d) - d - 1
            term = term * w + beta * (kl * ratio if config.kl_bias_correction else kl)
            if config.aggregation == "token_mean":
                total = total + term / num_tokens
            elif config.aggregation == "seq_mean_token_mean":
                total = total + term / (n * num_sequences)
            else:
                total = total + term / (num_sequences * MAX_COMPLETION_LENGTH)
    return total


LOOP_CASES = [
    LossConfig(
        clip_low=0.2, clip_high=0.28 if objective == "clip" else 1.4, aggregation=aggregation, ratio_level=level,
        objective=objective, delta=delta, tis_mode=("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")[i % 4],
        tis_min=(0.0, 0.6)[i // 4 % 2], kl_bias_correction=i % 3 != 0,
    )  # fmt: skip
    for i, (aggregation, level, (objective, delta)) in enumerate(
        (a, lv, o)
        for a in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
        for lv in ("token", "sequence")
        for o in (("clip", None), ("clip", 1.5), ("cispo", None))
    )
]


@pytest.mark.parametrize("case", range(len(LOOP_CASES)))
def test_policy_loss_split_in_micro_batches_equals_a_per_token_loop_in_value_and_gradient(case):
    """Every option at once against `_loop_reference`: clip both sides (ratios far from 1), delta, cispo,
    every importance-sampling mode with and without a floor, KL with and without the ratio, tokens dropped
    by `keep`, fully masked sequences, zero advantages; the step cut in 3 micro-batches with global counts."""
    config, rng = LOOP_CASES[case], torch.Generator().manual_seed(case)
    rand = lambda *shape: torch.rand(shape, generator=rng, dtype=torch.float64)  # noqa: E731
    seqs = []
    for i in range(6):
        length = int(torch.randint(1, 9, (), generator=rng))
        old = -3 * rand(length)
        seqs.append(dict(
            mask=(rand(length) < 0.8).tolist() if i != 1 else [False] * length, old=old.tolist(),
            behaviour=(old + 1.6 * rand(length) - 0.8).tolist(), ref=(old + rand(length) - 0.5).tolist(),
            advantage=(0.0, 1.3, -0.7, -1.0, 2.0, 0.4)[i], current=(old + (6 * rand(length) - 3) * (i % 3) / 2).tolist(),
        ))  # fmt: skip
    keep = [(rand(len(s["mask"])) < 0.7).double().tolist() for s in seqs]
    num_sequences, num_tokens = len(seqs) + 2, sum(sum(s["mask"]) for s in seqs) + 3  # the step has more, elsewhere
    leaves = [torch.tensor(s["current"], dtype=torch.float64, requires_grad=True) for s in seqs]
    expected = _loop_reference(
        seqs, leaves, config, beta=0.1, tis_cap=1.7, num_sequences=num_sequences, num_tokens=num_tokens, keep=keep
    )  # fmt: skip
    expected.backward()

    total = torch.zeros((), dtype=torch.float64)
    grads = [None] * len(seqs)
    for part in ([0, 3], [1], [2, 4, 5]):
        f64 = lambda key: torch.tensor([v for i in part for v in seqs[i][key]], dtype=torch.float64)  # noqa: E731
        batch = SimpleNamespace(
            loss_mask=torch.tensor([v for i in part for v in seqs[i]["mask"]]), old_logprobs=f64("old"),
            behaviour_logprobs=f64("behaviour"), advantages=torch.tensor([seqs[i]["advantage"] for i in part for _ in seqs[i]["mask"]]).double(),
            seq_index=torch.tensor([j for j, i in enumerate(part) for _ in seqs[i]["mask"]]),
        )  # fmt: skip
        logprobs = f64("current").requires_grad_(True)
        weights = token_weights(
            batch.seq_index, batch.loss_mask, aggregation=config.aggregation, num_sequences=num_sequences,
            num_tokens=num_tokens, max_completion_length=MAX_COMPLETION_LENGTH,
        )  # fmt: skip
        loss, _ = policy_loss(
            batch, logprobs, config=config, weights=weights.double(), ref_logprobs=f64("ref"), beta=0.1, tis_cap=1.7,
            keep=torch.tensor([v for i in part for v in keep[i]]).bool(),
        )  # fmt: skip
        loss.backward()
        total = total + loss.detach()
        for i, grad in zip(part, logprobs.grad.split([len(seqs[i]["mask"]) for i in part])):
            grads[i] = grad

    torch.testing.assert_close(total, expected.detach(), atol=1e-7, rtol=1e-6)  # token_weights are float32
    for grad, leaf in zip(grads, leaves):  # a fully masked sequence has no gradient in the loop
        torch.testing.assert_close(grad, torch.zeros_like(leaf) if leaf.grad is None else leaf.grad, atol=1e-7, rtol=1e-6)
