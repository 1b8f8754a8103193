import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandemrl.algo.logprobs import logprobs_and_entropy


def _plain(hidden, head, target_ids, temperature):
    logits = head(hidden).float() / temperature  # [N, V]
    logprobs = logits.log_softmax(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return logprobs.gather(-1, target_ids[:, None]).squeeze(-1), entropy


def _case(num_tokens=37, hidden_size=8, vocab=50, seed=0):
    generator = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden_size, generator=generator))
    hidden = torch.randn(num_tokens, hidden_size, generator=generator, requires_grad=True)
    return hidden, head, torch.randint(vocab, (num_tokens,), generator=generator)


def test_uniform_logits_give_log_one_over_v_and_entropy_log_v():
    head = torch.nn.Linear(1, 2, bias=False)
    torch.nn.init.zeros_(head.weight)
    logprobs, entropy = logprobs_and_entropy(torch.ones(1, 1), head, torch.tensor([0]))
    torch.testing.assert_close((logprobs, entropy), (torch.tensor([-math.log(2)]), torch.tensor([math.log(2)])))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_full_logits_in_value_and_gradient(temperature):
    hidden, head, target_ids = _case()
    logprobs, entropy = logprobs_and_entropy(hidden, head, target_ids, temperature=temperature, chunk_size=8)
    (logprobs * torch.linspace(-1, 1, len(logprobs))).sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    ref_logprobs, ref_entropy = _plain(hidden, head, target_ids, temperature)
    (ref_logprobs * torch.linspace(-1, 1, len(logprobs))).sum().backward()
    assert logprobs.dtype == entropy.dtype == torch.float32
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads, (hidden.grad, head.weight.grad), atol=1e-5, rtol=1e-5)


def _matches_the_masked_softmax(hidden, head, target_ids, temperature, kept_of, **options):
    """The head's value, entropy and both gradients equal autograd of the full logits with the tokens not in
    kept_of(tempered logits [N, V]) -> bool [N, V] masked out; returns the head's logprobs."""
    logprobs, entropy = logprobs_and_entropy(hidden, head, target_ids, temperature=temperature, chunk_size=8, **options)
    ((logprobs + entropy) * torch.linspace(-1, 1, len(logprobs))).sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    full = head(hidden).float() / temperature
    kept = kept_of(full.detach())
    ref = full.masked_fill(~kept, float("-inf")).log_softmax(-1)
    ref_logprobs = ref.gather(-1, target_ids[:, None]).squeeze(-1)
    ref_entropy = -(ref.exp() * ref.masked_fill(~kept, 0.0)).sum(-1)
    ((ref_logprobs + ref_entropy) * torch.linspace(-1, 1, len(logprobs))).sum().backward()
    torch.testing.assert_close((logprobs, entropy), (ref_logprobs, ref_entropy), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads, (hidden.grad, head.weight.grad), atol=1e-5, rtol=1e-5)
    return logprobs


def test_floors_score_under_the_truncated_softmax_in_value_gradient_and_entropy():
    """With the sampler's logit floors a row is the softmax over the tokens at or above its floor (the target
    always among them)."""
    hidden, head, target_ids = _case()
    temperature = 0.7
    logits = (head(hidden).float() / temperature).detach()  # [N, V]
    floors = logits.sort(-1, descending=True).values[:, 9] - 1e-3  # ten tokens kept per row
    floors[::3] = float("-inf")  # and some rows filter nothing

    def kept_of(full):
        return (full >= floors[:, None]).scatter(-1, target_ids[:, None], True)

    logprobs = _matches_the_masked_softmax(hidden, head, target_ids, temperature, kept_of, floors=floors)
    assert (logprobs - _plain(hidden, head, target_ids, temperature)[0]).abs().max() > 0.1  # truncation changed them


def test_top_k_alone_keeps_each_rows_own_k_largest_with_the_target_in_value_and_gradient():
    """Under top-k alone a filtered row is the softmax over its own k largest logits, or over its k - 1 largest and the
    target where the target is not among them; a row without a floor keeps everything."""
    hidden, head, target_ids = _case()
    k, temperature = 10, 0.7
    floors = torch.zeros(len(target_ids))  # any finite floor: the row was filtered (its value is not used)
    floors[::3] = float("-inf")

    def kept_of(full):
        kept = torch.zeros_like(full, dtype=torch.bool)
        for row, ranked in enumerate(full.argsort(-1, descending=True).tolist()):
            own = ranked[:k] if target_ids[row] in ranked[:k] else ranked[: k - 1] + [int(target_ids[row])]
            kept[row, own if floors[row] > float("-inf") else ranked] = True
        assert (kept.sum(-1)[floors > float("-inf")] == k).all()
        return kept

    _matches_the_masked_softmax(hidden, head, target_ids, temperature, kept_of, floors=floors, top_k=k)


def test_top_k_alone_agrees_with_a_bf16_sampler_as_well_as_no_filter_does():
    """The sampler's logits are bf16 (the engine's), the trainer's float32. Near the k-th logit of a flat distribution
    bf16 ties several tokens; the sampler keeps exactly k of them, and a fixed floor between its k-th and (k+1)-th
    then lets the trainer keep whichever of the tied tokens its float32 logits put above it: whole tokens of ~1/k
    probability in or out (issue 34: --top_k 50 gave 9.2x the defaults' lag-0 KL on the H200). The trainer's own
    top-k agrees with the sampler as closely as the unfiltered softmaxes do."""
    generator = torch.Generator().manual_seed(0)
    rows, vocab, k = 64, 32768, 50
    exact = torch.randn(rows, vocab, generator=generator)  # a random model's near-flat logits
    sampler = exact.bfloat16().float()
    trainer = exact + torch.randn(rows, vocab, generator=generator) * 0.003  # its own numerics too
    kept_ids = sampler.topk(k, dim=-1).indices  # exactly k, as the engine's kernels keep
    kept = torch.zeros_like(sampler, dtype=torch.bool).scatter(-1, kept_ids, True)
    floors = (sampler.masked_fill(~kept, float("inf")).min(-1).values + sampler.masked_fill(kept, float("-inf")).max(-1).values) / 2
    assert (sampler == sampler.masked_fill(~kept, float("inf")).min(-1, keepdim=True).values).sum(-1).float().mean() > 2  # ties
    target_ids = kept_ids[:, 3]
    sampled = sampler.masked_fill(~kept, float("-inf")).log_softmax(-1).gather(-1, target_ids[:, None])[:, 0]
    eye = torch.nn.Linear(vocab, vocab, bias=False)
    torch.nn.init.eye_(eye.weight)
    with torch.no_grad():
        by_floor = logprobs_and_entropy(trainer, eye, target_ids, floors=floors, chunk_size=16)[0]
        by_own_k = logprobs_and_entropy(trainer, eye, target_ids, floors=floors, chunk_size=16, top_k=k)[0]
    unfiltered = ((trainer.log_softmax(-1) - sampler.log_softmax(-1)).gather(-1, target_ids[:, None]) ** 2).mean()
    assert ((by_own_k - sampled) ** 2).mean() < 1.5 * unfiltered
    assert ((by_floor - sampled) ** 2).mean() > 4 * unfiltered  # what the floor alone gives: why top-k keeps its own


def _saved_shapes(fn) -> list[tuple[int, ...]]:
    """Shapes of the tensors autograd saves for backward while `fn` runs."""
    shapes = []

    def pack(tensor):
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return shapes


def test_no_logits_are_saved_for_backward_only_inputs():
    hidden, head, target_ids = _case(num_tokens=64, hidden_size=8, vocab=50)
    # the probe sees a plain full-logits computation save [N, V] tensors...
    assert (64, 50) in _saved_shapes(lambda: _plain(hidden, head, target_ids, 1.0))
    # ...and the fused head save no logits at all (not even a chunk's): its inputs and three floats per row
    shapes = _saved_shapes(lambda: logprobs_and_entropy(hidden, head, target_ids, chunk_size=16))
    assert sorted(shapes) == sorted([(64, 8), (50, 8), (64,), (64,), (64,), (64,)])


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
        return out


def test_forward_and_backward_hold_one_chunk_of_logits_at_a_time():
    hidden, head, target_ids = _case(num_tokens=64, vocab=50)
    with _Shapes() as probe:
        logprobs, _ = logprobs_and_entropy(hidden, head, target_ids, chunk_size=16)
        logprobs.sum().backward()
    widest = max(math.prod(shape) for shape in probe.shapes if 50 in shape and shape != (50, 8))
    assert widest == 16 * 50  # a chunk's logits (or their gradient), never [64, 50]
    assert (16, 50) in probe.shapes


def test_entropy_gradient_equals_autograd_of_full_logits():
    hidden, head, target_ids = _case()
    _, entropy = logprobs_and_entropy(hidden, head, target_ids, temperature=0.7, chunk_size=8)
    (entropy * torch.linspace(-1, 1, len(entropy))).sum().backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    _, ref_entropy = _plain(hidden, head, target_ids, 0.7)
    (ref_entropy * torch.linspace(-1, 1, len(entropy))).sum().backward()
    torch.testing.assert_close(grads, (hidden.grad, head.weight.grad), atol=1e-5, rtol=1e-5)


def test_entropy_is_only_computed_when_asked():
    hidden, head, target_ids = _case()
    logprobs, entropy = logprobs_and_entropy(hidden, head, target_ids, with_entropy=False)
    ref_logprobs, _ = _plain(hidden, head, target_ids, 1.0)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=1e-5)
    assert not entropy.any()


def test_no_grad_scoring_skips_checkpointing_and_matches():
    hidden, head, target_ids = _case()
    with torch.no_grad():
        logprobs, entropy = logprobs_and_entropy(hidden, head, target_ids, chunk_size=5)
        ref_logprobs, ref_entropy = _plain(hidden, head, target_ids, 1.0)
    torch.testing.assert_close((logprobs, entropy), (ref_logprobs, ref_entropy), atol=1e-5, rtol=1e-5)


def test_zero_temperature_is_refused_with_the_reason():
    hidden, head, target_ids = _case()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs_and_entropy(hidden, head, target_ids, temperature=0.0)


def low_temperature_head_matches_float64(temperature: float, device: str = "cpu") -> None:
    """The head's logprobs, entropy and hidden gradient at `temperature` against float64 autograd, on logits
    near 60 (a trained model's top logits; 8 tokens within a few temperatures of the top): the head is the
    identity, so the logits are the hidden states themselves. (A target far below the top has a logprob of
    ~(x - max) / T, which float32 holds only to its relative precision: the targets are among the top 8.)"""
    generator = torch.Generator().manual_seed(3)
    rows, vocab = 16, 64
    logits = torch.randn(rows, vocab, generator=generator) * 3 + 40
    logits[:, :8] = 60 + temperature * torch.randn(rows, 8, generator=generator) * 2
    head = torch.nn.Linear(vocab, vocab, bias=False, device=device)
    with torch.no_grad():
        head.weight.copy_(torch.eye(vocab))
    target_ids = torch.randint(8, (rows,), generator=generator)
    coefficients = torch.linspace(-1, 1, rows)
    hidden = logits.to(device, copy=True).requires_grad_()
    logprobs, entropy = logprobs_and_entropy(hidden, head, target_ids.to(device), temperature=temperature, chunk_size=8)
    ((logprobs + entropy) * coefficients.to(device)).sum().backward()
    logprobs, entropy, hidden_grad = logprobs.cpu(), entropy.cpu(), hidden.grad.cpu()
    exact_hidden = logits.double().requires_grad_()
    exact = (exact_hidden / temperature).log_softmax(-1)
    exact_logprobs, exact_entropy = exact.gather(-1, target_ids[:, None])[:, 0], -(exact.exp() * exact).sum(-1)
    ((exact_logprobs + exact_entropy) * coefficients.double()).sum().backward()
    torch.testing.assert_close(logprobs.double(), exact_logprobs.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy.double(), exact_entropy.detach(), atol=1e-5, rtol=0)
    # the gradient is ~1/T: relative to its largest entry per row
    scale = exact_hidden.grad.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(hidden_grad.double() / scale, exact_hidden.grad / scale, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1e-4, 1e-2, 0.3])
def test_logprobs_entropy_and_gradient_at_low_temperatures_match_float64(temperature):
    # the head divided the logits by T before the row max came off: logits of ~60 at T = 1e-4 are ~6e5
    # tempered, where float32's spacing (1/16) put logprobs off by ~3e-2 from float64 (and off the sampler's)
    low_temperature_head_matches_float64(temperature)
