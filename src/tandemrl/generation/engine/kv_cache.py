"""The paged KV cache's bookkeeping: fixed-size blocks, reference counts, prefix sharing by block hash.

Invariants: a block is in exactly one of `free` or in use (ref_count > 0); a full block's hash is the
hash of every token up to its end, so a hit on block i implies hits on blocks 0..i-1; block 0 is a
scratch block never handed out (padded rows of a CUDA graph write their KV there). With a `window` W
(a model whose every layer attends to its last W tokens: Mistral, Phi-3), a running sequence's blocks that
every later query is past are freed as it decodes, their table entries replaced by block 0 (read only
where attention masks them out). After a weight
update `reset_prefix_cache` forgets every hash, so no later request reuses KV of old weights.
A sequence's decoded blocks are hashed when it leaves (finished or preempted), once every position
of the block has its KV, so the next turn of a conversation (prompt + this completion + more) reuses
them; a sequence that lived across a reset (two weight versions in its KV) hashes nothing. Its last,
partly written block is kept too (keyed by the hash of the blocks before it): a next turn that owns
the block then computes only the positions after its written head (a free block alone: it is written).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from tandemrl.generation.engine.sequence import Sequence

NULL_BLOCK = 0
PARTIAL = -1  # hash((parent, PARTIAL)): the key of a partly written block after the blocks hashed `parent`


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = -1
    token_ids: tuple[int, ...] = ()


class BlockManager:
    """Hands out blocks to sequences; a full prompt block seen before is shared instead of recomputed."""

    def __init__(self, num_blocks: int, block_size: int, *, window: int = 0) -> None:
        assert num_blocks >= 2, "the KV cache needs at least 2 blocks"
        self.block_size = block_size
        self.window = window  # > 0: every layer sees only its last `window` tokens: older blocks are freed
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in LRU order; a freed block keeps its hash and may be revived by a later hit
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.epoch = 0  # reset_prefix_cache calls so far

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) - 1  # the scratch block is not usable

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_blocks_for(seq.num_tokens) <= len(self.free)

    def block_hashes(self, seq: Sequence) -> list[tuple[int, tuple[int, ...]]]:
        """(hash, tokens) of each block of `seq`'s context: a full block's hash covers every token up to
        its end; a last, partial block's is -1."""
        size, parent, hashes, token_ids = self.block_size, 0, [], seq.token_ids
        num_full = len(token_ids) - len(token_ids) % size
        for start in range(0, num_full, size):
            chunk = tuple(token_ids[start : start + size])
            parent = hash((parent, chunk))
            hashes.append((parent, chunk))
        if num_full < len(token_ids):
            hashes.append((-1, tuple(token_ids[num_full:])))
        return hashes

    def num_cached_tokens(self, seq: Sequence, hashes: list[tuple[int, tuple[int, ...]]], *, allow_full_hit: bool = False) -> int:
        """The tokens of `seq` that `allocate(seq, hashes=hashes)` would find cached now (it changes nothing):
        what a prefill step need not compute. Example: block_size 4, the blocks of tokens 0..7 cached,
        seq 0..9 -> 8."""
        cached, size, blocks, cached_block = 0, self.block_size, self.blocks, self.hash_to_block.get
        full_hit_limit = len(hashes) if allow_full_hit else len(hashes) - 1
        for i, (block_hash, chunk) in enumerate(hashes):
            # block i is reusable as it is: cached under its hash (never -1: no Python hash is) with these tokens
            block_id = cached_block(block_hash, -1)
            if i >= full_hit_limit or block_id == -1 or blocks[block_id].token_ids != chunk:
                if not allow_full_hit and (block_id := self._partial(hashes[i - 1][0] if i else 0, chunk)) != -1:
                    cached += len(blocks[block_id].token_ids)
                return cached
            cached += size
        return cached

    def allocate(
        self, seq: Sequence, *, allow_full_hit: bool = False, hashes: list[tuple[int, tuple[int, ...]]] | None = None, num_cached: int | None = None
    ) -> None:
        """Gives `seq` a block table, reusing the cached full blocks of its prefix, then a free block whose
        written head starts the next block (`hashes`, `num_cached`: its block_hashes and num_cached_tokens,
        when the caller has them and nothing changed since).

        Unless `allow_full_hit` (a follower whose leader computes the last position's logits in the same
        step), at least the last block is computed, so a sequence never writes into a shared block.
        """
        assert not seq.block_table
        seq.cache_epoch = self.epoch
        hashes = self.block_hashes(seq) if hashes is None else hashes
        num_cached = self.num_cached_tokens(seq, hashes, allow_full_hit=allow_full_hit) if num_cached is None else num_cached
        num_hits, head = divmod(num_cached, self.block_size)
        blocks, free, table = self.blocks, self.free, seq.block_table
        for block_hash, _ in hashes[:num_hits]:  # shared, or revived from the free list
            block_id = self.hash_to_block[block_hash]
            if block_id in free:
                self._take(block_id)
            else:
                blocks[block_id].ref_count += 1
            table.append(block_id)
        for i, (block_hash, chunk) in enumerate(hashes[num_hits:], num_hits):
            if i == num_hits and head:
                block_id = self._take(self._partial(hashes[i - 1][0] if i else 0, chunk))
                self._forget(block_id)  # its tail is written now: no longer what its key says
            else:
                block_id = self.take_fresh()
            if block_hash != -1:
                block = blocks[block_id]
                block.hash, block.token_ids = block_hash, chunk
                self.hash_to_block[block_hash] = block_id
            table.append(block_id)
        seq.num_cached_tokens = num_cached

    def _partial(self, parent: int, chunk: tuple[int, ...]) -> int:
        """A free block whose written head starts `chunk` (after the blocks hashed `parent`); -1 if none.
        At least one position of `chunk` stays to compute (the last token's logits come from it)."""
        block_id = self.hash_to_block.get(hash((parent, PARTIAL)), -1)
        if block_id == -1 or block_id not in self.free:
            return -1
        head = self.blocks[block_id].token_ids
        if len(head) >= len(chunk) or chunk[: len(head)] != head:
            return -1
        return block_id

    def _take(self, block_id: int) -> int:
        del self.free[block_id]
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        return block_id

    def take_fresh(self) -> int:
        """A block with no hash (its old contents are forgotten by the prefix cache)."""
        block_id = self._take(next(iter(self.free)))
        self._forget(block_id)
        return block_id

    def _forget(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash != -1 and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids = -1, ()

    def deallocate(self, seq: Sequence) -> None:
        if seq.cache_epoch == self.epoch:
            self._hash_written_blocks(seq)
        for block_id in reversed(seq.block_table):
            if block_id == NULL_BLOCK:  # freed already, out of the window
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table.clear()
        seq.num_cached_tokens = 0

    def _hash_written_blocks(self, seq: Sequence) -> None:
        """Hashes the full blocks of `seq` whose KV is all written: every position but the last token's
        (sampled, never run through the model), and keys its partly written block after them (PARTIAL).
        A hash already cached elsewhere keeps its block. A block hashed at admission holds its hash in
        this chain already (a prompt's full blocks): only the blocks after it are hashed here."""
        size, parent, written = self.block_size, 0, seq.num_tokens - 1
        num_full = min(written // size, len(seq.block_table))
        for i in range(num_full):
            if seq.block_table[i] == NULL_BLOCK:  # freed out of the window: the chain goes on past it
                parent = hash((parent, tuple(seq.token_ids[i * size : (i + 1) * size])))
                continue
            block = self.blocks[seq.block_table[i]]
            if block.hash != -1:
                parent = block.hash
                continue
            chunk = tuple(seq.token_ids[i * size : (i + 1) * size])
            parent = hash((parent, chunk))
            if parent not in self.hash_to_block:
                block.hash, block.token_ids = parent, chunk
                self.hash_to_block[parent] = block.block_id
        if num_full < len(seq.block_table) and written > num_full * size:
            block = self.blocks[seq.block_table[num_full]]
            if block.hash == -1 and block.ref_count == 1:  # never a shared block: its next owner writes its tail
                block.hash, block.token_ids = hash((parent, PARTIAL)), tuple(seq.token_ids[num_full * size : written])
                self.hash_to_block[block.hash] = block.block_id

    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of the token at position num_tokens - 1 (written by the next decode)."""
        return len(seq.block_table) * self.block_size >= seq.num_tokens or bool(self.free)

    def may_append(self, seq: Sequence, *, ahead: int = 0) -> None:
        """Room up to position num_tokens - 1 + ahead (ahead 1: the decode after the next one)."""
        if len(seq.block_table) * self.block_size < seq.num_tokens + ahead:
            seq.block_table.append(self.take_fresh())
        if self.window:
            self._free_out_of_window(seq)

    def _free_out_of_window(self, seq: Sequence) -> None:
        """Frees the blocks of `seq` no query from now on sees: the next query is at position num_tokens - 1
        and sees positions past num_tokens - 1 - W, so block i is done once (i + 1) * size <= num_tokens - W.
        From the newest such block back to the first already freed: O(1) a step.
        Example: size 4, W 6, 15 tokens -> blocks 0 and 1 freed (positions 0-7; the next query sees 9-14)."""
        table = seq.block_table
        i = min((seq.num_tokens - self.window) // self.block_size, len(table) - 1) - 1
        while i >= 0 and table[i] != NULL_BLOCK:
            block = self.blocks[table[i]]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block.block_id] = None
            table[i] = NULL_BLOCK
            i -= 1

    def reset_prefix_cache(self) -> None:
        """Forgets every hash. It runs at every weight update, so it costs O(cached blocks), not O(blocks):
        a block whose hash is not in `hash_to_block` can never be hit (lookups go through the map, and
        `_forget` only removes a hash that maps to its own block)."""
        for block_id in self.hash_to_block.values():
            block = self.blocks[block_id]
            block.hash, block.token_ids = -1, ()
        self.hash_to_block.clear()
        self.epoch += 1
