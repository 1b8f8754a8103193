"""The trainer's GPU path (bf16 compute weights, varlen attention, compiled layers, fused logprob head,
with its torch or its Triton kernels) against a float32 reference of the same weights (marker gpu).

Tolerance: logprobs of the bf16 path within 0.05 nats of float32 on average and 0.5 at worst, on a
random-weight model whose logprobs are about -12 (bf16 keeps 8 bits of mantissa: hidden states and
weights round at ~0.4%, which moves a logit of magnitude ~4 by ~0.02)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from tandemrl.algo.presets import AlgoConfig
from tandemrl.train.config import TrainerConfig
from tandemrl.train.trainer import Trainer
from tandemrl.types import Batch, Completion, Example, Group, Rollout, TokenTrace

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def _batch(seed=0, groups=8, group_size=4) -> Batch:
    rng = random.Random(seed)
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(1000, 150000) for _ in range(rng.randint(20, 130))]
        rollouts = []
        for _ in range(group_size):
            trace = TokenTrace()
            trace.append_context(prompt)
            n = rng.randint(10, 250)
            ids = [rng.randrange(1000, 150000) for _ in range(n)]
            trace.append_sampled(Completion(token_ids=ids, logprobs=[-12.0] * n, finish_reason="stop", policy_versions=[0] * n))
            rollouts.append(Rollout(example=Example(prompt="p"), trace=trace))
        out.append(Group(example=Example(prompt="p"), rollouts=rollouts, advantages=[rng.gauss(0, 1) for _ in range(group_size)]))
    return Batch(groups=out, policy_version=0)


def _logprobs(trainer: Trainer, batch: Batch) -> torch.Tensor:
    from tandemrl.train.batching import pack

    traces = [r.trace for g in batch.groups for r in g.rollouts]
    m = pack(traces, [0.0] * len(traces), "cuda")
    model = trainer.plan.forward_model(trainer.model, trainer.policy_version)
    with torch.no_grad():
        return trainer._forward(model, m)[0][m.loss_mask]


HEADS = pytest.mark.parametrize("triton_logprobs", [False, True], ids=["torch_head", "triton_head"])


@HEADS
def test_bf16_path_logprobs_match_float32_within_bf16_tolerance(triton_logprobs):
    model = _model()
    # the head's switches are process-wide, set by the trainer built last: the fast one
    exact = Trainer(TrainerConfig(device="cuda", bf16=False, torch_compile=False), AlgoConfig(), copy.deepcopy(model), max_steps=1)
    fast = Trainer(TrainerConfig(device="cuda", triton_logprobs=triton_logprobs), AlgoConfig(), model, max_steps=1)
    assert fast.plan.compute is not None and fast.plan.packed and exact.plan.compute is None
    batch = _batch()
    ours, reference = _logprobs(fast, batch), _logprobs(exact, batch)
    error = (ours - reference).abs()
    print(f"bf16 vs float32 logprobs: mean |diff| {error.mean():.4f}, max {error.max():.4f} nats over {error.numel()} tokens")
    assert error.mean() < 0.05 and error.max() < 0.5


@HEADS
def test_a_bf16_step_moves_the_float32_masters_like_a_float32_step(triton_logprobs):
    model = _model()
    config = dict(device="cuda", learning_rate=1e-4, max_tokens_per_microbatch=4096)
    before = [p.detach().clone() for p in model.parameters()]
    exact = Trainer(TrainerConfig(**config, bf16=False, torch_compile=False), AlgoConfig(), copy.deepcopy(model), max_steps=2)
    fast = Trainer(TrainerConfig(**config, triton_logprobs=triton_logprobs), AlgoConfig(), model, max_steps=2)
    for trainer in (fast, exact):
        metrics = trainer.train_step(_batch(seed=1))
        assert metrics["grad_norm"] > 0 and trainer.policy_version == 1
    moved_fast = torch.cat([(p - b).flatten() for p, b in zip(fast.model.parameters(), before)])
    moved_exact = torch.cat([(p - b).flatten() for p, b in zip(exact.model.parameters(), before)])
    assert all(p.dtype == torch.float32 for p in fast.model.parameters())
    cosine = torch.nn.functional.cosine_similarity(moved_fast, moved_exact, dim=0)
    print(f"update direction, bf16 path vs float32: cosine {cosine:.4f}")
    assert cosine > 0.9


def test_masked_truncated_completions_packed_together_train_at_the_05b_shape():
    """Issue 36: with --mask_truncated_completions the longest (truncated, 1,024-token) completions are packed
    into micro-batches of their own, with no trained token; the bf16 path's backward used to raise
    "element 0 of tensors does not require grad". The step now trains the others, as one micro-batch would."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tandemrl.types import RolloutStatus

    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6,
    )  # fmt: skip  (Qwen2.5-0.5B's shape, random weights)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    batch = _batch(seed=2)
    rng = random.Random(2)
    for g in batch.groups:
        for r in g.rollouts[:2]:  # half of each group: 1,024 sampled tokens, cut at the limit
            prompt = [t for t, trained in zip(r.trace.token_ids, r.trace.loss_mask) if not trained]
            r.trace = TokenTrace()
            r.trace.append_context(prompt)
            ids = [rng.randrange(1000, 150000) for _ in range(1024)]
            r.trace.append_sampled(Completion(token_ids=ids, logprobs=[-12.0] * 1024, finish_reason="length", policy_versions=[0] * 1024))
            r.status = RolloutStatus.TRUNCATED
    algo = AlgoConfig(mask_truncated_completions=True, max_completion_length=1024, loss_type="dapo")
    trainer = Trainer(TrainerConfig(device="cuda", learning_rate=1e-6, max_tokens_per_microbatch=4096), algo, model, max_steps=2)
    metrics = trainer.train_step(batch)
    print({k: round(v, 4) for k, v in metrics.items() if k in ("loss", "grad_norm", "entropy", "policy_version")})
    assert trainer.policy_version == 1 and metrics["grad_norm"] > 0
    assert all(torch.isfinite(torch.tensor(metrics[k])) for k in ("loss", "grad_norm", "entropy"))
