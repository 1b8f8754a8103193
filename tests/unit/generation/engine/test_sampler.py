"""The sampler: Gumbel-max draws follow the softmax; filters never emit excluded tokens; logprobs are
under the filtered distribution; noise depends on (seed, position) alone."""

from __future__ import annotations

import torch

from tandemrl.generation.engine.layers.sampler import (
    SamplingTensors, filter_logits, gumbel_noise, penalise, repetition_penalty, row_keys, sample, uniform_of,
)  # fmt: skip


def tensors(batch: int, *, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, vocab=16, seeds=None) -> SamplingTensors:
    seeds = torch.arange(batch) if seeds is None else seeds
    return SamplingTensors(
        temperatures=torch.full((batch,), temperature),
        top_k=torch.full((batch,), vocab if top_k == -1 else top_k),
        top_p=torch.full((batch,), top_p),
        min_p=torch.full((batch,), min_p),
        keys=row_keys(seeds, torch.full((batch,), 7)),
        needs_filter=top_k != -1 or top_p < 1 or min_p > 0,
    )


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_samples_follow_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    n = 20000
    tokens, _, _ = sample(logits.expand(n, -1), tensors(n, temperature=0.8, vocab=8))
    counts = torch.bincount(tokens, minlength=8).float()
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001
    assert chi_square(counts, (logits / 0.8).softmax(-1)) < 24.3


def test_top_k_and_top_p_never_emit_excluded_tokens_and_renormalise():
    logits = torch.tensor([3.0, 2.5, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0])
    n = 5000
    top_k, _, _ = sample(logits.expand(n, -1), tensors(n, top_k=3, vocab=8))
    assert set(top_k.tolist()) <= {0, 1, 2}
    probs = logits.softmax(-1)  # [0.43, 0.26, 0.16, 0.06, ...]: top_p 0.8 keeps the first 3
    top_p, logprobs, _ = sample(logits.expand(n, -1), tensors(n, top_p=0.8, vocab=8))
    assert set(top_p.tolist()) == {0, 1, 2}
    kept = probs[:3] / probs[:3].sum()
    assert torch.allclose(logprobs, kept.log()[top_p], atol=1e-5)
    assert chi_square(torch.bincount(top_p, minlength=3).float(), kept) < 13.8  # 2 dof, p = 0.001


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability():
    logits = torch.tensor([2.0, 1.9, 0.0, -1.0])  # probs ~ [0.48, 0.44, 0.06, 0.02]
    tokens, logprobs, _ = sample(logits.expand(3000, -1), tensors(3000, min_p=0.2, vocab=4))
    assert set(tokens.tolist()) == {0, 1}
    kept = logits[:2].softmax(-1)
    assert torch.allclose(logprobs, kept.log()[tokens], atol=1e-5)


def test_filters_compose_in_transformers_order():
    logits = torch.randn(4, 50)
    t = tensors(4, top_k=10, top_p=0.5, min_p=0.1, vocab=50)
    filtered = filter_logits(logits, t)
    for row, out in zip(logits, filtered):
        kept = out.isfinite()
        assert kept.sum() <= 10 and kept[row.argmax()]
        assert (row[kept].min() >= row[~kept].max()) if (~kept).any() else True


def test_greedy_rows_take_the_argmax_and_report_raw_log_softmax():
    logits = torch.randn(5, 30)
    tokens, logprobs, _ = sample(logits, tensors(5, temperature=0.0, vocab=30))
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.allclose(logprobs, logits.log_softmax(-1).gather(-1, tokens[:, None])[:, 0])


def test_noise_is_a_function_of_seed_and_position_only():
    keys = row_keys(torch.tensor([11, 12, 11]), torch.tensor([4, 4, 4]))
    noise = gumbel_noise(keys, 100)
    assert torch.equal(noise[0], noise[2]) and not torch.equal(noise[0], noise[1])
    alone = gumbel_noise(row_keys(torch.tensor([11]), torch.tensor([4])), 100)
    assert torch.equal(alone[0], noise[0])
    other_position = gumbel_noise(row_keys(torch.tensor([11]), torch.tensor([5])), 100)
    assert not torch.equal(other_position[0], noise[0])


def test_every_hash_value_maps_into_the_open_unit_interval_and_finite_noise():
    top_bits = torch.arange(0, 2**23, dtype=torch.int64) << 9
    for bits in (top_bits, top_bits | 0x1FF):  # each 23-bit prefix, with its low bits clear and set
        uniform = uniform_of(bits)
        assert 0.0 < uniform.min() and uniform.max() < 1.0
        assert torch.isfinite(-torch.log(-torch.log(uniform))).all()


def test_a_row_whose_hash_hits_the_top_of_its_range_still_draws_from_the_softmax():
    # seeds 12, 114, 244, 289 and 399 (x 7919, position 130) each hashed one of a 151,936-token vocab to the
    # last 24-bit value, whose uniform rounded to 1: infinite noise, and that token was drawn over a token of
    # probability 1 - 1e-8 (about 1% of draws at this vocab)
    seeds = torch.tensor([12, 114, 244, 289, 399, 0, 1]) * 7919
    vocab, batch = 151_936, len(seeds)
    logits = torch.zeros(batch, vocab)
    logits[:, 7] = 30.0  # every other token together: probability ~1.4e-8
    sampling = tensors(batch, vocab=vocab)
    sampling.keys = row_keys(seeds, torch.full((batch,), 130))
    tokens, _, _ = sample(logits, sampling)
    assert tokens.tolist() == [7] * batch


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens_only():
    penalty = repetition_penalty([[0, 1, 1]], [2.0], 4, torch.device("cpu"))
    assert penalise(torch.tensor([[2.0, -2.0, 1.0, -1.0]]), penalty).tolist() == [[1.0, -4.0, 1.0, -1.0]]
    # the step's input token counts though the host has not read it yet; padded rows are never penalised
    penalty = repetition_penalty([[0], [3]], [2.0, 1.0], 4, torch.device("cpu"), last_ids=torch.tensor([2, 1]), pad=1)
    assert penalty.seen.tolist() == [[True, False, True, False], [False, True, False, True], [False] * 4]
    assert penalty.penalties.tolist() == [2.0, 1.0, 1.0]
    assert repetition_penalty([[0]], [1.0], 4, torch.device("cpu")) is None  # no row penalises: nothing built


def test_a_penalised_row_samples_and_reports_the_penalised_distribution():
    logits = torch.tensor([[3.0, 2.9, -1.0, -1.0]])
    t = tensors(1, temperature=0.0, vocab=4)
    assert sample(logits, t)[0].item() == 0
    t.penalty = repetition_penalty([[0]], [1.5], 4, torch.device("cpu"))
    token_ids, logprobs, _ = sample(logits, t)
    assert token_ids.item() == 1  # 3.0 / 1.5 = 2.0 < 2.9
    expected = torch.tensor([[2.0, 2.9, -1.0, -1.0]]).log_softmax(-1)[0, 1]
    assert torch.allclose(logprobs, expected[None])


def test_greedy_rows_take_the_argmax_of_logits_an_ulp_apart():
    # log_softmax rounded 1.0 and the float below it (-L with L ~ 3.4) to one logprob, and the argmax of
    # that tie took index 0: not the largest logit
    logits = torch.full((2, 50), 0.5)
    logits[:, 0] = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    logits[:, 1] = 1.0
    for top_k in (-1, 5):
        tokens, _, _ = sample(logits, tensors(2, temperature=0.0, top_k=top_k, vocab=50))
        assert tokens.tolist() == [1, 1]


def test_top_p_inside_a_tie_at_the_top_keeps_the_exact_prefix():
    # 50 equal logits, top_p 0.5: 25 of them hold exactly half the mass, so 25 stay (a float32 cumsum of
    # softmax's 0.02 stayed under 0.5 there and kept 26); other thresholds that fall exactly on a tied token's edge
    for vocab, top_p, kept in [(50, 0.5, 25), (64, 0.5, 32), (8, 0.25, 2), (100, 0.75, 75)]:
        filtered = filter_logits(torch.zeros(3, vocab), tensors(3, top_p=top_p, vocab=vocab))
        assert filtered.isfinite().sum(-1).tolist() == [kept] * 3
        assert filtered[:, :kept].isfinite().all()  # the lowest indices, as a stable sort keeps


def test_a_temperature_does_not_tie_logits_an_ulp_apart():
    # 1.7 and the float above it, divided by 0.01 or 100, round to one float32: top-k 1 kept the lower index,
    # the smaller logit; the order is the logits' own, as the kernel's
    low = torch.tensor(1.7)
    high = torch.nextafter(low, torch.tensor(2.0))
    for temperature in (0.01, 100.0):
        assert (low / temperature) == (high / temperature)
        logits = torch.stack([low, high, torch.tensor(0.2)]).expand(4, -1)
        tokens, _, floors = sample(logits, tensors(4, temperature=temperature, top_k=1, vocab=3))
        assert tokens.tolist() == [1] * 4 and torch.isfinite(floors).all()


def low_temperature_logits(rows: int, vocab: int, temperature: float) -> torch.Tensor:
    """Logits near 60 (a trained model's top logits), 8 tokens within a few temperatures of the top: none certain."""
    logits = torch.randn(rows, vocab) * 3 + 50
    logits[:, :8] = 60 + temperature * torch.randn(rows, 8) * 2
    return logits


def test_logprobs_at_low_temperatures_match_float64():
    # the logits were divided by T before the row max was subtracted: at T = 1e-4 the tempered logits are ~6e5,
    # whose float32 spacing (1/16) put the logprob off by 3e-2 (3e-4 at T = 0.01); the trainer scores the same
    # token at the same T with its own rounding, so the importance ratios of low-temperature runs were off
    torch.manual_seed(0)
    rows, vocab = 64, 1000
    for temperature in (1e-4, 1e-2, 0.3):
        logits = low_temperature_logits(rows, vocab, temperature)
        for top_k in (-1, 5):  # unfiltered, and filtered (the renormalised logprob)
            token_ids, logprobs, _ = sample(logits, tensors(rows, temperature=temperature, top_k=top_k, vocab=vocab))
            exact = logits.double() / temperature
            if top_k > 0:  # the first top_k of a stable sort: float32 logits near 60 often tie
                dropped = exact.sort(dim=-1, descending=True, stable=True).indices[:, top_k:]
                exact = exact.scatter(-1, dropped, float("-inf"))
            exact = exact.log_softmax(-1).gather(-1, token_ids[:, None])[:, 0]
            assert (logprobs.double() - exact).abs().max() < 1e-5, (temperature, top_k)
