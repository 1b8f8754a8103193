"""Attention metadata: the varlen path's packed metadata and the paged prefill's tiles describe the same
attention as the gather path's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import pytest

from tandemrl.generation.engine.layers.attention import (
    build_gather_metadata, build_paged_prefill_metadata, build_varlen_metadata, gather_attention, prefill_tile_queries,
)  # fmt: skip

# (query_lens, context_lens): whole prompts, a cached prefix (the queries are the last of the context), one query
CASES = [([2, 1], [2, 3]), ([5, 1, 7, 3], [5, 9, 7, 12])]


def _tables(context_lens: list[int], block: int) -> list[list[int]]:
    tables, next_block = [], 1
    for n in context_lens:
        count = -(-n // block) + 1  # one spare block, as a running sequence may hold
        tables.append(list(range(next_block, next_block + count))[::-1])  # blocks out of order
        next_block += count
    return tables


def test_the_docstring_example():
    meta = build_varlen_metadata([2, 1], [2, 3], [[5], [7, 8]], 2, torch.device("cpu"))
    assert meta.packed_key_slots.tolist() == [10, 11, 14, 15, 16]
    assert meta.cu_seq_k.tolist() == [0, 2, 5] and meta.cu_seq_q.tolist() == [0, 2, 3]
    assert meta.slot_mapping.tolist() == [10, 11, 16]
    assert (meta.max_q, meta.max_k) == (2, 3)


def test_varlen_metadata_means_the_same_attention_as_gather():
    torch.manual_seed(0)
    block, heads, kv_heads, dim = 4, 4, 2, 8
    for query_lens, context_lens in CASES:
        tables = _tables(context_lens, block)
        gather = build_gather_metadata(query_lens, context_lens, tables, block, torch.device("cpu"))
        varlen = build_varlen_metadata(query_lens, context_lens, tables, block, torch.device("cpu"))
        assert varlen.slot_mapping.tolist() == gather.slot_mapping.tolist()
        slots = 4 * sum(len(t) for t in tables) + 8
        k_cache, v_cache = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
        q = torch.randn(sum(query_lens), heads, dim)
        expected = gather_attention(q, k_cache, v_cache, gather)
        # what varlen_attn computes: per sequence, causal aligned to the bottom right, GQA
        got = []
        for b in range(len(query_lens)):
            qs = q[varlen.cu_seq_q[b] : varlen.cu_seq_q[b + 1]].transpose(0, 1)  # [H, Q, D]
            ctx = varlen.packed_key_slots[varlen.cu_seq_k[b] : varlen.cu_seq_k[b + 1]]
            ks = k_cache[ctx].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)  # [H, C, D]
            vs = v_cache[ctx].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
            n_q, n_c = qs.shape[1], ks.shape[1]
            mask = torch.arange(n_c)[None, :] <= torch.arange(n_q)[:, None] + (n_c - n_q)
            got.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
        assert torch.allclose(torch.cat(got), expected, atol=1e-5)


def _reference_varlen_attention(q, k_cache, v_cache, meta, options=None):
    """What flash attention's varlen form computes (bottom-right causal, GQA), per sequence, on any device;
    rows of q past the last sequence's (the runner's padding) come out as NaN, as flash leaves them unwritten:
    a padded row that reached a real one would show."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = []
    for b in range(len(meta.cu_seq_q) - 1):
        qs = q[meta.cu_seq_q[b] : meta.cu_seq_q[b + 1]].transpose(0, 1)  # [H, Q, D]
        ctx = meta.packed_key_slots[meta.cu_seq_k[b] : meta.cu_seq_k[b + 1]]
        ks = k_cache[ctx].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)  # [H, C, D]
        vs = v_cache[ctx].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        mask = torch.arange(ks.shape[1])[None, :] <= torch.arange(qs.shape[1])[:, None] + (ks.shape[1] - qs.shape[1])
        out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1))
    out = torch.cat(out)
    return torch.cat((out, out.new_full((len(q) - len(out), *out.shape[1:]), float("nan"))))


def _reference_paged_prefill_attention(q, k_cache, v_cache, meta, options=None):
    """What the paged prefill kernel computes, tile by tile as its grid does (each tile's queries of one
    sequence read their context through its block table): rows no tile covers stay NaN, so a query the
    tiles miss, or a padded row that reached a real one, would show."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = q.new_full(q.shape, float("nan"))
    if meta.num_queries is None:  # a prefill graph's: padded rows (past the last query) come out as zeros
        out[int(meta.cu_seq_q[-1]) :] = 0
    for b, first in zip(meta.tile_seqs.tolist(), meta.tile_starts.tolist()):
        if b >= len(meta.context_lens):
            continue
        start, end, ctx = int(meta.cu_seq_q[b]), int(meta.cu_seq_q[b + 1]), int(meta.context_lens[b])
        rows = torch.arange(start + first, min(start + first + meta.tile_queries, end))
        assert out[rows].isnan().all(), "two tiles compute one query, or a tile a padded row"
        positions = torch.arange(ctx)
        slots = meta.block_tables[b, positions // meta.block_size] * meta.block_size + positions % meta.block_size
        ks = k_cache[slots].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)  # [H, C, D]
        vs = v_cache[slots].repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        query_positions = ctx - (end - start) + (rows - start)
        mask = positions[None, :] <= query_positions[:, None]
        if options is not None and options.window:
            mask &= positions[None, :] > query_positions[:, None] - options.window
        scale = options.scale if options is not None else None
        out[rows] = F.scaled_dot_product_attention(q[rows].transpose(0, 1), ks, vs, attn_mask=mask, scale=scale).transpose(0, 1)
    return out


def test_paged_prefill_tiles_cover_every_query_once_and_mean_the_gather_attention():
    torch.manual_seed(1)
    block, dim = 4, 8
    for heads, kv_heads in ((4, 2), (14, 2), (4, 4)):
        for query_lens, context_lens in CASES + [([40, 3, 17], [45, 3, 60])]:
            tables = _tables(context_lens, block)
            gather = build_gather_metadata(query_lens, context_lens, tables, block, torch.device("cpu"))
            paged = build_paged_prefill_metadata(query_lens, context_lens, tables, block, torch.device("cpu"), tile_queries=prefill_tile_queries(heads, kv_heads))
            assert paged.slot_mapping.tolist() == gather.slot_mapping.tolist()
            slots = 4 * sum(len(t) for t in tables) + 8
            k_cache, v_cache = torch.randn(slots, kv_heads, dim), torch.randn(slots, kv_heads, dim)
            q = torch.randn(sum(query_lens), heads, dim)
            got = _reference_paged_prefill_attention(q, k_cache, v_cache, paged)
            assert torch.allclose(got, gather_attention(q, k_cache, v_cache, gather), atol=1e-5)


def test_paged_prefill_metadata_is_the_docstring_example():
    meta = build_paged_prefill_metadata([20, 3], [20, 7], [[1, 2, 3, 4, 5], [6, 7]], 4, torch.device("cpu"), tile_queries=16)
    real = [(b, s) for b, s in zip(meta.tile_seqs.tolist(), meta.tile_starts.tolist()) if b < 2]
    assert real == [(0, 0), (0, 16), (1, 0)] and len(meta.tile_seqs) == 4
    assert [prefill_tile_queries(h, k) for h, k in ((14, 2), (12, 2), (32, 8), (4, 4), (64, 2))] == [16, 16, 32, 128, 16]
    assert prefill_tile_queries(8, 4, 256) == 32 and prefill_tile_queries(8, 4, 128) == 64
    from tandemrl.generation.engine.layers.attention import prefill_tiles

    seqs, firsts = prefill_tiles(torch.tensor([20, 0, 3]), 23, 16)  # a sequence without queries has no tile
    assert seqs.tolist() == [0, 0, 2, 3, 3] and firsts.tolist()[:3] == [0, 16, 0]


@pytest.mark.parametrize("paged", ["graphed", True, False, "window"], ids=["graphed", "paged", "flash", "paged-window"])
def test_the_runner_builds_prefill_metadata_on_the_device_as_the_gather_path_means(monkeypatch, tmp_path, paged):
    """The 16-bit GPU prefill's inputs (lengths and block tables; positions, slots and the paged kernel's
    tiles computed from them where the model runs) give the tokens of the gather path: two turns, the second
    over the first's cached blocks, and a group sharing one prompt (followers). On CPU, with a reference
    attention in place of the Triton kernel (paged) or of flash. `graphed`: the prefill graphs' forward
    (static buffers sized for every sequence, metadata at fixed shapes; run eagerly, captures skipped).
    `window`: a Mistral with a sliding window of 8 (the prompts are longer), through the paged path."""
    import asyncio

    from tandemrl.generation.base import EngineConfig
    from tandemrl.generation.engine import Engine
    from tandemrl.generation.engine.layers import attention
    from tandemrl.generation.engine.prefill_graphs import PrefillGraphs
    from tandemrl.generation.engine.runner import padded_num_tokens
    from tandemrl.tasks.tiny import save_tiny
    from tandemrl.types import SamplingParams

    monkeypatch.setattr(attention, "varlen_attention", _reference_varlen_attention)
    monkeypatch.setattr(attention, "paged_prefill_attention", _reference_paged_prefill_attention)
    monkeypatch.setattr(PrefillGraphs, "_capture", lambda self, model, num_rows: None)  # CUDA only: the eager forward is what is tested
    model_dir = save_tiny(str(tmp_path), seed=3, **(dict(model_type="mistral", sliding_window=8) if paged == "window" else {}))
    prompts = [list(range(3 + i, 30 + 5 * i)) for i in range(3)] + [[7, 8, 9] * 7] * 3
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)

    async def two_turns(engine: Engine) -> list[list[int]]:
        first = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        second = await asyncio.gather(*(engine.generate(p + c.token_ids + [11, 12, 13], params) for p, c in zip(prompts, first)))
        alone = await engine.generate(prompts[1] + [4, 5], params)  # fewer sequences than the last prefill: its rows must not linger
        graphs = engine.runner.prefill_graphs
        uses.append(sum(graphs.uses.values()) if graphs is not None else 0)  # before close frees the graphs
        await engine.close()
        return [(c.token_ids, c.logprobs) for c in first + second + [alone]]

    outputs, uses = {}, []
    for varlen in (True, False):
        engine = Engine(EngineConfig(model=model_dir, device="cpu", max_num_seqs=8, max_model_len=128))
        engine.runner.varlen_prefill = varlen  # varlen: each prefill's rows padded (padded_num_tokens), as on a GPU
        engine.runner.paged_prefill = bool(paged)
        if paged == "graphed" and varlen:
            runner = engine.runner
            runner.graph_prefills = True
            runner.prefill_graphs = PrefillGraphs.allocate(
                max_rows=padded_num_tokens(runner.max_num_batched_tokens), max_num_seqs=runner.max_num_seqs,
                max_blocks_per_seq=runner.max_blocks_per_seq, block_size=runner.block_size, tile_queries=4, device=torch.device("cpu"),
            )  # fmt: skip
        outputs[varlen] = asyncio.run(two_turns(engine))
        assert engine.stats()["engine/num_prefix_hit_tokens"] > 0
    for (ids, logprobs), (expected_ids, expected_logprobs) in zip(outputs[True], outputs[False]):
        assert ids == expected_ids
        assert all(abs(a - b) < 1e-4 for a, b in zip(logprobs, expected_logprobs))
    if paged == "graphed":
        assert uses[0] >= 2  # both turns' prefills went through the graphs' forward


def test_int_tensor_and_padded_tables_are_torch_tensor_of_the_same_values():
    from tandemrl.generation.engine.layers.attention import int_tensor, padded_tables

    assert int_tensor([3, -1, 2**40]).tolist() == [3, -1, 2**40] and int_tensor([]).shape == (0,)
    assert int_tensor([3, 1], torch.int32).dtype == torch.int32
    tables = [[5, 2], [7], [1, 9, 4]]
    for dtype in (torch.int64, torch.int32):
        got = padded_tables(tables, dtype)
        assert got.dtype == dtype and torch.equal(got, torch.tensor([[5, 2, 0], [7, 0, 0], [1, 9, 4]], dtype=dtype))


def test_padded_num_tokens_is_the_docstring_and_never_less():
    from tandemrl.generation.engine.runner import padded_num_tokens

    assert [padded_num_tokens(n) for n in (1, 5, 16, 17, 200, 256, 257, 16360, 16384)] == [16, 16, 16, 32, 256, 256, 512, 16384, 16384]
    assert all(n <= padded_num_tokens(n) < n + 256 or n <= 16 for n in range(1, 5000))
    assert len({padded_num_tokens(n) for n in range(1, 16385)}) == 5 + 63  # powers of two to 256, then multiples of 256


def test_prefill_graph_buffers_forget_the_last_step_and_pad_to_the_scratch_slot():
    """The static buffers after a step of 3 sequences, then one of 1: rows past the step's queries sit at
    position 0 and write the scratch slot 0, and only the one sequence has tiles (a sequence of the last
    step left in the buffers would write its old slots, maybe blocks other sequences own by now)."""
    from tandemrl.generation.engine.prefill_graphs import PrefillGraphs

    graphs = PrefillGraphs.allocate(max_rows=64, max_num_seqs=4, max_blocks_per_seq=4, block_size=4, tile_queries=4, device=torch.device("cpu"))

    def step(query_lens: list[int], context_lens: list[int], tables: list[list[int]], num_rows: int):
        ids = torch.arange(100, 100 + sum(query_lens))
        graphs.load(ids, torch.tensor(query_lens), torch.tensor(context_lens), torch.tensor(tables))
        return graphs.metadata(num_rows)

    step([5, 3, 6], [9, 3, 6], [[1, 2, 3], [4, 0, 0], [5, 6, 0]], 16)
    positions, meta = step([2], [6], [[7, 8]], 16)
    expected = build_paged_prefill_metadata([2], [6], [[7, 8]], 4, torch.device("cpu"), tile_queries=4)
    assert positions[:2].tolist() == [4, 5] and not positions[2:].any()
    assert meta.slot_mapping[:2].tolist() == expected.slot_mapping.tolist() == [32, 33] and not meta.slot_mapping[2:].any()
    assert [(b, s) for b, s in zip(meta.tile_seqs.tolist(), meta.tile_starts.tolist()) if b < 4] == [(0, 0)]
    assert meta.cu_seq_q.tolist() == [0, 2, 2, 2, 2] and meta.num_queries is None
