"""Block bookkeeping: prefix hits by block hash, reference counts, never writing into a shared block;
what a prefill step admits when earlier turns are cached (its token budget counts computed tokens)."""

from __future__ import annotations

import pytest

from tandemrl.generation.engine.kv_cache import NULL_BLOCK, BlockManager
from tandemrl.generation.engine.scheduler import Scheduler
from tandemrl.generation.engine.sequence import Sequence, Status
from tandemrl.types import SamplingParams


def seq(token_ids: list[int]) -> Sequence:
    return Sequence(list(token_ids), SamplingParams(), seed=0, stop_ids=frozenset())


@pytest.fixture(autouse=True)
def probe_equals_allocate(monkeypatch):
    """Every allocate in these tests first checks that num_cached_tokens (the scheduler's probe, which
    allocate follows) changes nothing; the tests' own asserts check what allocate then takes."""
    allocate = BlockManager.allocate

    def checked(self, seq, *, allow_full_hit=False, hashes=None, num_cached=None):
        state = (dict(self.hash_to_block), list(self.free), [(b.ref_count, b.hash, b.token_ids) for b in self.blocks])
        foretold = self.num_cached_tokens(seq, self.block_hashes(seq), allow_full_hit=allow_full_hit)
        assert state == (dict(self.hash_to_block), list(self.free), [(b.ref_count, b.hash, b.token_ids) for b in self.blocks])
        allocate(self, seq, allow_full_hit=allow_full_hit, hashes=hashes, num_cached=num_cached)
        assert seq.num_cached_tokens == foretold

    monkeypatch.setattr(BlockManager, "allocate", checked)


def test_full_prompt_blocks_are_shared_and_the_last_block_is_recomputed():
    blocks = BlockManager(num_blocks=10, block_size=4)
    first, second = seq(list(range(10))), seq(list(range(10)))
    blocks.allocate(first)
    blocks.allocate(second)
    assert second.num_cached_tokens == 8 and second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]  # the partial block is never shared
    exact = seq(list(range(8)))
    blocks.allocate(exact)
    assert exact.num_cached_tokens == 4  # a full hit still recomputes its last block
    assert NULL_BLOCK not in first.block_table + second.block_table + exact.block_table


def test_freed_blocks_return_and_cached_blocks_revive():
    blocks = BlockManager(num_blocks=6, block_size=4)
    first = seq(list(range(8)) + [99])
    blocks.allocate(first)
    table = list(first.block_table)
    blocks.deallocate(first)
    assert blocks.num_free_blocks == 5
    again = seq(list(range(8)) + [98])
    blocks.allocate(again)
    assert again.num_cached_tokens == 8 and again.block_table[:2] == table[:2]


def test_reset_prefix_cache_forgets_every_hash():
    blocks = BlockManager(num_blocks=8, block_size=4)
    blocks.allocate(seq(list(range(9))))
    blocks.reset_prefix_cache()
    later = seq(list(range(9)))
    blocks.allocate(later)
    assert later.num_cached_tokens == 0


def test_reset_forgets_superseded_hashes_too():
    blocks = BlockManager(num_blocks=8, block_size=4)
    for _ in range(2):  # the second copy recomputes its last full block: a new block takes over its hash
        blocks.allocate(seq(list(range(8))))
    blocks.reset_prefix_cache()
    assert not blocks.hash_to_block
    again = seq(list(range(8)))
    blocks.allocate(again)
    assert again.num_cached_tokens == 0
    twice = seq(list(range(8)))
    blocks.allocate(twice)
    assert twice.num_cached_tokens == 4 and twice.block_table[0] == again.block_table[0]


def test_append_takes_a_block_only_at_a_block_boundary():
    blocks = BlockManager(num_blocks=4, block_size=4)
    s = seq([1, 2, 3, 4])
    blocks.allocate(s)
    s.token_ids.append(5)  # the next decode writes position 4: a new block
    assert blocks.can_append(s)
    blocks.may_append(s)
    assert len(s.block_table) == 2
    s.token_ids.append(6)
    blocks.may_append(s)
    assert len(s.block_table) == 2


def test_a_finished_sequences_decoded_blocks_serve_its_next_turn():
    blocks = BlockManager(num_blocks=10, block_size=4)
    turn = seq(list(range(5)))
    blocks.allocate(turn)
    for token in range(100, 106):  # decode 6 tokens: positions 5..10; the last one's KV is never written
        turn.token_ids.append(token)
        blocks.may_append(turn)
    table = list(turn.block_table)
    blocks.deallocate(turn)
    next_turn = seq(turn.token_ids + [7, 7, 7, 7, 7])
    blocks.allocate(next_turn)
    # block 2's written head (positions 8, 9) is reused too; position 10 (the last sampled token) is computed
    assert next_turn.num_cached_tokens == 10 and next_turn.block_table[:3] == table
    assert not any(b.token_ids and len(b.token_ids) < 4 for b in blocks.blocks)  # the taken head's key is gone


def decoded_turn(blocks: BlockManager, prompt: list[int], num_decoded: int) -> Sequence:
    turn = seq(prompt)
    blocks.allocate(turn)
    for token in range(100, 100 + num_decoded):
        turn.token_ids.append(token)
        blocks.may_append(turn)
    blocks.deallocate(turn)
    return turn


def test_a_written_head_leaves_at_least_one_token_to_compute():
    blocks = BlockManager(num_blocks=10, block_size=4)
    turn = decoded_turn(blocks, list(range(5)), 6)  # 11 tokens, positions 0..9 written
    again = seq(turn.token_ids)  # the same context again: its last token's logits must be computed
    blocks.allocate(again)
    assert again.num_cached_tokens == 10
    other = decoded_turn(blocks, list(range(5)), 3)  # 8 tokens: blocks 0 full, block 1 head of 3 positions
    shorter = seq(other.token_ids[:7])  # the head covers the whole last block: computed, not reused
    blocks.allocate(shorter)
    assert shorter.num_cached_tokens == 4


def test_a_written_head_is_reused_only_from_a_free_block_and_never_by_a_follower():
    blocks = BlockManager(num_blocks=12, block_size=4)
    turn = decoded_turn(blocks, list(range(5)), 6)
    follower = seq(turn.token_ids + [7])
    blocks.allocate(follower, allow_full_hit=True)  # a follower copies its leader's last block instead
    assert follower.num_cached_tokens == 8
    owner = seq(turn.token_ids + [7])
    blocks.allocate(owner)
    assert owner.num_cached_tokens == 10
    rival = seq(turn.token_ids + [8])  # the head's block is owned (and being written) now
    blocks.allocate(rival)
    assert rival.num_cached_tokens == 8 and rival.block_table[2] != owner.block_table[2]
    blocks.reset_prefix_cache()
    decoded = decoded_turn(blocks, list(range(5)), 6)
    blocks.reset_prefix_cache()
    assert not blocks.hash_to_block
    later = seq(decoded.token_ids + [7])
    blocks.allocate(later)
    assert later.num_cached_tokens == 0


def test_a_sequence_that_lived_across_a_reset_hashes_nothing():
    blocks = BlockManager(num_blocks=10, block_size=4)
    turn = seq(list(range(5)))
    blocks.allocate(turn)
    blocks.reset_prefix_cache()  # a weight update mid-sequence: its KV mixes two versions
    for token in range(100, 106):
        turn.token_ids.append(token)
        blocks.may_append(turn)
    blocks.deallocate(turn)
    assert not blocks.hash_to_block


def test_a_prefill_budget_counts_the_tokens_computed_not_the_cached_prefix():
    blocks = BlockManager(num_blocks=64, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=24)
    turns = [decoded_turn(blocks, [10 * i + t for t in range(8)], 5) for i in range(4)]  # 13 tokens each, 12 written
    for turn in turns:  # next turns: 13 + 3 tokens, of which 12 cached: 4 to compute each
        scheduler.add(seq(turn.token_ids + [7, 7, 7]))
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [4, 4, 4, 4]  # one step computes 16; counted whole (16 each), the fourth would not fit
    assert [s.num_cached_tokens for s in batch.seqs] == [12] * 4


def test_contexts_that_only_end_alike_are_not_leader_and_follower():
    """A prefill's leaders are looked up by length and last tokens, then checked against the whole context."""
    blocks = BlockManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(blocks, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64)
    tail = list(range(100, 120))
    first, other, same = seq([1, 2, *tail]), seq([3, 4, *tail]), seq([1, 2, *tail])
    for s in (first, other, same):
        scheduler.add(s)
    batch = scheduler.schedule()
    assert batch.num_new_tokens == [22, 22, 0]  # `same` follows `first`; `other` computes its own context
    assert batch.sample_rows == [0, 1, 0]
    assert other.block_table[0] != first.block_table[0] and same.block_table[:5] == first.block_table[:5]


def test_a_window_frees_the_blocks_every_later_query_is_past_and_each_block_once():
    """Window 6, blocks of 4: decoding frees block i once (i + 1) * 4 <= num_tokens - 6; a block shared with
    another sequence only loses a reference; leaving frees the rest once, and hashes what it still holds."""
    blocks = BlockManager(num_blocks=12, block_size=4, window=6)
    prompt = list(range(12))
    first, second = seq(prompt + [50]), seq(prompt + [60])
    blocks.allocate(first)
    blocks.allocate(second)  # shares blocks 0-2 of the prompt
    shared = first.block_table[:3]
    free_before = blocks.num_free_blocks
    blocks.may_append(first)  # 13 tokens: (13 - 6) // 4 = 1 -> block 0 done
    assert first.block_table[0] == NULL_BLOCK and first.block_table[1:3] == shared[1:]
    assert blocks.blocks[shared[0]].ref_count == 1 and blocks.num_free_blocks == free_before  # still second's
    for token in range(70, 80):
        first.token_ids.append(token)
        blocks.may_append(first)
    # 23 tokens: (23 - 6) // 4 = 4 -> blocks 0-3 (positions 0-15) done; the next query, at 22, sees 17-22
    assert first.num_tokens == 23 and len(first.block_table) == 6
    assert first.block_table[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in first.block_table[4:]
    blocks.deallocate(second)
    blocks.deallocate(first)
    assert blocks.num_free_blocks == 11  # every block back exactly once (block 0 never handed out)
    assert all(b.ref_count == 0 for b in blocks.blocks)


def test_without_a_window_nothing_is_freed_while_decoding():
    blocks = BlockManager(num_blocks=12, block_size=4)
    s = seq(list(range(30)))
    blocks.allocate(s)
    blocks.may_append(s)
    assert NULL_BLOCK not in s.block_table


class ShadowCache:
    """What each cache slot holds, as the context it was computed from: every position a step computes or
    attends to (its last `window` positions, or all) must hold the KV of this sequence's own prefix."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler, self.blocks, self.slots = scheduler, scheduler.blocks, {}

    def slot(self, s: Sequence, position: int) -> int:
        block_id = s.block_table[position // self.blocks.block_size]
        assert block_id != NULL_BLOCK, f"position {position} of a sequence of {s.num_tokens} was freed"
        return block_id * self.blocks.block_size + position % self.blocks.block_size

    def attends(self, s: Sequence, query: int) -> None:
        window = self.blocks.window
        for key in range(max(0, query - window + 1) if window else 0, query + 1):
            assert self.slots.get(self.slot(s, key)) == tuple(s.token_ids[: key + 1]), (query, key)

    def run(self, batch) -> None:
        """Writes every new position's KV, then reads (a step writes before any query reads), copies the
        followers' last blocks, and appends a token that depends on (seed, position) alone."""
        live = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens) if s.status is not Status.FINISHED]
        for s, n in live:
            for position in range(s.num_tokens - n, s.num_tokens):
                self.slots[self.slot(s, position)] = tuple(s.token_ids[: position + 1])
        for s, n in live:
            for position in range(s.num_tokens - n, s.num_tokens):
                self.attends(s, position)
        size = self.blocks.block_size
        for source, destination in batch.block_copies:
            for offset in range(size):
                self.slots[destination * size + offset] = self.slots.get(source * size + offset)
        for s, n in live:
            if n == 0:  # a follower samples from its leader's row: its own context must be in place too
                self.attends(s, s.num_tokens - 1)
        self.scheduler.postprocess(batch, [hash((s.seed, s.num_tokens)) % 4 for s in batch.seqs], [0.0] * len(batch.seqs), 0)

    def check_references(self) -> None:
        held: dict[int, int] = {}
        for s in self.scheduler.running:
            for block_id in s.block_table:
                if block_id != NULL_BLOCK:
                    held[block_id] = held.get(block_id, 0) + 1
        assert self.blocks.blocks[NULL_BLOCK].ref_count == 0 and NULL_BLOCK not in self.blocks.free
        for block in self.blocks.blocks[1:]:
            assert block.ref_count == held.get(block.block_id, 0) and (block.ref_count == 0) == (block.block_id in self.blocks.free)


@pytest.mark.parametrize("trial", range(150))
def test_windows_sharing_preemption_aborts_and_next_turns_read_only_their_own_kv(trial):
    """Random traffic over a small cache (forced preemptions): prompts sharing prefixes, groups of equal prompts
    (followers), next turns of finished sequences, aborts, prefix-cache resets, look-ahead decodes, windows
    narrower and wider than a block. Every position a step reads holds the KV of the reader's own prefix, and
    reference counts match the block tables."""
    import random

    rng = random.Random(trial)
    size, window = rng.choice([2, 3, 4, 8]), rng.choice([0, 1, 2, 5, 6, 9])
    blocks = BlockManager(num_blocks=rng.randrange(12, 40), block_size=size, window=window)
    scheduler = Scheduler(blocks, max_num_seqs=rng.choice([2, 3, 64]), max_num_batched_tokens=rng.choice([64, 200]), max_model_len=64,
                          prefill_wait_steps=rng.choice([0, 0, 2]), overlap_prefills=rng.random() < 0.5)  # fmt: skip
    shadow, ahead, finished = ShadowCache(scheduler), rng.random() < 0.5, []
    roots = [[rng.randrange(4) for _ in range(rng.randrange(1, 20))] for _ in range(3)]

    def add(tokens: list[int], copies: int = 1) -> None:
        for _ in range(copies):
            s = Sequence(list(tokens), SamplingParams(max_tokens=rng.randrange(1, 25)), seed=rng.randrange(2), stop_ids=frozenset())
            if len(tokens) + s.params.max_tokens <= 40 and blocks.num_blocks_for(len(tokens) + s.params.max_tokens) <= blocks.num_blocks:
                scheduler.add(s)

    def step() -> bool:
        before = list(scheduler.running)
        batch = scheduler.schedule()
        if batch is None:
            return False
        later = scheduler.schedule_ahead(batch) if ahead else None
        shadow.run(batch)
        if later is not None:
            shadow.run(later)
        shadow.check_references()
        finished.extend(s for s in before if s.finish_reason == "length")
        return True

    for _ in range(120):
        action = rng.random()
        if action < 0.15:
            root = rng.choice(roots)
            add(root[: rng.randrange(1, len(root) + 1)] + [rng.randrange(4) for _ in range(rng.choice([0, 0, 2]))], rng.choice([1, 1, 3]))
        elif action < 0.2 and finished:
            add(rng.choice(finished).token_ids + [rng.randrange(4) for _ in range(rng.randrange(3))])
        elif action < 0.23 and scheduler.num_unfinished():
            scheduler.abort(rng.choice([*scheduler.running, *scheduler.waiting]))
            scheduler.drop_finished()
        elif action < 0.235:
            blocks.reset_prefix_cache()
        else:
            step()
    while step():
        pass
    assert scheduler.num_unfinished() == 0 and blocks.num_free_blocks == blocks.num_blocks
