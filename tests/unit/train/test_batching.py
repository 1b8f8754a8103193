import pytest
import torch

from tandemrl.algo.logprobs import logprobs_and_entropy
from tandemrl.train.batching import MicroBatches, pack, plan_microbatches
from tandemrl.types import Completion, TokenTrace

T, F = True, False


def _trace(prompt_ids, *turns):
    """A trace: context `prompt_ids`, then alternating (sampled ids, logprobs, version) and context ids."""
    trace = TokenTrace()
    trace.append_context(prompt_ids)
    for turn in turns:
        if isinstance(turn, tuple):
            ids, logprobs, version = turn
            versions = [version] * len(ids)
            completion = Completion(token_ids=ids, logprobs=logprobs, finish_reason="stop", policy_versions=versions)
            trace.append_sampled(completion)
        else:
            trace.append_context(turn)
    return trace


def test_pack_shifts_every_per_token_field_to_the_target_it_predicts():
    batch = pack([_trace([5], ([6, 7], [-0.1, -0.2], 3)), _trace([8, 9], ([10], [-0.5], 4), [11])], [1.0, -2.0])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert batch.target_ids.tolist() == [6, 7, 0, 9, 10, 11, 0]
    assert batch.loss_mask.tolist() == [T, T, F, F, T, F, F]
    torch.testing.assert_close(batch.old_logprobs, torch.tensor([-0.1, -0.2, 0, 0, -0.5, 0, 0]))
    assert torch.equal(batch.behaviour_logprobs, batch.old_logprobs)
    assert batch.advantages.tolist() == [1.0, 1.0, 1.0, -2.0, -2.0, -2.0, -2.0]
    assert batch.seq_index.tolist() == [0, 0, 0, 1, 1, 1, 1]
    assert batch.policy_versions.tolist() == [3, 3, -1, -1, 4, -1, -1]
    assert (batch.num_sequences, batch.num_trained_tokens) == (2, 3)


def test_tool_output_between_turns_is_context_not_trained():
    batch = pack([_trace([1], ([2], [-0.3], 0), [3, 4], ([5], [-0.4], 1))], [1.0])
    # targets 2, 3, 4, 5, end: only the two sampled tokens are trained
    assert batch.target_ids.tolist() == [2, 3, 4, 5, 0]
    assert batch.loss_mask.tolist() == [T, F, F, T, F]


def test_old_logprobs_is_a_copy_the_trainer_may_overwrite():
    batch = pack([_trace([1], ([2], [-0.3], 0))], [1.0])
    batch.old_logprobs[0] = -9.0
    assert batch.behaviour_logprobs[0].item() == pytest.approx(-0.3)


def test_pack_keeps_every_field_dtype():
    batch = pack([_trace([5], ([6, 7], [-0.1, -0.2], 3))], [1.0])
    dtypes = {name: getattr(batch, name).dtype for name in ("input_ids", "position_ids", "target_ids", "seq_index", "policy_versions", "trained_index")}
    assert set(dtypes.values()) == {torch.long}, dtypes
    assert (batch.loss_mask.dtype, batch.cu_seqlens.dtype) == (torch.bool, torch.int32)
    assert batch.old_logprobs.dtype == batch.behaviour_logprobs.dtype == batch.advantages.dtype == torch.float32


def test_micro_batches_pack_when_first_used_and_count_trained_tokens_without_packing(monkeypatch):
    traces = [_trace([5], ([6, 7], [-0.1, -0.2], 3)), _trace([8, 9], ([10], [-0.5], 4), [11]), _trace([1], ([2], [-0.3], 0))]
    traces[2].loss_mask[0] = True  # a first token is never trained, whatever its mask says
    plan = [[0, 2], [1]]
    packed = []
    monkeypatch.setattr("tandemrl.train.batching.pack", lambda *args: packed.append(args) or pack(*args))
    micro = MicroBatches(traces, [1.0, -2.0, 0.5], plan, torch.device("cpu"))
    assert micro.num_trained_tokens == 4 and not packed
    assert micro[1].input_ids.tolist() == [[8, 9, 10, 11]] and len(packed) == 1
    assert [m.num_trained_tokens for m in micro] == [3, 1] and len(packed) == 2  # each packed once, then kept
    assert micro.num_trained_tokens == sum(m.num_trained_tokens for m in micro)
    expected = pack([traces[0], traces[2]], [1.0, 0.5])
    assert micro[0].advantages.tolist() == expected.advantages.tolist() and len(micro) == 2


@pytest.mark.parametrize(
    "lengths, max_tokens, expected",
    [
        ([3, 5, 2, 4], 7, [[1, 2], [0, 3]]),
        ([4, 4, 4], 8, [[0, 1], [2]]),
        ([2, 9, 3], 5, [[1], [0, 2]]),  # 9 > 5: alone, over the budget
        ([], 4, []),
    ],
)
def test_microbatches_are_first_fit_decreasing_within_the_token_budget(lengths, max_tokens, expected):
    plan = plan_microbatches(lengths, max_tokens)
    assert plan == expected
    assert sorted(i for micro in plan for i in micro) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in micro) <= max_tokens or len(micro) == 1 for micro in plan)


def test_microbatch_plan_is_deterministic_under_ties():
    lengths = [3, 1, 3, 2, 1, 3, 2]
    assert plan_microbatches(lengths, 4) == plan_microbatches(list(lengths), 4) == [[0, 1], [2, 4], [5], [3, 6]]


def test_microbatch_budget_must_be_positive():
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        plan_microbatches([1], 0)


def test_packed_sequences_score_as_if_alone_on_a_real_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    traces = [
        _trace([1, 40, 41], ([42, 43, 44], [-1.0] * 3, 0)),
        _trace([2, 50], ([51, 52], [-1.0] * 2, 0), [53], ([54], [-1.0], 0)),
    ]

    def score(batch, position_ids=None):
        position_ids = batch.position_ids if position_ids is None else position_ids
        hidden = model.model(input_ids=batch.input_ids, position_ids=position_ids, use_cache=False)
        logprobs, _ = logprobs_and_entropy(hidden.last_hidden_state[0], model.lm_head, batch.target_ids)
        return logprobs[batch.loss_mask]

    with torch.no_grad():
        together = score(pack(traces, [0.0, 0.0]))
        alone = torch.cat([score(pack([trace], [0.0])) for trace in traces])
        packed = pack(traces, [0.0, 0.0])
        leaky = score(packed, torch.arange(packed.input_ids.shape[1])[None])  # one long causal row: cross-talk
    assert together.shape == (6,)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(leaky[3:], together[3:])  # the probe would see cross-talk
