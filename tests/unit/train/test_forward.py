"""The trainer's fast forward path, run on CPU in float32: packed attention, compute weights, larger
no-grad micro-batches and trained-positions-only scoring equal today's path within 1e-5."""

from __future__ import annotations

import copy

import pytest
import torch

from tandemrl.algo.presets import AlgoConfig
from tandemrl.tasks.tiny import build_model, build_tokenizer
from tandemrl.train.attention import layout, use_packed_attention
from tandemrl.train.batching import pack
from tandemrl.train.config import TrainerConfig
from tandemrl.train.forward import ForwardPlan
from tandemrl.train.precision import ComputeWeights
from tandemrl.train.trainer import Trainer
from tandemrl.types import TokenTrace
from tests.unit.train.test_trainer import make_batch


def _packed(seed: int = 0, lengths=(5, 9, 3)):
    generator = torch.Generator().manual_seed(seed)
    traces = []
    for n in lengths:
        ids = torch.randint(3, 300, (n,), generator=generator).tolist()
        traces.append(TokenTrace(token_ids=ids, loss_mask=[True] * n, logprobs=[0.0] * n, policy_versions=[0] * n))
    return pack(traces, [0.0] * len(traces))


def _hidden(model, m, **kwargs):
    return model.base_model(input_ids=m.input_ids, position_ids=m.position_ids, use_cache=False, **kwargs).last_hidden_state


@pytest.mark.parametrize("model_type", ["qwen2", "llama", "qwen3"])
def test_packed_attention_equals_transformers_block_diagonal_attention(model_type):
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, model_type=model_type, seed=3)
    packed = copy.deepcopy(model)
    use_packed_attention(packed)
    m = _packed()
    ours, theirs = _hidden(packed, m, **layout(m.cu_seqlens, m.max_seqlen)), _hidden(model, m)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    ours.square().mean().backward()
    theirs.square().mean().backward()
    for (name, a), b in zip(packed.named_parameters(), model.parameters()):  # float32 round-off, relative to scale
        assert (a.grad - b.grad).abs().max() <= 1e-5 * b.grad.abs().max() + 1e-6, name


def test_packed_sequences_never_see_each_other():
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=3)
    use_packed_attention(model)
    a, b = _packed(seed=0), _packed(seed=1)
    b.input_ids[0, :5] = a.input_ids[0, :5]  # same first sequence, different others
    with torch.no_grad():
        ha, hb = _hidden(model, a, **layout(a.cu_seqlens, a.max_seqlen)), _hidden(model, b, **layout(b.cu_seqlens, b.max_seqlen))
    torch.testing.assert_close(ha[0, :5], hb[0, :5])
    assert not torch.allclose(ha[0, 5:], hb[0, 5:])


def test_pack_knows_the_row_layout_and_trained_positions_on_the_host():
    m = _packed(lengths=(3, 2, 1))
    assert m.cu_seqlens.tolist() == [0, 3, 5, 6] and m.max_seqlen == 3 and m.num_sequences == 3
    assert m.trained_index.tolist() == m.loss_mask.nonzero().flatten().tolist() == [0, 1, 3]
    assert m.num_trained_tokens == 3


def _grads_of_each_step(trainer: Trainer) -> list[list[torch.Tensor]]:
    """Records the master gradients the optimizer sees at each of its steps."""
    seen: list[list[torch.Tensor]] = []
    trainer.optimizer.register_step_pre_hook(lambda *_: seen.append([p.grad.clone() for p in trainer.model.parameters()]))
    return seen


def test_fast_path_equals_todays_path_in_float32():
    """Compute twin + packed attention + 4x no-grad micro-batches, against the CPU path, with a reference
    model and two iterations so the no-grad passes run too."""
    tokenizer = build_tokenizer()
    algo = AlgoConfig(beta=0.05, num_iterations=2)
    config = TrainerConfig(learning_rate=1e-2, max_tokens_per_microbatch=24)
    today = Trainer(config, algo, build_model(tokenizer, seed=1), max_steps=2)
    fast = Trainer(config, algo, build_model(tokenizer, seed=1), max_steps=2)
    fast.plan = ForwardPlan(
        compute=ComputeWeights(fast.model, torch.float32), dtype=None, packed=True, compile=False, no_grad_budget_factor=4
    )
    fast.plan._prepare(fast.plan.compute.model)
    fast.reference = fast.plan.frozen_copy(fast.model)
    seen_today, seen_fast = _grads_of_each_step(today), _grads_of_each_step(fast)
    for seed in range(2):
        a, b = today.train_step(make_batch(seed=seed)), fast.train_step(make_batch(seed=seed))
        for key in ("loss", "kl", "entropy", "grad_norm", "clip_ratio/region_mean"):
            assert b[key] == pytest.approx(a[key], abs=1e-5), key
    assert len(seen_today) == len(seen_fast) == 4
    for grads_today, grads_fast in zip(seen_today, seen_fast):
        for g_today, g_fast in zip(grads_today, grads_fast):
            torch.testing.assert_close(g_fast, g_today, atol=1e-5, rtol=1e-4)


def test_compute_weights_accumulate_gradients_in_float32_and_refresh_once_per_version():
    master = torch.nn.Linear(4, 3, bias=False)
    twin = ComputeWeights(master, torch.bfloat16)
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    twin.refresh(0)
    twin.zero_grad()
    twin.model(x).sum().backward()
    twin.accumulate()
    first = master.weight.grad.clone()
    twin.model(2 * x).sum().backward()
    twin.accumulate()
    assert master.weight.grad.dtype == torch.float32 and twin.model.weight.grad is None  # dropped once added
    torch.testing.assert_close(master.weight.grad, first * 3)  # d/dW of sum(W x) + sum(W 2x)
    with torch.no_grad():
        master.weight.add_(1.0)
    twin.refresh(0)  # same version: no copy
    assert not torch.equal(twin.model.weight.float(), master.weight.bfloat16().float())
    twin.refresh(1)
    assert torch.equal(twin.model.weight, master.weight.bfloat16())


def test_compute_weights_sum_each_micro_batch_gradient_exactly_as_float32_adds():
    """Bit for bit: the master gradient is the float32 sum of each micro-batch's bfloat16 gradient (a tied
    embedding/head summed in bfloat16 within a backward, as autograd does), whatever moves it there."""
    tokenizer = build_tokenizer()
    master = build_model(tokenizer, seed=5)
    twin = ComputeWeights(master, torch.bfloat16)
    plain = copy.deepcopy(twin.model)  # same bfloat16 weights, gradients left to autograd alone
    twin.refresh(0)
    twin.zero_grad()
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in master.parameters()]
    for seed in range(3):
        ids = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(seed))
        twin.model(input_ids=ids).logits.float().square().mean().backward()
        twin.accumulate()
        plain.zero_grad(set_to_none=True)
        plain(input_ids=ids).logits.float().square().mean().backward()
        for total, p in zip(expected, plain.parameters()):
            total.add_(p.grad)
    assert all(p.grad is None for p in twin.model.parameters())
    for (name, p), total in zip(master.named_parameters(), expected):
        assert torch.equal(p.grad, total), name


def test_mixed_precision_publishes_the_refreshed_16_bit_twin_under_the_masters_names():
    """The generators get the compute twin (the masters rounded to bf16), fresh for the new version, not
    the float32 masters (twice the bytes); the next forward reuses that refresh."""
    tokenizer = build_tokenizer()
    trainer = Trainer(TrainerConfig(learning_rate=1e-2), AlgoConfig(), build_model(tokenizer, seed=1), max_steps=2)
    trainer.plan = ForwardPlan(
        compute=ComputeWeights(trainer.model, torch.bfloat16), dtype=torch.bfloat16, packed=False, compile=False, no_grad_budget_factor=1
    )
    for seed in (0, 1):  # the second step's publish hands over the list the first listed, holding the new values
        trainer.train_step(make_batch(seed=seed))
        published = dict(trainer.published_weights())
        masters = dict(trainer.model.named_parameters())
        assert list(published) == list(masters)
        for name, master in masters.items():
            assert published[name].dtype == torch.bfloat16
            assert torch.equal(published[name], master.detach().to(torch.bfloat16)), name  # this version's, not the last forward's


def test_gradient_checkpointing_turns_on_without_transformers_deprecation_warning():
    """gradient_checkpointing_enable warned a FutureWarning (transformers 5.2x) at every --gradient_checkpointing
    run, TRL's yaml default; the current name is called where transformers has it."""
    import warnings

    from tandemrl.train.forward import forward_plan

    model = build_model(build_tokenizer())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        forward_plan(TrainerConfig(gradient_checkpointing=True, device="cpu"), model)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
