"""The persistent decode state: advancing it in place equals rebuilding it from the host, and the
engine's decode (which runs on it) gives the same tokens whatever else shares the batch."""

from __future__ import annotations

import asyncio

import torch

from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine import Engine
from tandemrl.generation.engine.decode_state import DecodeState
from tandemrl.generation.engine.sequence import Sequence
from tandemrl.types import SamplingParams

BLOCK = 4


def _seqs() -> list[Sequence]:
    seqs = []
    for i, length in enumerate([3, 4, 9]):
        seq = Sequence(list(range(10, 10 + length)), SamplingParams(top_k=5 if i == 1 else -1), seed=i, stop_ids=frozenset())
        seq.block_table = [1 + 10 * i + b for b in range(-(-length // BLOCK))]
        seqs.append(seq)
    return seqs


def _snapshot(state: DecodeState, seqs: list[Sequence], rows: int) -> dict[str, torch.Tensor]:
    lens = state.ints[2, : len(seqs)]
    tables = [state.block_tables[i, : -(-int(n) // BLOCK)] for i, n in enumerate(lens)]
    ints = state.ints[:, :rows].clone()
    ints[0, len(seqs) :] = 0  # a padded row's input id is whatever it sampled: never read back
    return {
        "ints": ints,
        "floats": state.floats[:, :rows].clone(),
        "tables": torch.cat(tables),
        "slots": state.metadata(rows, BLOCK, gather=True).slot_mapping.clone(),
        "keys": state.sampling(rows, needs_filter=False).keys.clone(),
    }


def test_advancing_in_place_equals_a_rebuild_from_the_host():
    seqs, rows = _seqs(), 4  # one padded row
    state = DecodeState(8, 8, vocab_size=100, device=torch.device("cpu"))
    state.load(seqs, rows)
    for step in range(6):
        token_ids = torch.tensor([20 + step, 30 + step, 40 + step, 99])
        state.advance(rows, token_ids)
        state.advanced()
        for seq, token_id in zip(seqs, token_ids.tolist()):
            seq.token_ids.append(token_id)
            if len(seq.block_table) * BLOCK < seq.num_tokens:  # as BlockManager.may_append
                seq.block_table.append(100 + len(seq.block_table))
        state.load(seqs, rows)  # incremental: only new block-table entries are written
        fresh = DecodeState(8, 8, vocab_size=100, device=torch.device("cpu"))
        fresh.load(seqs, rows)
        got, expected = _snapshot(state, seqs, rows), _snapshot(fresh, seqs, rows)
        for name in expected:
            assert torch.equal(got[name], expected[name]), (step, name)
    assert state.ints[1, 3] == 0 and state.ints[2, 3] == 1  # the padded row never advances


def test_a_changed_batch_is_rebuilt_not_advanced():
    seqs = _seqs()
    state = DecodeState(8, 8, vocab_size=100, device=torch.device("cpu"))
    state.load(seqs, 3)
    state.advance(3, torch.tensor([1, 2, 3]))
    state.advanced()
    state.load(seqs[1:], 2)  # the first sequence finished: rows shift, every row is rewritten
    assert state.ints[0, :2].tolist() == [seqs[1].token_ids[-1], seqs[2].token_ids[-1]]
    assert state.ints[1, :2].tolist() == [seqs[1].num_tokens - 1, seqs[2].num_tokens - 1]


def test_filtered_and_unfiltered_requests_decode_as_when_alone(family_dirs):
    prompts = [list(range(5 + i, 20 + 2 * i)) for i in range(4)]
    params = [SamplingParams(max_tokens=6 + 4 * i, temperature=1.0, top_k=8 if i % 2 else -1, top_p=0.9 if i == 3 else 1.0, seed=i, ignore_eos=True) for i in range(4)]

    def engine() -> Engine:
        return Engine(EngineConfig(model=family_dirs["qwen2"], device="cpu", kv_cache_tokens=2048))

    async def together(e: Engine):
        return await asyncio.gather(*(e.generate(p, s) for p, s in zip(prompts, params)))

    batched = asyncio.run(together(engine()))
    alone = [asyncio.run(engine().generate(p, s)) for p, s in zip(prompts, params)]
    assert [c.token_ids for c in batched] == [c.token_ids for c in alone]
    assert all(len(c.token_ids) == s.max_tokens for c, s in zip(batched, params))
