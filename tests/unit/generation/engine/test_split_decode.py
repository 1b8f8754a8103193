"""Split-KV decode ("flash-decoding"): the chunking and merge math in torch on CPU/float32 against whole
attention, and the Triton kernels (split-KV decode, filtered sampling) in triton's interpreter on CPU
against the pure-PyTorch paths (skipped where triton is not installed, as in CI). tests/gpu repeats the
kernel checks in bf16 on a GPU."""

from __future__ import annotations

import importlib.util
import os

import numpy
import pytest
import torch

from tandemrl.generation.engine.layers.attention import build_gather_metadata, decode_chunks, gather_attention, merge_chunks
from tandemrl.generation.engine.layers.sampler import SamplingTensors, row_keys, sample


def _attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, D], keys/values [C, H, D] -> (softmax attention [H, D], log-sum-exp of the scores [H])."""
    scores = torch.einsum("hd,chd->hc", q, keys) * q.shape[-1] ** -0.5
    return torch.einsum("hc,chd->hd", scores.softmax(-1), values), scores.logsumexp(-1)


@pytest.mark.parametrize("context_len, splits", [(1, 8), (100, 8), (257, 2), (1000, 4), (2100, 9)])
def test_chunks_cover_the_context_and_merge_to_whole_attention(context_len, splits):
    torch.manual_seed(context_len)
    chunks = decode_chunks(context_len, splits, 256, 64)
    assert chunks[0][0] == 0 and chunks[-1][1] == context_len
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # contiguous, no key twice
    assert len(chunks) == min(splits, -(-context_len // 256))
    heads, dim = 2, 16
    q, keys, values = torch.randn(heads, dim), torch.randn(context_len, heads, dim) * 2, torch.randn(context_len, heads, dim)
    parts = [_attention(q, keys[a:b], values[a:b]) if b > a else (torch.full((heads, dim), float("nan")), torch.full((heads,), float("-inf"))) for a, b in chunks]
    merged = merge_chunks(torch.stack([o for o, _ in parts]), torch.stack([lse for _, lse in parts]))
    whole, _ = _attention(q, keys, values)
    assert (merged - whole).norm() / whole.norm() < 1e-5  # float32 sums in another order


def test_a_chunk_may_be_empty_when_chunks_round_up_to_tiles():
    assert decode_chunks(65, 8, 32, 64) == [(0, 64), (64, 65), (65, 65)]  # 3 chunks of at least 32 keys, as whole tiles of 64


_interpreter = importlib.util.find_spec("triton") is not None and not torch.cuda.is_available()
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (CI)")
if _interpreter:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported: they run on CPU tensors
    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):  # its range() over loaded bounds fails there
        needs_triton = pytest.mark.skip(reason="triton's interpreter needs numpy < 2.4")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
def test_splits_fill_the_multiprocessors_from_host_shapes_only():
    from tandemrl.generation.engine.layers.attention_kernel import decode_splits

    assert decode_splits(128, 2, 8192, 132) == 3  # 256 programs -> 768, at least 4 a multiprocessor
    assert decode_splits(64, 2, 8192, 132, programs_per_sm=2) == 3
    assert decode_splits(512, 2, 8192, 132) == 1  # 1024 programs already: the one-chunk path
    assert decode_splits(1, 2, 1000, 132) == 4  # no chunk under min_chunk (256) keys
    assert decode_splits(8, 2, 100, 132) == 1


@needs_triton
@pytest.mark.parametrize("splits, window, softcap", [(1, 0, 0.0), (3, 0, 0.0), (8, 0, 0.0), (3, 150, 5.0)])
def test_split_decode_kernel_equals_gather_attention(splits, window, softcap):
    from tandemrl.generation.engine.layers.attention import AttentionOptions
    from tandemrl.generation.engine.layers.attention_kernel import decode_attention

    torch.manual_seed(splits)
    block, num_blocks, heads, kv_heads, dim = 16, 80, 14, 2, 32
    k_cache = torch.randn(num_blocks * block, kv_heads, dim)
    v_cache = torch.randn_like(k_cache)
    lens = [1, 70, 129, 300, 520]  # one chunk, and chunks of 64 keys rounded to tiles of 32
    perm, tables = (torch.randperm(num_blocks - 1) + 1).tolist(), []
    for n in lens:
        tables.append(perm[: -(-n // block)])
        perm = perm[len(tables[-1]) :]
    q = torch.randn(len(lens), heads, dim)
    options = AttentionOptions(scale=dim**-0.5, window=window, softcap=softcap)  # a window: the last 150 keys, in chunks of them
    expected = gather_attention(q, k_cache, v_cache, build_gather_metadata([1] * len(lens), lens, tables, block, torch.device("cpu")), options)
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    got = decode_attention(
        q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), bt.to(DEVICE), torch.tensor(lens, dtype=torch.int32, device=DEVICE), block,
        options=options, splits=splits, min_chunk=64, tile=32,
    ).cpu()  # fmt: skip
    assert (got - expected).norm() / expected.norm() < 1e-5


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("capacity", [0, 8, 64, 4096])
def test_filtered_sampling_kernel_equals_the_torch_sampler(dtype, capacity):
    # capacity 0: every round reads the row; 8 and 64: the rounds switch to the list part way (64 holds
    # top-k 50's bracket from the start of top-p); 4096: the whole row listed from the first round
    from tandemrl.generation.engine.layers.sampler_kernel import sample_filtered

    torch.manual_seed(3)
    rows, vocab = 13, 400
    scales = torch.tensor([3.0, 3, 3, 3, 3, 3, 0.3, 8, 3, 3, 3, 0.5, 3])
    logits = (torch.randn(rows, vocab) * scales[:, None]).to(dtype)  # flat and peaked rows; bf16: many ties, at the thresholds too
    logits[8, :] = logits[8, 0]  # one row of a single tied value (top-k 3 keeps the first 3 of 400 ties)
    logits[10, :] = logits[10, 0]  # the same, top-p alone
    logits[12, ::3] = float("-inf")  # masked tokens (a padded vocab), top-p alone
    temperatures = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.8])
    top_k = torch.tensor([5, 50, vocab, 7, vocab, 1, 50, vocab, 3, vocab, vocab, vocab, vocab])
    top_p = torch.tensor([0.9, 1.0, 0.8, 0.5, 1.0, 1.0, 0.9, 0.95, 0.5, 1.0, 0.5, 0.9, 0.9])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.05, 0.0, 0.0, 0.0, 0.0, 0.0])  # row 9 filters nothing
    keys = row_keys(torch.arange(rows) * 7919, torch.full((rows,), 130))
    sampling = SamplingTensors(temperatures=temperatures, top_k=top_k, top_p=top_p, min_p=min_p, keys=keys, needs_filter=True)
    expected_ids, expected_logprobs, expected_floors = sample(logits, sampling)
    on = [t.to(DEVICE) for t in (logits, temperatures, top_k, top_p, min_p, keys)]
    ids, logprobs, floors = (t.cpu() for t in sample_filtered(*on, capacity=capacity, tile=128))
    assert ids.tolist() == expected_ids.tolist()
    assert torch.allclose(logprobs, expected_logprobs, atol=1e-5)
    assert torch.equal(floors.isinf(), expected_floors.isinf())  # -inf: greedy rows, rows that filter nothing
    assert torch.allclose(floors, expected_floors, atol=1e-5)  # the trainer's floor: the same kept set


def _filtered_against_torch(logits, temperatures, top_k, top_p, min_p, capacity=64, value_rounds=8):
    from tandemrl.generation.engine.layers.sampler_kernel import sample_filtered

    rows = logits.shape[0]
    keys = row_keys(torch.arange(rows) * 104729, torch.full((rows,), 17))
    sampling = SamplingTensors(temperatures=temperatures, top_k=top_k, top_p=top_p, min_p=min_p, keys=keys, needs_filter=True)
    expected_ids, expected_logprobs, expected_floors = sample(logits, sampling)
    on = [t.to(DEVICE) for t in (logits, temperatures, top_k, top_p, min_p, keys)]
    ids, logprobs, floors = (t.cpu() for t in sample_filtered(*on, capacity=capacity, tile=64, value_rounds=value_rounds))
    assert ids.tolist() == expected_ids.tolist()
    assert torch.allclose(logprobs, expected_logprobs, atol=1e-5)
    assert torch.equal(floors.isinf(), expected_floors.isinf())
    assert torch.allclose(floors, expected_floors, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filtered_sampling_kernel_ties_minus_zero_with_zero(dtype):
    # -0.0 and 0.0 are one value to torch's sort (ties: the lower index first), though their bits differ: a
    # threshold at zero keeps the first zeros of either sign, and a row of -0.0 and 0.0 ties throughout
    vocab = 200
    torch.manual_seed(5)
    logits = torch.randn(4, vocab) * 2
    zeros = torch.arange(0, vocab, 5)
    logits[:2, zeros] = torch.where(torch.arange(zeros.numel()) % 2 == 0, -0.0, 0.0)  # alternating signs
    logits[:2] = torch.where(logits[:2] > 0, logits[:2] + 4.0, logits[:2])  # the positives well above the zeros
    logits[2] = -0.0
    logits[2, 7::9] = 0.0
    logits[3] = -0.0
    positives = int((logits[0] > 0).sum())
    top_k = torch.tensor([positives + 3, vocab, 5, 2])
    top_p = torch.tensor([1.0, 0.999, 1.0, 0.5])
    logits[1, zeros] = torch.where(torch.arange(zeros.numel()) % 2 == 0, 0.0, -0.0)  # row 1: the signs swapped
    _filtered_against_torch(logits.to(dtype), torch.ones(4), top_k, top_p, torch.zeros(4))


@needs_triton
@pytest.mark.parametrize("seed", range(6))
def test_filtered_sampling_kernel_equals_the_torch_sampler_on_random_settings(seed):
    # random rows (flat and peaked, bf16 ties, zeros of both signs, masked tokens, huge logits) under random settings
    generator = torch.Generator().manual_seed(seed)
    rows, vocab = 8, 300
    logits = torch.randn(rows, vocab, generator=generator) * torch.rand(rows, 1, generator=generator).mul(8).add(0.2)
    logits[torch.rand(rows, vocab, generator=generator) < 0.05] = 0.0
    logits[torch.rand(rows, vocab, generator=generator) < 0.05] = -0.0
    logits[torch.rand(rows, vocab, generator=generator) < 0.03] = float("-inf")
    logits[1, torch.rand(vocab, generator=generator) < 0.2] = -1e30  # masked by a finite value: the search splits keys
    logits[2] *= 1e5  # logits past 65536 too
    pick = lambda choices: torch.tensor(choices)[torch.randint(len(choices), (rows,), generator=generator)]  # noqa: E731
    temperatures = pick([0.0, 0.6, 1.0, 1.4])
    top_k = pick([1, 2, 20, 50, vocab])
    top_p = pick([0.3, 0.8, 0.95, 1.0])
    min_p = pick([0.0, 0.0, 0.05, 0.2])
    capacity, value_rounds = [0, 16, 64, 4096][seed % 4], [8, 0, 2][seed % 3]  # a list or not; bisection by value, by key, both
    _filtered_against_torch(logits.to(torch.bfloat16), temperatures, top_k, top_p, min_p, capacity=capacity, value_rounds=value_rounds)


@needs_triton
def test_unfiltered_sampling_kernel_logprobs_match_float64_at_low_temperatures():
    # the kernel tempered the logits before subtracting the max: at T = 1e-4 logits of ~60 are ~6e5, whose
    # float32 spacing (1/16) put the logprob off by ~3e-2. Three chunks of 1024 (the near-top tokens in each,
    # so chunks whose maxima differ are merged), greedy rows (the argmax) and T = 1 among them
    from tandemrl.generation.engine.layers.sampler_kernel import sample_unfiltered

    torch.manual_seed(0)
    rows, vocab = 20, 3000
    temperatures = torch.tensor([1e-4, 1e-2, 0.3, 1.0, 0.0] * 4)
    logits = torch.randn(rows, vocab) * 3 + 50
    near_top = torch.tensor([3, 700, 1024, 1500, 2047, 2048, 2600, 2999])
    logits[:, near_top] = 60 + temperatures.clamp(min=1e-4)[:, None] * torch.randn(rows, 8) * 2
    keys = row_keys(torch.arange(rows) * 7919, torch.full((rows,), 130))
    sampling = SamplingTensors(temperatures, torch.full((rows,), vocab), torch.ones(rows), torch.zeros(rows), keys, False)
    expected_ids, _, _ = sample(logits, sampling)
    ids, logprobs = (t.cpu() for t in sample_unfiltered(logits.to(DEVICE), temperatures.to(DEVICE), keys.to(DEVICE), chunk=1024))
    assert ids.tolist() == expected_ids.tolist()
    exact = (logits.double() / temperatures.masked_fill(temperatures == 0, 1.0).double()[:, None]).log_softmax(-1)
    assert (logprobs.double() - exact.gather(-1, ids[:, None])[:, 0]).abs().max() < 1e-5


@needs_triton
def test_the_step_inputs_kernel_equals_the_torch_forms():
    from tandemrl.generation.engine.decode_state import LENS, POSITIONS, SEEDS, DecodeState
    from tandemrl.generation.engine.state_kernel import step_inputs

    torch.manual_seed(0)
    max_rows, width, block = 300, 40, 16
    state = DecodeState(max_rows, width, vocab_size=100, device=torch.device(DEVICE))
    state.ints[POSITIONS] = torch.randint(0, width * block, (max_rows,))
    state.ints[LENS] = state.ints[POSITIONS] + 1
    state.ints[SEEDS] = torch.cat([torch.tensor([0, 2**32 - 1, 2**31]), torch.randint(0, 2**32, (max_rows - 3,))])  # products past int64 wrap
    state.block_tables.copy_(torch.randint(0, 10**6, (max_rows, width), dtype=torch.int32))
    rows = max_rows - 3  # not a multiple of the kernel's tile
    slots, lens, keys = step_inputs(state.ints[POSITIONS, :rows], state.ints[LENS, :rows], state.ints[SEEDS, :rows], state.block_tables[:rows], block)
    meta = state.metadata(rows, block, gather=False)
    assert torch.equal(slots, meta.slot_mapping) and torch.equal(lens, meta.context_lens)
    assert torch.equal(keys, state.sampling(rows, needs_filter=False).keys)
    meta, sampling = state.step(rows, block, gather=False, needs_filter=False)  # the kernel on a GPU, the torch forms elsewhere
    assert torch.equal(meta.slot_mapping, slots) and torch.equal(sampling.keys, keys)


@needs_triton
def test_filtered_sampling_kernel_equals_the_torch_sampler_on_ulp_ties_and_exact_tie_masses():
    # rows where the torch sampler once differed from the kernel (the kernel was right): greedy rows over
    # logits an ulp apart (log_softmax rounded them into a tie, the argmax took the smaller), a temperature
    # (0.01, 100) that rounds logits an ulp apart into a tie (top-k 1 kept the lower index), and top-p 0.5
    # over 50 equal logits (25 hold exactly half the mass: softmax's float32 cumsum kept 26)
    vocab = 50
    low = torch.tensor(1.7)
    logits = torch.full((6, vocab), 0.5)
    logits[:2, 3], logits[:2, 9] = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)), 1.0
    logits[2:4, 3], logits[2:4, 9] = low, torch.nextafter(low, torch.tensor(2.0))
    logits[4:] = 0.25
    temperatures = torch.tensor([0.0, 0.0, 0.01, 100.0, 1.0, 0.3])
    top_k = torch.tensor([vocab, 5, 1, 1, vocab, vocab])
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5, 0.5])
    _filtered_against_torch(logits, temperatures, top_k, top_p, torch.zeros(6))
    ids, logprobs, _ = sample(logits, SamplingTensors(temperatures, top_k, top_p, torch.zeros(6), row_keys(torch.arange(6), torch.zeros(6, dtype=torch.int64)), True))
    assert ids[:4].tolist() == [9] * 4
    assert torch.allclose(logprobs[4:], torch.tensor(1 / 25).log())
