"""The engine's GPU path (Triton decode and paged prefill attention, fused sampler, CUDA graphs) against its CPU path."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.generation.engine.layers.attention import build_gather_metadata, gather_attention, flash_varlen_available
from tandemrl.generation.engine.layers.sampler import SamplingTensors, row_keys, sample
from tandemrl.generation.engine.models import weights_of
from tandemrl.types import SamplingParams

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
from tests.unit.generation.engine.conftest import FAMILIES  # every family README's table lists (windows of 6 tokens)


def run(coro):
    return asyncio.run(coro)


def _random_tables(lens: list[int], block: int, num_blocks: int) -> list[list[int]]:
    """Block tables for sequences of these lengths, from distinct blocks in random order (block 0 kept free)."""
    perm = torch.randperm(num_blocks - 1) + 1
    tables, at = [], 0
    for n in lens:
        count = -(-n // block)
        tables.append(perm[at : at + count].tolist())
        at += count
    return tables


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_gather_attention(dtype):
    from tandemrl.generation.engine.layers.attention_kernel import decode_attention

    torch.manual_seed(0)
    block, num_blocks, heads, kv_heads, dim = 16, 64, 14, 2, 64
    k_cache = torch.randn(num_blocks * block, kv_heads, dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    lens = [1, 17, 100, 300]
    tables = _random_tables(lens, block, num_blocks)
    q = torch.randn(len(lens), heads, dim, device="cuda", dtype=dtype)
    meta = build_gather_metadata([1] * len(lens), lens, tables, block, torch.device("cuda"))
    expected = gather_attention(q, k_cache, v_cache, meta).float()
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    got = decode_attention(q, k_cache, v_cache, bt, torch.tensor(lens, dtype=torch.int32, device="cuda"), block).float()
    error = (got - expected).norm() / expected.norm()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2)


@cuda
@pytest.mark.parametrize("heads, kv_heads, dim, window", [(14, 2, 64, 0), (12, 2, 128, 0), (28, 4, 128, 0), (8, 4, 128, 1000), (32, 32, 96, 0)])  # 96: Phi-3-mini, padded to 128
def test_split_kv_decode_matches_gather_attention_at_long_contexts(heads, kv_heads, dim, window):
    """bf16, contexts from one key to 9k over up to 8 chunks (the merge kernel), and the one-chunk path;
    a sliding window's keys chunked from its first."""
    from tandemrl.generation.engine.layers.attention import AttentionOptions
    from tandemrl.generation.engine.layers.attention_kernel import decode_attention

    torch.manual_seed(heads)
    block, lens = 16, [1, 100, 255, 257, 1000, 4097, 9000]
    num_blocks = sum(-(-n // block) for n in lens) + 1
    k_cache = torch.randn(num_blocks * block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = _random_tables(lens, block, num_blocks)
    q = torch.randn(len(lens), heads, dim, device="cuda", dtype=torch.bfloat16)
    options = AttentionOptions(scale=dim**-0.5, window=window)
    meta = build_gather_metadata([1] * len(lens), lens, tables, block, torch.device("cuda"))
    expected = gather_attention(q.float(), k_cache.float(), v_cache.float(), meta, options)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cuda")
    context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for splits in (None, 1, 3, 8):  # None: decode_splits' choice for these shapes
        got = decode_attention(q, k_cache, v_cache, bt, context_lens, block, options=options, splits=splits).float()
        for row in range(len(lens)):  # each row on its own: a short one's error is not hidden by the long ones
            error = (got[row] - expected[row]).norm() / expected[row].norm()
            assert error < 1e-2, (splits, lens[row], error.item())


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_filtered_sampler_kernel_matches_the_torch_sampler(dtype):
    from tandemrl.generation.engine.layers.sampler_kernel import sample_filtered

    torch.manual_seed(4)
    batch, vocab = 48, 151936
    logits = (torch.randn(batch, vocab, device="cuda") * 3).to(dtype)
    temperatures = torch.tensor([0.0, 1.0, 0.7, 1.3] * 12, device="cuda")
    top_k = torch.tensor([vocab, 50, 5, vocab, 1, vocab] * 8, device="cuda")
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.95, 1.0, 1.0, 0.3, 1.0] * 6, device="cuda")
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.0, 0.2] * 8, device="cuda")
    keys = row_keys(torch.arange(batch, device="cuda") * 7919, torch.full((batch,), 130, device="cuda"))
    sampling = SamplingTensors(temperatures=temperatures, top_k=top_k, top_p=top_p, min_p=min_p, keys=keys, needs_filter=True)
    expected_ids, expected_lp, expected_floors = sample(logits, sampling)
    got_ids, got_lp, floors = sample_filtered(logits, temperatures, top_k, top_p, min_p, keys)
    same = got_ids == expected_ids
    assert same.float().mean() > 0.95  # a near-tie at a threshold or between scores may flip on the last bit
    assert torch.allclose(got_lp[same], expected_lp[same], atol=1e-4)
    assert torch.equal(floors.isinf(), expected_floors.isinf())
    assert torch.allclose(floors[same], expected_floors[same], atol=1e-4)


@cuda
def test_filtered_sampler_floors_of_top_p_alone_on_flat_logits():
    """Top-p 0.9 alone at temperature 1 on flat bf16 logits (a random model's): the threshold falls among
    hundreds of tied logits, and the floor must be the torch sampler's (the case the test above has no row of).
    The search misses its first rounds here, then searches its list: the GPU build once lost the list's base
    between rounds (sampler_kernel._search) and failed this in 98-100% of rows."""
    from tandemrl.generation.engine.layers.sampler_kernel import sample_filtered

    torch.manual_seed(5)
    batch, vocab = 64, 151936
    logits = (torch.randn(batch, vocab, device="cuda") * 0.5).to(torch.bfloat16)
    ones = torch.ones(batch, device="cuda")
    top_k, top_p, min_p = torch.full((batch,), vocab, device="cuda"), torch.full((batch,), 0.9, device="cuda"), torch.zeros(batch, device="cuda")
    keys = row_keys(torch.arange(batch, device="cuda"), torch.full((batch,), 5, device="cuda"))
    sampling = SamplingTensors(temperatures=ones, top_k=top_k, top_p=top_p, min_p=min_p, keys=keys, needs_filter=True)
    _, _, expected_floors = sample(logits, sampling)
    _, _, floors = sample_filtered(logits, ones, top_k, top_p, min_p, keys)
    assert torch.isclose(floors, expected_floors, atol=1e-4).float().mean() > 0.95


@cuda
@pytest.mark.parametrize(
    "query_lens, context_lens",
    [
        ([100, 1, 37, 300, 16], [100, 128, 80, 300, 17]),  # whole prompts, and cached prefixes longer than what is computed
        ([1, 1, 1], [40, 129, 7]),  # one query each: flash attention's GQA path for single queries
    ],
)
def test_varlen_prefill_matches_gather_attention(query_lens, context_lens):
    from tandemrl.generation.engine.layers.attention import build_varlen_metadata, varlen_attention

    if not flash_varlen_available():
        pytest.skip(f"torch {torch.__version__} has no flash attention: the engine prefills on the gather path")
    torch.manual_seed(3)
    block, num_blocks, heads, kv_heads, dim = 16, 128, 14, 2, 64  # 7 query heads per key/value head, read unrepeated
    k_cache = torch.randn(num_blocks * block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = _random_tables(context_lens, block, num_blocks)
    q = torch.randn(sum(query_lens), heads, dim, device="cuda", dtype=torch.bfloat16)
    gather = build_gather_metadata(query_lens, context_lens, tables, block, torch.device("cuda"))
    varlen = build_varlen_metadata(query_lens, context_lens, tables, block, torch.device("cuda"))
    expected = gather_attention(q, k_cache, v_cache, gather).float()
    got = varlen_attention(q, k_cache, v_cache, varlen).float()
    error = (got - expected).norm() / expected.norm()
    assert error < 1e-2, error


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads, kv_heads, dim, query_lens, context_lens",
    [
        (14, 2, 64, [100, 1, 37, 300, 16], [100, 128, 80, 300, 17]),  # whole prompts, and cached prefixes longer than what is computed
        (14, 2, 64, [1, 1, 1], [40, 129, 7]),  # one query each
        (12, 2, 128, [64] * 40 + [700], [400] * 40 + [1500]),  # the 1.5B shape's heads; many next turns and one long prompt
        (4, 4, 32, [50, 3], [90, 3]),  # no GQA: 128 queries a tile
        (8, 8, 96, [70, 1], [70, 200]),  # Phi-3-mini's head dim, no power of two: padded and masked
    ],
)
def test_paged_prefill_kernel_matches_gather_attention(dtype, heads, kv_heads, dim, query_lens, context_lens):
    from tandemrl.generation.engine.layers.attention import build_paged_prefill_metadata, prefill_tile_queries
    from tandemrl.generation.engine.layers.attention_kernel import prefill_attention

    torch.manual_seed(4)
    block = 16
    num_blocks = sum(-(-n // block) for n in context_lens) + 8
    k_cache = torch.randn(num_blocks * block, kv_heads, dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = _random_tables(context_lens, block, num_blocks)
    q = torch.randn(sum(query_lens), heads, dim, device="cuda", dtype=dtype)
    gather = build_gather_metadata(query_lens, context_lens, tables, block, torch.device("cuda"))
    paged = build_paged_prefill_metadata(query_lens, context_lens, tables, block, torch.device("cuda"), tile_queries=prefill_tile_queries(heads, kv_heads))
    expected = gather_attention(q.double(), k_cache.double(), v_cache.double(), gather)
    got = prefill_attention(q, k_cache, v_cache, paged)
    assert not got.isnan().any()
    error = (got.double() - expected).norm() / expected.norm()
    assert error < (1e-5 if dtype == torch.float32 else 1e-2), error


@cuda
@pytest.mark.parametrize("attention", ["paged", "flash"])
def test_bfloat16_engine_gives_the_same_tokens_on_the_prefill_paths_as_the_gather_path(tmp_path, attention):
    from tandemrl.tasks.tiny import save_tiny

    if attention == "flash" and not flash_varlen_available():
        pytest.skip(f"torch {torch.__version__} has no flash attention")
    model_dir = save_tiny(str(tmp_path), seed=2)
    # four prompts of their own, and a group of four sharing one (prefilled once: the others compute less);
    # then a second turn of each over its cached first (the paged kernel reads the cached prefix in place)
    prompts = [list(range(3 + i, 40 + 5 * i)) for i in range(4)] + [[7, 8, 9, 10] * 10] * 4
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = {}
    for varlen in (True, False):
        engine = Engine(EngineConfig(model=model_dir, device="cuda", gpu_memory_utilization=0.2, max_num_seqs=64, max_model_len=256))
        engine.runner.varlen_prefill, engine.runner.paged_prefill = varlen, attention == "paged"

        async def two_turns(engine=engine):
            first = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            second = await asyncio.gather(*(engine.generate(p + c.token_ids + [11, 12, 13], params) for p, c in zip(prompts, first)))
            return first + second

        outputs[varlen] = run(two_turns())
        assert engine.stats()["engine/num_prefix_hit_tokens"] > 0
        run(engine.close())
    matches = sum(a.token_ids == b.token_ids for a, b in zip(outputs[True], outputs[False]))
    assert matches >= 2 * len(prompts) - 2  # bfloat16: a near-tie may flip one
    for a, b in zip(outputs[True], outputs[False]):
        assert abs(a.logprobs[0] - b.logprobs[0]) < 5e-2


@cuda
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_paged_prefill_of_each_family_gives_the_gather_paths_tokens(tmp_path, family):
    """The paged prefill kernel with each family's windows, scales and soft caps (and the fused norm and RoPE
    kernels in 16-bit, graphs on) against the gather path, over a first turn and a second over its cache."""
    from tandemrl.tasks.tiny import save_tiny

    model_dir = save_tiny(str(tmp_path), seed=2, **FAMILIES[family])
    prompts = [list(range(3 + i, 40 + 5 * i)) for i in range(4)] + [[7, 8, 9, 10] * 10] * 2
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = {}
    for paged in (True, False):
        engine = Engine(EngineConfig(model=model_dir, device="cuda", gpu_memory_utilization=0.2, max_num_seqs=64, max_model_len=256))
        engine.runner.varlen_prefill = engine.runner.paged_prefill = paged

        async def two_turns(engine=engine):
            first = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            second = await asyncio.gather(*(engine.generate(p + c.token_ids + [11, 12, 13], params) for p, c in zip(prompts, first)))
            return first + second

        outputs[paged] = run(two_turns())
        run(engine.close())
    matches = sum(a.token_ids == b.token_ids for a, b in zip(outputs[True], outputs[False]))
    assert matches >= 2 * len(prompts) - 2  # bfloat16: a near-tie may flip one
    for a, b in zip(outputs[True], outputs[False]):
        assert abs(a.logprobs[0] - b.logprobs[0]) < 5e-2


@cuda
def test_bfloat16_overlapped_prefills_give_the_tokens_of_serial_ones(tmp_path):
    """Prefill steps launched while the last one runs (inputs in one pinned copy each) compute what serial
    ones do: the same tokens over two turns, the second's prompts extending the first's conversations."""
    from tandemrl.tasks.tiny import save_tiny

    model_dir = save_tiny(str(tmp_path), seed=3)
    prompts = [list(range(3 + i, 70 + 3 * i)) for i in range(12)]  # ~3 a prefill step (256 tokens)
    outputs, ahead = {}, {}
    for overlap in (True, False):
        engine = Engine(EngineConfig(model=model_dir, device="cuda", gpu_memory_utilization=0.2, max_num_seqs=64, max_model_len=256,
                                     max_num_batched_tokens=256, overlap_prefills=overlap))  # fmt: skip

        async def two_turns(engine=engine):
            params = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(prompts))]
            first = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))
            turns = [p + c.token_ids + [9, 10, 11] for p, c in zip(prompts, first)]
            return first + list(await asyncio.gather(*(engine.generate(t, s) for t, s in zip(turns, params))))

        outputs[overlap] = [(c.token_ids, c.logprobs) for c in run(two_turns())]
        ahead[overlap] = engine.stats()["engine/num_ahead_steps"]
        run(engine.close())
    assert outputs[True] == outputs[False]
    assert ahead[True] > ahead[False]  # prefills were launched ahead


@cuda
def test_fused_sampler_matches_the_torch_sampler():
    from tandemrl.generation.engine.layers.sampler_kernel import sample_unfiltered

    torch.manual_seed(1)
    batch, vocab = 64, 151936
    logits = torch.randn(batch, vocab, device="cuda") * 3
    temperatures = torch.tensor([0.0, 1.0, 0.7, 1.3] * 16, device="cuda")
    keys = row_keys(torch.arange(batch, device="cuda") * 7919, torch.full((batch,), 130, device="cuda"))
    sampling = SamplingTensors(
        temperatures=temperatures,
        top_k=torch.full((batch,), vocab, device="cuda"),
        top_p=torch.ones(batch, device="cuda"),
        min_p=torch.zeros(batch, device="cuda"),
        keys=keys,
        needs_filter=False,
    )
    expected_ids, expected_lp, _ = sample(logits, sampling)
    got_ids, got_lp = sample_unfiltered(logits, temperatures, keys)
    assert (got_ids == expected_ids).float().mean() > 0.98  # near-ties may flip on last-bit differences
    same = got_ids == expected_ids
    assert torch.allclose(got_lp[same], expected_lp[same], atol=1e-4)


@cuda
def test_sampler_kernels_logprobs_match_float64_at_low_temperatures():
    # logits near 60 at T = 1e-4 are ~6e5 tempered: the unfiltered kernel tempered before subtracting the
    # max and was 3e-2 off there (tests/unit/generation/engine/test_split_decode.py checks it in the interpreter)
    from tandemrl.generation.engine.layers.sampler_kernel import sample_filtered, sample_unfiltered

    torch.manual_seed(6)
    batch, vocab, top_k = 48, 151936, 50
    temperatures = torch.tensor([1e-4, 1e-2, 0.3] * 16)
    logits = torch.randn(batch, vocab) * 3 + 50
    logits.scatter_(1, torch.randint(vocab, (batch, 8)), 60 + temperatures[:, None] * torch.randn(batch, 8) * 2)  # none certain
    keys = row_keys(torch.arange(batch) * 7919, torch.full((batch,), 130))
    exact = logits.double() / temperatures.double()[:, None]
    dropped = exact.sort(dim=-1, descending=True, stable=True).indices[:, top_k:]  # top-k keeps the first of ties
    cuda_ = [t.cuda() for t in (logits, temperatures, torch.full((batch,), top_k), torch.ones(batch), torch.zeros(batch), keys)]
    ids, logprobs = sample_unfiltered(cuda_[0], cuda_[1], cuda_[5])
    assert (logprobs.cpu().double() - exact.log_softmax(-1).gather(-1, ids.cpu()[:, None])[:, 0]).abs().max() < 1e-5
    ids, logprobs, _ = sample_filtered(*cuda_)
    kept = exact.scatter(-1, dropped, float("-inf")).log_softmax(-1)
    assert (logprobs.cpu().double() - kept.gather(-1, ids.cpu()[:, None])[:, 0]).abs().max() < 1e-5


@cuda
@pytest.mark.parametrize("fast", [True, False])
def test_kernel_gumbel_noise_is_within_1e_5_of_float64_for_every_uniform(fast):
    from tests.gpu.noise_kernel import noise_kernel

    prefixes = torch.arange(2**23, dtype=torch.int64, device="cuda")  # every 23-bit uniform the hash can give
    noise = torch.empty(len(prefixes), dtype=torch.float32, device="cuda")
    noise_kernel[(len(prefixes) // 1024,)](prefixes << 9 | 0x1FF, noise, len(prefixes), FAST=fast, BLOCK=1024)
    exact = -torch.log(-torch.log((prefixes.double() + 0.5) / 2**23))
    assert torch.isfinite(noise).all()
    assert (noise.double() - exact).abs().max() < 1e-5


@cuda
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_engine_matches_cpu_engine(tmp_path, family):
    from tandemrl.tasks.tiny import save_tiny

    model_dir = save_tiny(str(tmp_path), seed=1, **FAMILIES[family])
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(5)] + [[7, 8, 9]] * 4
    # top-k rows and penalised rows make the graph's plain samples be redrawn (runner._decode); a penalised
    # row's context includes the look-ahead step's input, which the host has not read yet
    params = [
        SamplingParams(
            max_tokens=24, temperature=0.0 if i % 3 == 0 else 1.0, top_k=20 if i % 3 == 1 else -1, seed=i, ignore_eos=True,
            repetition_penalty=1.3 if i % 2 else 1.0,
        )
        for i in range(len(prompts))
    ]
    outputs = {}
    for device in ("cpu", "cuda"):
        engine = Engine(EngineConfig(model=model_dir, device=device, dtype="float32", gpu_memory_utilization=0.2, max_num_seqs=32, max_model_len=256))

        async def all_requests(engine=engine):
            return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))

        outputs[device] = run(all_requests())
        run(engine.close())
    cpu, gpu = outputs["cpu"], outputs["cuda"]
    matches = sum(a.token_ids == b.token_ids for a, b in zip(cpu, gpu))
    assert matches >= len(prompts) - 1
    for a, b in zip(cpu, gpu):
        if a.token_ids == b.token_ids:
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-3


@cuda
def test_bfloat16_graphs_sleep_and_wake(tmp_path):
    from tandemrl.tasks.tiny import save_tiny

    model_dir = save_tiny(str(tmp_path), seed=2)
    engine = Engine(EngineConfig(model=model_dir, device="cuda", gpu_memory_utilization=0.2, max_num_seqs=64, max_model_len=256))
    assert engine.runner.graphs
    assert engine.runner.varlen_prefill and engine.runner.paged_prefill  # bfloat16 prefills through the paged kernel
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    before = run(engine.generate([5, 6, 7, 8], params))
    run(engine.sleep(2))
    assert all(p.untyped_storage().nbytes() == 0 for p in engine.model.parameters())
    run(engine.wake())
    run(engine.update_weights(weights_of(model_dir), version=0))  # level 2 kept no copy: the weights come back by update
    assert engine.runner.graphs
    assert run(engine.generate([5, 6, 7, 8], params)).token_ids == before.token_ids
    run(engine.close())


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_rope_cache_and_silu_match_the_torch_path(dtype):
    from tandemrl.generation.engine.layers.rope import apply_rope
    from tandemrl.generation.engine.models.llama import RMSNorm
    from tandemrl.generation.engine.layers.activation import silu_mul
    from tandemrl.generation.engine.layers.norm import rms_norm
    from tandemrl.generation.engine.layers.rope_kernel import rope_and_cache_

    torch.manual_seed(2)
    norm = RMSNorm(896, 1e-6).cuda().to(dtype)
    norm.weight.data.normal_()
    x, residual = torch.randn(37, 896, device="cuda", dtype=dtype), torch.randn(37, 896, device="cuda", dtype=dtype)
    out, summed = rms_norm(x, norm.weight, 1e-6, residual)
    assert torch.equal(summed, x + residual)
    assert torch.allclose(out.float(), norm._norm(x + residual).float(), atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    heads, kv_heads, dim, slots = 6, 2, 64, 100
    qkv = torch.randn(37, (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype)
    positions = torch.randint(0, 500, (37,), device="cuda")
    slot_mapping = torch.randperm(slots, device="cuda")[:37]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.arange(512).float()[:, None] * inv_freq
    emb = torch.cat((emb, emb), -1)
    table = torch.stack((emb.cos(), emb.sin()), 1).cuda()
    cos_sin = table[positions].to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    expected_q = apply_rope(q.view(37, heads, dim), cos_sin[:, :1], cos_sin[:, 1:])
    expected_k = apply_rope(k.view(37, kv_heads, dim), cos_sin[:, :1], cos_sin[:, 1:])
    got, cache = qkv.clone(), torch.zeros(2, slots, kv_heads, dim, device="cuda", dtype=dtype)
    rope_and_cache_(got, heads, kv_heads, dim, positions, table, slot_mapping, cache[0], cache[1])
    for expected, written in ((expected_q, got[:, : heads * dim].view(37, heads, dim)), (expected_k, cache[0][slot_mapping])):
        error = (written.float() - expected.float()).norm() / expected.float().norm()
        assert error < (1e-2 if dtype == torch.bfloat16 else 1e-6), error
    assert torch.equal(cache[1][slot_mapping], v.view(37, kv_heads, dim))
    untouched = torch.ones(slots, dtype=torch.bool, device="cuda")
    untouched[slot_mapping] = False
    assert not cache[:, untouched].any()
    assert torch.equal(got[:, (heads + kv_heads) * dim :], qkv[:, (heads + kv_heads) * dim :])
    gate_up = torch.randn(37, 2 * 1500, device="cuda", dtype=dtype) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(silu_mul(gate_up).float(), (F.silu(gate) * up).float(), atol=1e-5, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    from tandemrl.generation.engine.layers.activation import gated

    expected = (F.gelu(gate, approximate="tanh") * up).float()  # Gemma 2/3's MLP
    assert torch.allclose(gated(gate_up, "gelu_tanh").float(), expected, atol=1e-5, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_final_softcap_kernel_equals_torch_bit_for_bit(dtype):
    # Gemma 2's final logit soft-cap (cap 30) in one pass: the same bits as torch's three ops, over logits from
    # far under to far over the cap, a vocab that is no multiple of the kernel's block, and both 16-bit types
    from tandemrl.generation.engine.layers.activation import softcap_

    torch.manual_seed(0)
    logits = (torch.randn(37, 256000 + 5, device="cuda") * torch.logspace(-3, 2.5, 37, device="cuda")[:, None]).to(dtype)
    logits[0, :4] = torch.tensor([0.0, -0.0, 1e4, -1e4])
    expected = torch.tanh(logits / 30.0) * 30.0
    got = softcap_(logits.clone(), 30.0)
    assert torch.equal(got, expected), (got != expected).sum().item()


@cuda
def test_prefill_graph_replays_give_the_eager_prefills_tokens_bitwise(tmp_path):
    """The same requests three times from an empty prefix cache: the first prefill of a row count runs
    eagerly, the second eagerly then captures, the third replays; every round's tokens and logprobs are
    the first's, bit for bit, and equal an engine without prefill graphs' (bfloat16: near-ties aside).
    A second turn over the cached first, and a sleep and wake (graphs dropped, captured again), too."""
    from tandemrl.tasks.tiny import save_tiny

    model_dir = save_tiny(str(tmp_path), seed=5)
    prompts = [list(range(3 + i, 50 + 7 * i)) for i in range(6)] + [[7, 8, 9, 10] * 12] * 3
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True) for i in range(len(prompts))]

    async def two_turns(engine):
        await engine.update_weights([], version=engine.version)  # an empty prefix cache
        first = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))
        second = await asyncio.gather(*(engine.generate(p + c.token_ids + [11, 12], s) for p, c, s in zip(prompts, first, params)))
        return [(c.token_ids, c.logprobs) for c in first + second]

    rounds = {}
    for graphed in (True, False):
        engine = Engine(EngineConfig(model=model_dir, device="cuda", gpu_memory_utilization=0.2, max_num_seqs=64, max_model_len=256))
        engine.runner.graph_prefills = graphed
        if not graphed:
            engine.runner.prefill_graphs = None
        rounds[graphed] = [run(two_turns(engine)) for _ in range(3)]
        if graphed:
            graphs = engine.runner.prefill_graphs
            assert graphs.graphs and not graphs.refused
            run(engine.sleep(1))
            run(engine.wake())
            assert not engine.runner.prefill_graphs.graphs  # dropped with the cache
            rounds[graphed] += [run(two_turns(engine)) for _ in range(3)]
            assert engine.runner.prefill_graphs.graphs
        run(engine.close())
    first = rounds[True][0]
    assert all(r == first for r in rounds[True])  # eager, capture and replay: the same numbers
    matches = sum(a[0] == b[0] for a, b in zip(first, rounds[False][0]))
    assert matches >= len(first) - 2


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_family_kernel_options_match_the_torch_path(dtype):
    """Partial rotary in the fused RoPE kernel, Gemma's and OLMo 2's norm orders, and windows, score scales and
    soft caps in both attention kernels (tiles where later rows' windows start past the first key tile)."""
    from tandemrl.generation.engine.layers.attention import AttentionOptions, build_paged_prefill_metadata, decode_gather_metadata
    from tandemrl.generation.engine.layers.attention_kernel import decode_attention, prefill_attention
    from tandemrl.generation.engine.layers.norm import rms_norm
    from tandemrl.generation.engine.layers.rope import apply_rope
    from tandemrl.generation.engine.layers.rope_kernel import rope_and_cache_
    from tandemrl.generation.engine.models.llama import RMSNorm

    torch.manual_seed(3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    heads, kv_heads, dim, rotary, slots, n = 8, 2, 128, 96, 200, 37  # Phi-4-mini's head: 3/4 rotary
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, device="cuda", dtype=dtype)
    positions, slot_mapping = torch.randint(0, 500, (n,), device="cuda"), torch.randperm(slots, device="cuda")[:n]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
    emb = torch.arange(512).float()[:, None] * inv_freq
    table = (torch.stack((torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()), 1) * 1.1).cuda()  # [P, 2, R]
    cos_sin = table[positions].to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    got, cache = qkv.clone(), torch.zeros(2, slots, kv_heads, dim, device="cuda", dtype=dtype)
    rope_and_cache_(got, heads, kv_heads, dim, positions, table, slot_mapping, cache[0], cache[1])
    expected_k = apply_rope(k.view(n, kv_heads, dim), cos_sin[:, :1], cos_sin[:, 1:])
    assert (cache[0][slot_mapping].float() - expected_k.float()).abs().max() < tol * 10
    assert torch.equal(cache[1][slot_mapping], v.view(n, kv_heads, dim))
    for offset, in_float32 in ((1.0, True), (0.0, True)):
        norm = RMSNorm(896, 1e-6, offset=offset, in_float32=in_float32).cuda().to(dtype)
        norm.weight.data.normal_()
        x, residual = torch.randn(37, 896, device="cuda", dtype=dtype), torch.randn(37, 896, device="cuda", dtype=dtype)
        out, _ = rms_norm(x, norm.weight, 1e-6, residual, offset=offset, in_float32=in_float32)
        assert (out.float() - norm._norm(x + residual).float()).abs().max() < tol * 10
    block, heads, kv_heads, dim = 16, 8, 2, 64
    lens, qlens = [100, 37, 300, 5], [100, 5, 1, 5]
    tables = _random_tables(lens, block, 64)
    k_cache = torch.randn(64 * block, kv_heads, dim, device="cuda", dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    for options in (AttentionOptions(scale=0.1, window=20), AttentionOptions(scale=0.0625, window=33, softcap=50.0), AttentionOptions(scale=0.2, softcap=3.0)):
        q = torch.randn(sum(qlens), heads, dim, device="cuda", dtype=dtype)
        expected = gather_attention(q, k_cache, v_cache, build_gather_metadata(qlens, lens, tables, block, torch.device("cuda")), options)
        meta = build_paged_prefill_metadata(qlens, lens, tables, block, torch.device("cuda"), tile_queries=16)
        assert (prefill_attention(q, k_cache, v_cache, meta, options=options).float() - expected.float()).abs().max() < tol * 10, options
        bt = torch.tensor([t + [0] * (max(map(len, tables)) - len(t)) for t in tables], device="cuda", dtype=torch.int32)
        cl = torch.tensor(lens, device="cuda", dtype=torch.int32)
        qd = torch.randn(len(lens), heads, dim, device="cuda", dtype=dtype)
        expected = gather_attention(qd, k_cache, v_cache, decode_gather_metadata(bt, cl, torch.zeros(len(lens), dtype=torch.int64, device="cuda"), block), options)
        assert (decode_attention(qd, k_cache, v_cache, bt, cl, block, options=options).float() - expected.float()).abs().max() < tol * 10, options


@cuda
@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "gemma2"])
def test_fused_norms_give_the_unfused_engines_tokens(tmp_path, family, monkeypatch):
    """models/llama.py's FUSED_NORMS (each q/k head's norm inside the RoPE kernel; Gemma's two norms around
    attention's output in one kernel) against the engine without it, bf16 under CUDA graphs: the same
    greedy tokens but for near-ties, logprobs within bf16's rounding."""
    from tandemrl.generation.engine.models import llama
    from tandemrl.tasks.tiny import save_tiny

    model_dir = save_tiny(str(tmp_path), seed=2, **FAMILIES[family])
    prompts = [list(range(3 + i, 30 + 3 * i)) for i in range(6)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    outputs = {}
    for fused in (False, True):
        monkeypatch.setattr(llama, "FUSED_NORMS", fused)
        engine = Engine(EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2, max_num_seqs=32, max_model_len=256))

        async def all_requests(engine=engine):
            return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))

        outputs[fused] = run(all_requests())
        run(engine.close())
    matches = sum(a.token_ids == b.token_ids for a, b in zip(outputs[False], outputs[True]))
    assert matches >= len(prompts) - 1
    for a, b in zip(outputs[False], outputs[True]):
        if a.token_ids == b.token_ids:
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 5e-2


@cuda
def test_filtered_decode_graphs_give_the_plain_graphs_tokens(tmp_path):
    """--decode_graphs filtered (the filtered sampler inside the decode graphs) against plain (a plain draw in
    the graph, the filtered one after it): the same tokens, logprobs and floors, bit for bit, for a batch of
    filtered, unfiltered, greedy and penalised rows (the penalised still redrawn outside the graph); and a
    batch that filters nothing gets the plain graphs' tokens and no floors from the filtered graphs."""
    from tandemrl.tasks.tiny import save_tiny

    model_dir = save_tiny(str(tmp_path), seed=3)
    prompts = [list(range(3 + i, 25 + 2 * i)) for i in range(8)]
    mixed = [
        SamplingParams(
            max_tokens=20, temperature=0.0 if i == 0 else 1.0, top_p=0.9 if i % 2 else 1.0, top_k=20 if i % 3 == 1 else -1, min_p=0.05 if i == 4 else 0.0,
            repetition_penalty=1.3 if i == 6 else 1.0, seed=i, ignore_eos=True,
        )
        for i in range(len(prompts))
    ]  # fmt: skip
    plain = [SamplingParams(max_tokens=20, temperature=0.0 if i == 0 else 1.0, seed=i, ignore_eos=True) for i in range(len(prompts))]
    outputs = {}
    for graphs in ("plain", "filtered"):
        config = EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2, max_num_seqs=32, max_model_len=128, decode_graphs=graphs)
        engine = Engine(config)
        assert engine.runner.filtered_graphs == (graphs == "filtered") and engine.runner.graphs

        async def all_requests(engine=engine, params=None):
            return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))

        outputs[graphs] = [[(c.token_ids, c.logprobs, c.logit_floors) for c in run(all_requests(params=params))] for params in (mixed, plain)]
        run(engine.close())
    assert outputs["filtered"][0] == outputs["plain"][0]
    for (ids, logprobs, floors), (plain_ids, plain_logprobs, plain_floors) in zip(outputs["filtered"][1], outputs["plain"][1]):
        assert ids == plain_ids and floors is None and plain_floors is None
        assert max(abs(a - b) for a, b in zip(logprobs, plain_logprobs)) < 1e-4  # two kernels' log-sum-exp
