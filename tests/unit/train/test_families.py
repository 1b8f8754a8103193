"""The trainer's path over every family the engine serves (README's table), on CPU in float32: packed
attention (sliding windows, Gemma 2's soft cap) and the fused logprob head (Gemma 2's final cap) score each
token as transformers' plain forward does, with the same gradients; a train step of the trainer's fast
path equals the plain path's."""

from __future__ import annotations

import copy

import pytest
import torch

from tandemrl.algo.logprobs import logprobs_and_entropy
from tandemrl.algo.presets import AlgoConfig
from tandemrl.tasks.tiny import build_model, build_tokenizer
from tandemrl.train.config import TrainerConfig
from tandemrl.train.forward import ForwardPlan
from tandemrl.train.precision import ComputeWeights
from tandemrl.train.trainer import Trainer
from tests.unit.generation.engine.conftest import FAMILIES, WINDOW
from tests.unit.train.test_forward import _packed
from tests.unit.train.test_trainer import make_batch

NAMES = [name for name in FAMILIES if name not in ("qwen2", "llama3-untied", "qwen3")]  # those: tests/unit/train/test_forward.py


def _plain_logprobs(model, m) -> torch.Tensor:
    """transformers' own forward, one sequence at a time: logprob of each next token, where pack trains it."""
    out = []
    bounds = m.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        logits = model(input_ids=m.input_ids[:, start:end]).logits[0].float()  # [L, V]
        out.append(logits.log_softmax(-1).gather(-1, m.target_ids[start:end, None])[:, 0])
    return torch.cat(out)[m.trained_index]


@pytest.mark.parametrize("name", NAMES)
def test_packed_forward_and_fused_head_score_each_family_as_transformers(name):
    model = build_model(build_tokenizer(), seed=3, **FAMILIES[name])
    packed = copy.deepcopy(model)
    plan = ForwardPlan(compute=None, dtype=None, packed=True, compile=False, no_grad_budget_factor=1)
    plan._prepare(packed)
    m = _packed(lengths=(5, 3 * WINDOW, 3))  # one sequence past the window
    ours, _ = plan.logprobs(packed, m, temperature=1.0, chunk_size=8, with_entropy=False)
    theirs = _plain_logprobs(model, m)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    ours.sum().backward()
    theirs.sum().backward()
    for (param_name, a), b in zip(packed.named_parameters(), model.parameters()):
        assert (a.grad - b.grad).abs().max() <= 1e-5 * b.grad.abs().max() + 1e-6, param_name


def test_the_fused_head_applies_a_soft_cap_with_its_gradient():
    torch.manual_seed(0)
    hidden, head = torch.randn(7, 16, requires_grad=True), torch.nn.Linear(16, 50, bias=False)
    head.weight.data *= 20  # logits well past the cap's linear range
    target = torch.randint(0, 50, (7,))
    ours, entropy = logprobs_and_entropy(hidden, head, target, chunk_size=3, softcap=5.0, temperature=0.7)
    logits = torch.tanh(head(hidden) / 5.0) * 5.0 / 0.7
    expected = logits.log_softmax(-1).gather(-1, target[:, None])[:, 0]
    expected_entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(entropy, expected_entropy)
    grads = torch.autograd.grad((ours + 0.3 * entropy).sum(), (hidden, head.weight))
    for got, want in zip(grads, torch.autograd.grad((expected + 0.3 * expected_entropy).sum(), (hidden, head.weight))):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_a_train_step_of_the_fast_path_equals_the_plain_path(name):
    """One step: the trainer's fast path (compute twin, packed attention) against the plain one."""
    tokenizer = build_tokenizer()
    config, algo = TrainerConfig(learning_rate=1e-2, max_tokens_per_microbatch=24), AlgoConfig()
    plain = Trainer(config, algo, build_model(tokenizer, seed=1, **FAMILIES[name]), max_steps=1)
    fast = Trainer(config, algo, build_model(tokenizer, seed=1, **FAMILIES[name]), max_steps=1)
    fast.plan = ForwardPlan(compute=ComputeWeights(fast.model, torch.float32), dtype=None, packed=True, compile=False, no_grad_budget_factor=4)
    fast.plan._prepare(fast.plan.compute.model)
    a, b = plain.train_step(make_batch(seed=0)), fast.train_step(make_batch(seed=0))
    for key in ("loss", "entropy", "grad_norm"):
        assert b[key] == pytest.approx(a[key], abs=1e-5), key
    for (param_name, p), q in zip(plain.model.named_parameters(), fast.model.parameters()):
        # the two paths' gradients agree (the packed test's bound above); Adam divides each step by its gradient's
        # own size, so where a gradient is near 0 (~eps, 1e-8) a round-off of 1e-10 moves the step by ~1% of the
        # learning rate (transformers 5.25's plain path moved one element of Mistral's down_proj by 1.3e-4, its
        # gradient 2.6e-9 against 2.8e-9): the updated parameters are compared where the gradient is not near 0
        assert (q.grad - p.grad).abs().max() <= 1e-5 * p.grad.abs().max() + 1e-6, param_name
        moved = p.grad.abs() > 1e-6
        torch.testing.assert_close(q[moved], p[moved], atol=1e-4, rtol=1e-4)
