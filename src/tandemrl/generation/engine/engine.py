"""The engine: a Generator whose step loop (schedule -> run -> postprocess) runs in a background thread.

Invariants: every state change of sequences and blocks happens in the engine thread or under the step
lock; weight updates, sleep and wake take the step lock, so they land between two steps, never inside
one; a token carries the version live during the step that produced it; every update resets the
prefix cache. `generate` may be awaited from any asyncio loop; cancelling it aborts the request.

Overlap (on CUDA): a decode step launches the next decode of the same sequences before it waits for
its own tokens (Scheduler.schedule_ahead), so the host's bookkeeping runs while the device computes;
a prefill step launches the next prefill (other sequences that wait) the same way (--no-overlap_prefills: not).
That step is in flight between two calls of `step`; whatever needs the engine still (weight updates,
sleep, wake) finishes it first, under the step lock. Sampling noise depends on (seed, position) alone,
so the tokens are those of a run without overlap; rows of sequences that finished are dropped.

A step that raises fails no request by itself: its sequences wait again and are each prefilled alone
(Scheduler.isolate), so the one that causes the failure fails alone, with the error, and the others
go on to the tokens they would have drawn anyway (sampling noise depends on (seed, position) alone).

Tensor parallelism (parallel.py): every rank runs this engine on its shard. The leader (rank 0) takes
requests; under the step lock it sends each step's new requests and aborts, and every update, sleep and
wake, to the followers, whose thread (follower.py) applies them between the same two steps, under the
same step lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from tandemrl.generation.base import EngineConfig
from tandemrl.generation.engine.follower import Follower
from tandemrl.generation.engine.kv_cache import BlockManager
from tandemrl.generation.engine.models import build_model, load_hf_config, unsupported_reason, weights_of
from tandemrl.generation.engine.models.loading import eos_ids
from tandemrl.generation.engine.parallel import HEARTBEAT_S, TensorParallel, to_wire
from tandemrl.generation.engine.runner import Launched, ModelRunner
from tandemrl.generation.engine.scheduler import ScheduledBatch, Scheduler
from tandemrl.generation.engine.sequence import Sequence, Status, out_of_range, seed32
from tandemrl.generation.engine.sizing import num_kv_blocks
from tandemrl.generation.engine.sleep import Residency
from tandemrl.generation.loading import load_tokenizer, resolve_device, resolve_dtype
from tandemrl.generation.tick import Outbox, TickBatcher
from tandemrl.types import Completion, SamplingParams

log = logging.getLogger(__name__)
MAX_FAILED_STEPS = 3  # a request in this many failed steps fails, even when never alone in one


class Engine:
    def __init__(
        self, config: EngineConfig, *, model: Any = None, tokenizer: Any = None, tp: TensorParallel | None = None, adapter_rank: int = 0
    ) -> None:
        """`model`/`tokenizer`: the trainer's, in colocate mode (else loaded from config.model). `tp`: this
        rank's tensor-parallel group (config.tensor_parallel_size ranks); a follower takes no requests.
        `adapter_rank`: LoRA adapters of this rank applied beside the base (layers/lora.py; see share_base)."""
        if config.tensor_parallel_size != (tp.size if tp is not None else 1):
            raise ValueError(
                f"--tensor_parallel_size {config.tensor_parallel_size}: the engine needs a group of that many ranks; "
                "`tandem rollout --tensor_parallel_size N` starts them itself; `tandem train` splits its engine over torchrun's ranks"
            )
        self.config = config
        self.tp = tp
        self.is_follower = tp is not None and not tp.is_leader
        self.version = 0
        self.unshared_base: set[str] | None = None  # set by share_base: the frozen weights a LoRA trainer did not share
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.adapter_rank = adapter_rank
        self._load_model(model, tokenizer)
        self._build_device_plane()
        self._build_control_plane()
        self._start_thread()

    # --- construction ----------------------------------------------------------------------------------
    def _load_model(self, model: Any, tokenizer: Any) -> None:
        """The tokenizer, its end-of-sequence ids, max_model_len and the inference model (from `model`'s
        weights or config.model)."""
        config = self.config
        hf_config = model.config if model is not None else load_hf_config(config.model)
        reason = unsupported_reason(hf_config)
        if reason is not None:
            raise ValueError(f"{reason}; use the hf generator (--generator hf)")
        self.tokenizer = tokenizer if tokenizer is not None else (load_tokenizer(config.model) if config.model else None)
        self.max_model_len = config.model_len(max_positions=getattr(hf_config, "max_position_embeddings", None))
        source = model if model is not None else config.model
        self.model = build_model(
            hf_config, weights_of(source), dtype=self.dtype, device=self.device, max_positions=self.max_model_len, tp=self.tp, adapter_rank=self.adapter_rank
        )  # fmt: skip
        self.eos_ids = eos_ids(self.tokenizer, hf_config)

    def _build_device_plane(self) -> None:
        """The runner (forward, sampling, CUDA graphs) and the KV cache, sized by _num_kv_blocks."""
        config = self.config
        with self._on_device():  # memory sizing, graph capture and Triton launches read the current device
            self.runner = ModelRunner(
                self.model,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_model_len=self.max_model_len,
                use_graphs=not config.enforce_eager,
                max_num_batched_tokens=max(config.max_num_batched_tokens, self.max_model_len),
                record_routes=config.routing_replay,
                filtered_graphs=config.decode_graphs == "filtered",
            )
            wanted = num_kv_blocks(config, self.model.config, self.runner, self.device, max_model_len=self.max_model_len)
            num_blocks = wanted if self.tp is None else self.tp.min(wanted)  # the same on every rank
            self.blocks = BlockManager(num_blocks, config.block_size, window=self.model.family.freeable_window)
            self.runner.allocate_kv_cache(len(self.blocks.blocks))

    def _build_control_plane(self) -> None:
        """The scheduler and the state the engine thread and the callers share."""
        config = self.config
        self.scheduler = Scheduler(
            self.blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(config.max_num_batched_tokens, self.max_model_len),
            max_model_len=self.max_model_len,
            detokenize=self.tokenizer.decode if self.tokenizer is not None else None,
            prefill_wait_steps=config.prefill_wait_steps,
            overlap_prefills=config.overlap_prefills,
        )
        self.overlap = self.device.type == "cuda"  # launch the next decode before waiting (module docstring)
        self._ahead: tuple[ScheduledBatch, Launched, int] | None = None  # that step and its version, in flight
        self._in_step: list[Sequence] = []  # the sequences of the step being run (blamed if it raises)
        self._seeds = itertools.count(config.seed * 1_000_003)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # requests submitted in one event-loop tick reach the engine together, so they share a step: a
        # step's batch is then a function of what was submitted, not of thread timing, and a synchronous
        # pipeline (all of a step's requests at once) is bitwise reproducible, resume included
        self._this_tick: TickBatcher[Sequence] = TickBatcher(self._add_many)
        # the way back: completions (and failures) reach their loops at the end of each step-lock hold,
        # one wake-up a loop, not one a request (written under the step lock only)
        self._outbox = Outbox()
        self._streaming: set[Sequence] = set()  # engine thread only: unfinished sequences with on_token
        self._wake = threading.Event()
        self._step_lock = threading.Lock()
        self._cond = threading.Condition()
        self._num_exclusive = 0
        self._closed = False
        self.follower = Follower(self) if self.is_follower else None  # a follower rank's side (follower.py)
        self.residency = Residency(self.model, self.runner, self.blocks, self.scheduler, self.device)  # sleep, wake, weight loading (sleep.py)
        self.weights = self.residency.weights

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self.follower.run if self.follower else self._loop, name="tandem-engine", daemon=True)
        self._thread.start()

    streams_tokens = True  # generate() takes on_token
    caches_prefixes = True  # a request's blocks are kept for later requests to reuse (rollout/run.py warms next turns up)

    @property
    def awaiting_weights(self) -> bool:
        """True from a level-2 sleep until weight updates have written every weight again: no step runs,
        so a rollout server refuses requests (503) rather than hold them for weights nobody may send."""
        return bool(self.weights.missing)

    # --- the Generator protocol ----------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, on_token: Callable[[int], None] | None = None) -> Completion:
        """`on_token`, if given, is called on this event loop with each token as it is sampled, all of
        them before the completion is returned."""
        if self.is_follower:
            raise RuntimeError("a tensor-parallel follower takes no requests; send them to rank 0's engine")
        self._validate(prompt_ids, params)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        seq = Sequence(
            list(prompt_ids),
            params,
            seed=seed32(params.seed if params.seed is not None else next(self._seeds)),
            stop_ids=frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids),
            on_finish=lambda completion: self._outbox.put(loop, future, completion),
            on_token=None if on_token is None else lambda token_id: loop.call_soon_threadsafe(on_token, token_id),
        )
        self._this_tick.add(seq)
        try:
            return await future
        except asyncio.CancelledError:
            if self._this_tick.discard(seq):  # cancelled before its tick was handed over: never sent
                raise
            self._inbox.put(("abort", seq))
            self._wake.set()
            raise

    def _add_many(self, seqs: list[Sequence]) -> None:
        self._inbox.put(("add_many", seqs))
        self._wake.set()

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        """Full Hugging Face-named tensors; each rank keeps its shard. With tensor parallelism the leader
        decides when: it broadcasts its tensors (tp.broadcast_weights), or each follower's own call hands
        them to its thread, which waits for them when the leader's update comes."""
        if self.follower:
            await asyncio.to_thread(self.follower.hand_over, weights, version)
            return
        await asyncio.to_thread(self._update_weights, weights, version)

    def _update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        with self._between_steps():
            if self.tp is not None:
                if isinstance(weights, list):  # a server's staging: refused before any rank writes a tensor of it
                    self.model.check_shapes(weights)
                self.tp.send(("update", version))
                if self.tp.broadcast_weights:
                    weights = self.tp.shared_weights(weights, self.device)
            self._load_weights(weights, version)

    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self.residency.load(weights)
        self.version = version

    def share_base(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A colocated LoRA trainer's frozen base, by Hugging Face name, made views of this engine's weights,
        which were built from those very tensors (sleep.py's DroppableWeights.share); the names it could not
        share go in `unshared_base`. One rank, between steps; the engine must hold adapters (`adapter_rank`)."""
        if self.tp is not None:
            raise ValueError("the engine shares a LoRA trainer's base on one rank only (--tensor_parallel_size 1)")
        with self._between_steps():
            self.unshared_base = self.residency.weights.share(list(named))

    async def sleep(self, level: int) -> None:
        """The leader's sleep and wake reach every rank; on a follower (a colocated trainer's rank) these
        return once the leader's next one has been applied here, so the caller's next GPU work never runs
        while this rank's engine frees its memory or captures its CUDA graphs (a capture fails when another
        thread uses the GPU)."""
        if self.follower:
            await asyncio.to_thread(self.follower.await_leader, "sleep")
        else:
            await asyncio.to_thread(self._sleep, level)

    def _sleep(self, level: int) -> None:
        """Level 1 frees the KV cache (and the CUDA graphs that address it); level 2 also the weights,
        which the next weight updates refill (generation/engine/sleep.py): no copy is kept."""
        with self._between_steps():
            if self.tp is not None:
                self.tp.send(("sleep", level))
            self._sleep_now(level)

    def _sleep_now(self, level: int) -> None:
        self.residency.sleep(level)

    async def wake(self) -> None:
        if self.follower:
            await asyncio.to_thread(self.follower.await_leader, "wake")
        else:
            await asyncio.to_thread(self._wake_up)

    def _wake_up(self) -> None:
        with self._between_steps():
            if self.tp is not None:
                self.tp.send(("wake", 0))
            self._wake_now()

    def _wake_now(self) -> None:
        self.residency.wake()

    async def close(self) -> None:
        """Ends the engine thread; a follower's ends when its leader closes (waited for up to tp.timeout_s).
        Then frees the KV cache and the CUDA graphs (a closed engine's memory is the GPU's again, though
        the caller still holds it: a second engine in one process had found the first one's cache in use)."""
        self._closed = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, self.tp.timeout_s if self.is_follower else None)
        if self._thread.is_alive():
            return
        if self.tp is not None:
            self.release_group()
        else:
            self.runner.free_kv_cache()

    def release_group(self) -> None:
        """Drops the CUDA graphs (they hold the group's captured collectives), then ends the group."""
        self.runner.free_kv_cache()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.tp.close()

    def follow(self) -> bool:
        """A follower: blocks until its leader closes (True), or it cannot follow any more (False: the
        leader is silent or gone, or a message failed here)."""
        self._thread.join()
        return not self.follower.lost_leader

    # --- observability -------------------------------------------------------------------------------
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished() + self._inbox.qsize()

    def stats(self) -> dict[str, float]:
        counters, times = self.scheduler.counters, self.runner.times
        return {
            "engine/num_running": len(self.scheduler.running),
            "engine/num_waiting": len(self.scheduler.waiting) + self._inbox.qsize(),
            "engine/kv_blocks_used": self.blocks.num_blocks - self.blocks.num_free_blocks,
            "engine/kv_blocks_total": self.blocks.num_blocks,
            "engine/num_prefill_tokens": counters.num_prefill_tokens,
            "engine/num_prefix_hit_tokens": counters.num_prefix_hit_tokens,
            "engine/num_decode_tokens": counters.num_decode_tokens,
            "engine/num_preemptions": counters.num_preemptions,
            "engine/num_ahead_steps": counters.num_ahead_steps,
            "engine/num_steps": times.num_steps,
            "engine/prepare_s": times.prepare_s,
            "engine/device_wait_s": times.device_wait_s,
            "engine/gpu_s": times.gpu_s,
            "engine/num_prefill_steps": times.num_prefill_steps,
            "engine/prefill_s": times.prefill_s,
            "engine/prefill_gpu_s": times.prefill_gpu_s,
            "engine/decode_gpu_s": times.decode_gpu_s,
            "engine/schedule_s": times.schedule_s,
            "engine/postprocess_s": times.postprocess_s,
            "engine/version": self.version,
        }

    # --- the engine thread ---------------------------------------------------------------------------
    def _on_device(self) -> contextlib.AbstractContextManager:
        """Makes the engine's GPU current in the calling thread (it may be another than the trainer's, e.g. cuda:1)."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _loop(self) -> None:
        with self._on_device():
            self._run_loop()

    def _run_loop(self) -> None:
        idle_s = HEARTBEAT_S if self.tp is not None else None  # a follower hears from its leader at least this often
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._num_exclusive == 0)
            with self._step_lock, self._delivering():
                events, closed = self._take_inbox(), self._closed  # read once: close() may flip it meanwhile
                self._apply(events)
                # after a level-2 sleep nothing runs until every weight is back (never a step on zeros)
                run = not closed and self.residency.ready and self.scheduler.num_unfinished() > 0
                if self.tp is not None:
                    self.tp.send(("tick", [to_wire(event) for event in events], run, closed))
                if closed:
                    self._fail_all(RuntimeError("the engine was closed"))
                    return
                if run:
                    self._guarded(self.step)
            if not run:
                self._wake.wait(idle_s)
                self._wake.clear()

    def _guarded(self, work: Callable[[], None]) -> None:
        try:
            work()
        except Exception as error:  # noqa: BLE001 - a failed step fails the request behind it, not the engine
            self._ahead = None
            self.runner.state.invalidate()
            self.blocks.reset_prefix_cache()  # blocks hashed at admission may never have been written
            self._isolate_failure(error)

    def _isolate_failure(self, error: Exception) -> None:
        """A step with one sequence (or one that has failed MAX_FAILED_STEPS steps) fails it; a step
        with several sends them back to wait, each to be prefilled alone (module docstring)."""
        suspects = [seq for seq in dict.fromkeys(self._in_step) if seq.status is not Status.FINISHED]
        if not suspects:  # not attributable to a request (scheduling itself raised): nothing to retry
            log.exception("engine step failed outside any request; failing the requests in flight")
            self._fail_all(error)
            return
        for seq in suspects:
            seq.num_failed_steps += 1
        guilty = [seq for seq in suspects if len(suspects) == 1 or seq.num_failed_steps >= MAX_FAILED_STEPS]
        log.warning("engine step of %d requests failed (%s: %s); failing %d, retrying %d alone", len(suspects),
                    type(error).__name__, error, len(guilty), len(suspects) - len(guilty), exc_info=bool(guilty))
        for seq in guilty:
            self.scheduler.abort(seq)
            self._streaming.discard(seq)
            seq.on_finish(error)
        self.scheduler.isolate([seq for seq in suspects if seq not in guilty])

    def step(self) -> None:
        if self._ahead is not None:
            batch, launched, version = self._ahead
            self._ahead = None
            self._in_step = batch.seqs
        else:
            self._in_step = []
            batch = self._timed(self.scheduler.schedule)
            if batch is None:
                return
            self._in_step = batch.seqs
            launched, version = self.runner.launch(batch), self.version
        ahead = self._timed(self.scheduler.schedule_ahead, batch) if self.overlap else None
        if ahead is not None:
            if ahead.is_prefill:  # other sequences than batch's: a failure from here on may be theirs
                self._in_step = batch.seqs + ahead.seqs
            self._ahead = (ahead, self.runner.launch(ahead), self.version)
        self._finish(batch, launched, version)

    def _timed(self, schedule: Callable[..., ScheduledBatch | None], *args) -> ScheduledBatch | None:
        """`schedule(*args)`, its time counted as scheduling (launches count as `prepare`)."""
        start = time.perf_counter()
        try:
            return schedule(*args)
        finally:
            self.runner.times.schedule_s += time.perf_counter() - start

    def _finish_ahead(self) -> None:
        """The look-ahead step in flight, if any, waited for and its tokens appended."""
        if self._ahead is not None:
            batch, launched, version = self._ahead
            self._ahead = None
            self._in_step = batch.seqs
            self._finish(batch, launched, version)

    def _finish(self, batch: ScheduledBatch, launched: Launched, version: int) -> None:
        """Waits for a launched step; appends its tokens, tagged with the version it was launched under."""
        token_ids, logprobs = self.runner.wait(launched)
        start = time.perf_counter()
        times = self.runner.times
        live = [seq.status is not Status.FINISHED for seq in batch.seqs]  # rows postprocess keeps
        finished = self.scheduler.postprocess(
            batch, token_ids, logprobs, version, self.runner.top_logprobs(launched), self.runner.routes(launched), self.runner.floors(launched)
        )
        if self._streaming:  # before the completions: a stream sees every token, then the end
            for seq, token_id, kept in zip(batch.seqs, token_ids, live):
                if kept and seq.on_token is not None:
                    seq.on_token(token_id)
            self._streaming.difference_update(finished)
        for seq in finished:
            seq.on_finish(seq.completion())
        if batch.is_prefill:  # an isolated sequence whose own step succeeded is cleared
            for seq in batch.seqs:
                seq.isolated = False
        times.postprocess_s += time.perf_counter() - start

    def _take_inbox(self) -> list[tuple[str, Any]]:
        events = []
        while True:
            try:
                events.append(self._inbox.get_nowait())
            except queue.Empty:
                return events

    def _apply(self, events: list[tuple[str, Any]]) -> None:
        for kind, seq in events:
            if kind == "add_many":
                for one in seq:
                    self.scheduler.add(one)
                self._streaming.update(one for one in seq if one.on_token is not None)
            elif seq is not None and self.scheduler.abort(seq):
                self._streaming.discard(seq)
                seq.on_finish(seq.completion())

    def _fail_all(self, error: Exception) -> None:
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            self.scheduler.finish(seq, "abort")
            seq.on_finish(error)
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()
        self._streaming.clear()

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        with self._cond:
            self._num_exclusive += 1
        try:
            with self._step_lock, self._on_device(), self._delivering():
                self._guarded(self._finish_ahead)
                yield
        finally:
            with self._cond:
                self._num_exclusive -= 1
                self._cond.notify_all()
            self._wake.set()

    @contextlib.contextmanager
    def _delivering(self) -> Iterator[None]:
        """Hands the outbox's results to their loops when the block ends (however it ends)."""
        try:
            yield
        finally:
            self._outbox.flush()

    # --- validation ---------------------------------------------------------------------------------
    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        vocab_size = self.runner.vocab_size  # a plain int: model.config's goes through transformers' __getattribute__
        if not prompt_ids:
            raise ValueError("empty prompt: pass at least one token id")
        if out_of_range(prompt_ids, vocab_size):
            raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) exceeds max_model_len {self.max_model_len}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass one to the engine or use stop_token_ids")
        # windowed models too: a (re-)admitted sequence prefills its whole context in one step, every block at once
        if self.blocks.num_blocks_for(len(prompt_ids) + params.max_tokens) > self.blocks.num_blocks:
            raise ValueError("the request does not fit in the KV cache; raise --kv_cache_tokens or --gpu_memory_utilization")

