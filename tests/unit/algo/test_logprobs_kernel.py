"""The fused head's Triton kernels against its torch path: values and gradients, in triton's interpreter
on CPU (skipped where triton is not installed, as in CI) or on a GPU where there is one."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (CI): the torch path is the head's CPU path", allow_module_level=True)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

from tandemrl.algo import logprobs as head  # noqa: E402
from tandemrl.algo.logprobs_kernel import logits_grad, row_stats  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(rows=5, vocab=9000, seed=0):
    # wider than a tile (4096) and not a multiple of one, with a few large logits, as a trained head has
    generator = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(rows, vocab, generator=generator)
    logits[:, 17] += 25.0
    logits[1, vocab - 3] += 40.0  # a row whose max arrives in its last (partial) tile: the running sums rescale
    target_ids = torch.randint(vocab, (rows,), generator=generator)
    target_ids[0], target_ids[1] = 17, vocab - 3
    return logits.to(DEVICE), target_ids.to(DEVICE)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_stats_kernel_equals_the_torch_path(temperature):
    logits, target_ids = _logits()
    ours = row_stats(logits, target_ids, temperature, True)
    # against float64: one pass sums E_p[z] more exactly than softmax * logits (entropy = lse - E_p[z] cancels)
    tempered, row_max = head._tempered(logits.double(), temperature)  # lse of the logits less their max
    reference = [x.float() for x in (*head._row_stats(tempered, target_ids, True), row_max)]
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    lse, logprobs, entropy, _ = row_stats(logits, target_ids, temperature, False)
    torch.testing.assert_close(logprobs, reference[1], atol=2e-5, rtol=1e-5)
    assert not entropy.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_grad_kernel_equals_the_torch_path(dtype):
    logits, target_ids = _logits()
    tempered, row_max = head._tempered(logits.clone(), 0.7)
    lse, _, entropy = head._row_stats(tempered, target_ids, True)
    generator = torch.Generator().manual_seed(1)
    grad, grad_entropy = (torch.randn(len(lse), generator=generator).to(DEVICE) for _ in range(2))
    ours = logits_grad(logits, row_max, lse, target_ids, grad, entropy, grad_entropy, 0.7, dtype)
    reference = head._logits_grad(tempered, lse, target_ids, grad, entropy, grad_entropy, 0.7, dtype)
    assert ours.dtype == dtype
    # float32: where p -> 1 the gradient is grad * (1 - p), and p carries the log-sum-exp's float32 error at
    # logits of ~90 (the H200 gave 2.5e-6 against an exact 0 there): the same 2e-5 as the row statistics.
    # bfloat16: one unit in the last place (triton's interpreter truncates where the GPU rounds to nearest)
    tolerance = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-5, rtol=1e-2)
    torch.testing.assert_close(ours, reference, **tolerance)


@pytest.mark.parametrize("truncated", [False, True])
def test_head_through_the_kernels_equals_the_torch_head_in_value_and_gradient(monkeypatch, truncated):
    """logprobs_and_entropy end to end (forward, backward of logprobs and entropy, several chunks); truncated:
    under the sampler's logit floors (top-k/top-p/min-p), excluded tokens as the torch path excludes them."""
    generator = torch.Generator().manual_seed(2)
    lm_head = torch.nn.Linear(16, 5000, bias=False).to(DEVICE)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(5000, 16, generator=generator))
    hidden = torch.randn(11, 16, generator=generator).to(DEVICE).requires_grad_()
    target_ids = torch.randint(5000, (11,), generator=generator).to(DEVICE)
    coefficients = torch.linspace(-1, 1, 11, device=DEVICE)
    results = []
    for triton in (False, True):
        monkeypatch.setattr(head, "_use_triton", lambda tensor, on=triton: on)
        monkeypatch.setattr(head, "_COMPILE", [False])
        floors = None
        if truncated:  # about 100 tokens kept per row, every third row unfiltered
            floors = (lm_head(hidden).float() / 0.8).detach().sort(-1, descending=True).values[:, 100]
            floors[::3] = float("-inf")
        logprobs, entropy = head.logprobs_and_entropy(hidden, lm_head, target_ids, temperature=0.8, chunk_size=4, floors=floors)
        (coefficients * logprobs + 0.1 * entropy).sum().backward()
        results.append((logprobs.detach(), entropy.detach(), hidden.grad, lm_head.weight.grad))
        hidden.grad, lm_head.weight.grad = None, None
    for ours, reference in zip(results[1], results[0]):
        torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("temperature", [1e-4, 1e-2, 0.3])
def test_head_through_the_kernels_at_low_temperatures_matches_float64(monkeypatch, temperature):
    from tests.unit.algo.test_logprobs import low_temperature_head_matches_float64

    monkeypatch.setattr(head, "_use_triton", lambda tensor: True)
    low_temperature_head_matches_float64(temperature, DEVICE)
