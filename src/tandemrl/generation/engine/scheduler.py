"""Token-level batching: which sequences run this step, and what happens to them after it.

A step is either a prefill (admit waiting sequences while blocks and the token budget allow; the budget
counts the tokens the step computes, so a next turn whose earlier turns are cached costs its new tokens) or a
decode (one token for every running sequence; when blocks run out the newest running sequence is
preempted: its blocks are freed and it waits to re-prefill prompt + sampled tokens, which gives the
same tokens as an unpreempted run, because sampling noise depends on (seed, position) alone).

Prefix sharing: a waiting sequence whose whole context equals one already admitted in this step is a
follower: it shares the leader's full blocks, gets a copy of the leader's partial last block after the
forward, and samples from the leader's last logits. A group of G equal prompts prefills one prompt.

Prefill holdoff (prefill_wait_steps N > 0): while sequences decode, waiting ones are admitted once the
oldest has waited N decode steps (or they would fill every free slot), so requests that arrive over a
few steps (the next turns of tool rollouts, each after its own tool call) are prefilled in one step
rather than one prefill step each tick, each of which stops the decode batch. Counted in steps, not
seconds, so tensor-parallel ranks replaying the same events decide the same.

Isolation: the sequences of a step that raised wait again, each flagged `isolated`, and each is then
prefilled in a step of its own, so the next failure names the one sequence that causes it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandemrl.generation.engine.kv_cache import BlockManager
from tandemrl.generation.engine.sequence import Sequence, Status


LEADER_KEY_TOKENS = 16  # a prefill's leaders are looked up by their length and this many last tokens


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work. Written by the scheduler, read by the runner."""

    seqs: list[Sequence]  # every sequence that samples a token this step
    num_new_tokens: list[int]  # [len(seqs)] tokens each computes (0 = a follower)
    sample_rows: list[int]  # [len(seqs)] index, among sequences that compute, of the logits each samples
    is_prefill: bool
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (source, destination) blocks


@dataclass(slots=True)
class Counters:
    """Monotonic token counters, read by stats(); written by the scheduler only."""

    num_prefill_tokens: int = 0  # prompt (or recomputed) tokens whose KV was computed
    num_prefix_hit_tokens: int = 0  # tokens found in the prefix cache or shared with a leader
    num_decode_tokens: int = 0
    num_preemptions: int = 0
    num_ahead_steps: int = 0  # steps (decodes, and prefills after a prefill) launched before the previous one's tokens were read


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        detokenize: Callable[[list[int]], str] | None = None,
        prefill_wait_steps: int = 0,
        overlap_prefills: bool = False,
    ) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.detokenize = detokenize
        self.prefill_wait_steps = prefill_wait_steps
        self.overlap_prefills = overlap_prefills
        self.num_decode_steps = 0  # decode steps scheduled so far: the clock of prefill_wait_steps
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.counters = Counters()

    def add(self, seq: Sequence) -> None:
        seq.arrival_step = self.num_decode_steps
        self.waiting.append(seq)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> ScheduledBatch | None:
        if self._prefill_due():
            return self._schedule_prefill() or self._schedule_decode()
        return self._schedule_decode() or self._schedule_prefill()

    def _prefill_due(self) -> bool:
        """Admit waiting sequences now? Always when nothing decodes; with a holdoff, once the oldest
        (the front: preempted and isolated sequences rejoin there) waited it out, or when they fill every free slot."""
        if not self.prefill_wait_steps or not self.waiting or not self.running:
            return True
        waited = self.num_decode_steps - self.waiting[0].arrival_step
        return waited >= self.prefill_wait_steps or len(self.waiting) >= self.max_num_seqs - len(self.running)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        batch = ScheduledBatch(seqs=[], num_new_tokens=[], sample_rows=[], is_prefill=True)
        # leaders by length and last tokens, each checked against the whole context: a tuple of every token,
        # hashed, cost ~3 us a sequence of 450 tokens (a boundary's 512 next turns, none a follower)
        leaders: dict[tuple[int, tuple[int, ...]], list[Sequence]] = {}
        leader_rows: dict[int, int] = {}
        num_tokens = 0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.isolated and batch.seqs:
                break
            key = (seq.num_tokens, tuple(seq.token_ids[-LEADER_KEY_TOKENS:]))
            leader = next((one for one in leaders.get(key, ()) if one.token_ids == seq.token_ids), None)
            hashes = None if leader else self.blocks.block_hashes(seq)
            cached = None if leader else self.blocks.num_cached_tokens(seq, hashes)
            cost = 0 if leader else seq.num_tokens - cached  # what it computes: a cached prefix is free
            if num_tokens + cost > self.max_num_batched_tokens or not self.blocks.can_allocate(seq):
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, allow_full_hit=leader is not None, hashes=hashes, num_cached=cached)
            if leader is None:
                leaders.setdefault(key, []).append(seq)
                leader_rows[seq.seq_id] = len(leader_rows)
                new_tokens = seq.num_tokens - seq.num_cached_tokens
            else:
                new_tokens = 0
                self._share_partial_block(leader, seq, batch)
            num_tokens += new_tokens
            self.counters.num_prefill_tokens += new_tokens
            self.counters.num_prefix_hit_tokens += seq.num_tokens - new_tokens
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(new_tokens)
            batch.sample_rows.append(leader_rows[(leader or seq).seq_id])
            if seq.isolated:
                break
        return batch if batch.seqs else None

    def _share_partial_block(self, leader: Sequence, follower: Sequence, batch: ScheduledBatch) -> None:
        if follower.num_tokens % self.blocks.block_size:  # the follower's last block is its own copy
            batch.block_copies.append((leader.block_table[-1], follower.block_table[-1]))
        follower.num_cached_tokens = follower.num_tokens

    def _schedule_decode(self) -> ScheduledBatch | None:
        scheduled: list[Sequence] = []
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not self.blocks.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.blocks.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        if not scheduled:
            return None
        self.num_decode_steps += 1
        self.counters.num_decode_tokens += len(scheduled)
        return ScheduledBatch(seqs=scheduled, num_new_tokens=[1] * len(scheduled), sample_rows=list(range(len(scheduled))), is_prefill=False)

    def schedule_ahead(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The step after `batch`, scheduled before `batch`'s tokens are known, so the engine can launch it
        while `batch` still runs. After a decode: the next decode of the same sequences, each one token
        further; only when nothing waits to be admitted (a holdoff still running counts as nothing),
        `batch` is a decode of every running sequence, and each has room for that token without a
        preemption. Rows of sequences that `batch` finishes are computed and discarded. After a prefill,
        with overlap_prefills: the next prefill, when sequences wait to be admitted (a group of next turns
        past one step's token budget), since its sequences do not depend on `batch`'s tokens; never one of
        an isolated sequence."""
        admitting = self.waiting and self._prefill_due()
        if batch.is_prefill:
            if not (admitting and self.overlap_prefills) or self.waiting[0].isolated or any(seq.isolated for seq in batch.seqs):
                return None
            ahead = self._schedule_prefill()
            self.counters.num_ahead_steps += ahead is not None
            return ahead
        if admitting or len(batch.seqs) != len(self.running):
            return None
        if any(seq.status is not Status.RUNNING for seq in batch.seqs):
            return None
        size = self.blocks.block_size
        if sum(len(seq.block_table) * size < seq.num_tokens + 1 for seq in batch.seqs) > self.blocks.num_free_blocks:
            return None
        for seq in batch.seqs:
            self.blocks.may_append(seq, ahead=1)
        self.num_decode_steps += 1
        self.counters.num_decode_tokens += len(batch.seqs)
        self.counters.num_ahead_steps += 1
        n = len(batch.seqs)
        return ScheduledBatch(seqs=list(batch.seqs), num_new_tokens=[1] * n, sample_rows=list(range(n)), is_prefill=False)

    def _preempt(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.blocks.deallocate(seq)
        self.waiting.appendleft(seq)
        self.counters.num_preemptions += 1

    def postprocess(
        self, batch: ScheduledBatch, token_ids: list[int], logprobs: list[float], version: int, top: list[dict[int, float]] | None = None,
        routes: list[bytes] | None = None, floors: list[float] | None = None,
    ) -> list[Sequence]:
        """Appends each sampled token (and its row of `top` alternatives to a sequence that asked for
        them, its row of `routes` when recorded, its logit floor when it filters); returns the sequences that finished (their blocks are
        freed). A row of a sequence that finished before (a look-ahead step, an abort) is dropped."""
        finished = []
        for i, (seq, token_id, logprob) in enumerate(zip(batch.seqs, token_ids, logprobs)):
            if seq.status is Status.FINISHED:
                continue
            seq.token_ids.append(token_id)
            seq.logprobs.append(logprob)
            if top is not None and seq.params.top_logprobs:
                seq.top_logprobs.append(dict(list(top[i].items())[: seq.params.top_logprobs]))
            seq.policy_versions.append(version)
            if floors is not None and seq.params.filters and not seq.params.greedy:
                seq.logit_floors.append(floors[i])
            if routes is not None:
                if seq.routes is None:
                    seq.routes = bytearray()
                seq.routes += routes[i]
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        if finished:
            self.drop_finished()
        return finished

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        if token_id in seq.stop_ids:
            return "stop"
        stop = seq.params.stop
        if stop and self.detokenize is not None:
            # a stop string of n characters ends within the last n tokens (each token has >= 1 byte)
            window = max(len(s) for s in stop) + 1
            tail = self.detokenize(seq.token_ids[max(seq.num_prompt_tokens, seq.num_tokens - window) :])  # not output_ids: a copy of them all
            if any(s in tail for s in stop):
                return "stop"
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Marks `seq` finished and frees its blocks; the caller drops it from `running`."""
        seq.finish_reason = reason
        seq.status = Status.FINISHED
        self.blocks.deallocate(seq)

    def drop_finished(self) -> None:
        self.running = deque(s for s in self.running if s.status is not Status.FINISHED)

    def abort(self, seq: Sequence) -> bool:
        """Removes `seq` wherever it is; False when it had already finished."""
        if seq.status is Status.FINISHED:
            return False
        (self.waiting if seq.status is Status.WAITING else self.running).remove(seq)
        self.finish(seq, "abort")
        return True

    def isolate(self, seqs: list[Sequence]) -> None:
        """Sends `seqs` (of a step that raised) back to wait, each to be prefilled alone."""
        for seq in reversed(seqs):
            self.running.remove(seq)
            self.blocks.deallocate(seq)
            seq.status = Status.WAITING
            seq.isolated = True
            self.waiting.appendleft(seq)

    def preempt_all(self) -> None:
        """Frees every block (the engine goes to sleep): running sequences wait to re-prefill."""
        while self.running:
            self._preempt(self.running.pop())
