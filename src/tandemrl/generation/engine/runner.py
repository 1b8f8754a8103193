"""Runs one scheduled step on the device: inputs -> model forward -> logits -> sampled tokens.

Legend: B sequences sampled, N tokens computed, L layers, S cache slots, K kv heads, D head dim, V vocab.

Owns the KV cache tensor [L, 2, S, K, D] (S = blocks * block_size). On CUDA, decode steps replay a
CUDA graph captured at the smallest bucketed batch size >= B (padded rows write into the scratch
block 0 and are discarded); a 16-bit prefill's forward replays a graph of its padded row count once that
count has recurred (prefill_graphs.py; not under tensor parallelism), else runs eagerly. On CPU
everything is eager and pure PyTorch.
A decode step reads its inputs from the persistent DecodeState and samples inside the graph, so
the host's only per-step work is the replay and one wait for the sampled ids and logprobs.
"""

from __future__ import annotations

import array
import gc
import itertools
import operator
import time
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from tandemrl.generation.engine.layers.attention import (
    build_gather_metadata, int_tensor, paged_prefill_metadata, padded_tables, prefill_tile_queries, token_positions, varlen_metadata,
)  # fmt: skip
from tandemrl.generation.engine.decode_state import DecodeState
from tandemrl.generation.engine.prefill_graphs import PrefillGraphs
from tandemrl.generation.engine.models import LlamaForCausalLM
from tandemrl.generation.engine.layers.sampler import RepetitionPenalty, SamplingTensors, penalise, repetition_penalty, row_keys, sample, sampling_rows
from tandemrl.generation.engine.scheduler import ScheduledBatch
from tandemrl.generation.engine.sequence import Sequence


HOST = torch.device("cpu")


def padded_num_tokens(num_tokens: int) -> int:
    """The row count a GPU prefill runs its N tokens as: the next power of two up to 256, then the next
    multiple of 256. cuBLAS picks its kernels per matrix shape on the host and caches the choice, and a
    training step's prefill has an N of its own each time; padded, a run meets a few dozen shapes, so its
    launches find their kernels chosen (bench/prefill.py). The padding costs at most 255 rows of compute
    (1.6% of a 16k prefill).

    Example: 5 -> 16, 200 -> 256, 257 -> 512, 16360 -> 16384
    """
    if num_tokens <= 256:
        return max(16, 1 << (num_tokens - 1).bit_length())
    return -(-num_tokens // 256) * 256


def _tensor_fields(meta) -> dict[str, Tensor]:
    return {f.name: getattr(meta, f.name) for f in fields(meta) if isinstance(getattr(meta, f.name), Tensor)}


def to_device_packed(tensors: list[Tensor], device: torch.device, *, pin_memory: bool) -> list[Tensor]:
    """Host tensors on `device`: every integer one in a single copy (as int64, cast back there), every
    float32 one in another, each from pinned memory. A copy from pageable memory may wait for the step
    in flight (the driver stages it through a pinned buffer of its own), so a prefill launched while the
    last one runs (--overlap_prefills) would wait for it. A pinned block is not reused before its copy
    has run (torch's caching host allocator records the copy), so nothing here outlives the call.

    Example: [int32 [1, 2], float32 [0.5], int64 [[3], [4]]] -> the same values, dtypes and shapes on
    `device`, from two copies: int64 [1, 2, 3, 4] and float32 [0.5]
    """
    moved: dict[int, Tensor] = {}
    for dtypes, wire in (((torch.int64, torch.int32), torch.int64), ((torch.float32,), torch.float32)):
        group = [i for i, t in enumerate(tensors) if t.dtype in dtypes]
        if not group:
            continue
        sizes = [tensors[i].numel() for i in group]
        staged = torch.empty(sum(sizes), dtype=wire, pin_memory=pin_memory)
        torch.cat([tensors[i].reshape(-1).to(wire) for i in group], out=staged)
        for i, part in zip(group, staged.to(device, non_blocking=True).split(sizes)):
            moved[i] = part.view(tensors[i].shape).to(tensors[i].dtype)
    return [moved[i] if i in moved else t.to(device, non_blocking=True) for i, t in enumerate(tensors)]


@dataclass(slots=True)
class StepTimes:
    """Seconds spent, summed over steps: host work (inputs, bookkeeping) vs waiting for the device.
    A step's host part never waits on the device (every host-to-device copy is issued before the launch
    or without blocking), so the device's time of a step shows in device_wait_s, not prepare_s."""

    num_steps: int = 0
    prepare_s: float = 0.0  # building inputs on the host and launching
    device_wait_s: float = 0.0  # from the last launch until the sampled tokens are on the host
    gpu_s: float = 0.0  # device busy time from first launch to sampled tokens (CUDA events), 0 on CPU
    num_prefill_steps: int = 0  # of num_steps, those that computed prompt tokens
    prefill_s: float = 0.0  # wall time of those steps (prepare + wait), included in the two above
    prefill_gpu_s: float = 0.0  # of those steps, device time from the forward's launch to sampled tokens (CUDA events), 0 on CPU
    decode_gpu_s: float = 0.0  # of the other steps (decodes), gpu_s's share
    schedule_s: float = 0.0  # written by the engine: scheduler.schedule() and schedule_ahead(), launches excluded
    postprocess_s: float = 0.0  # written by the engine: appending tokens, stop checks, callbacks


@dataclass(slots=True)
class Launched:
    """A step queued on the device: where its results land (pinned host buffers on CUDA)."""

    token_ids: Tensor  # [B]
    logprobs: Tensor  # [B]
    slot: int
    is_prefill: bool
    prepare_s: float
    top: tuple[Tensor, Tensor] | None = None  # ([B, K] ids, [B, K] logprobs) when a sequence asked for top logprobs
    routes: Tensor | None = None  # [B, M, k] each row's experts per sparse layer (host), when recording routes
    floors: Tensor | None = None  # [B] each row's lowest kept tempered logit (sampler.logit_floors), when a row filters


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, *, block_size: int, max_num_seqs: int, max_model_len: int, use_graphs: bool, max_num_batched_tokens: int,
        record_routes: bool = False, filtered_graphs: bool = False,
    ) -> None:
        """filtered_graphs: decode graphs with the filtered sampler (top-k/top-p/min-p) in them, for runs whose
        requests filter (EngineSettings.decode_graphs); they also serve batches that filter nothing, more
        slowly. Plain graphs sample plainly: a batch that filters then draws again after the replay."""
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = model.rope_cos_sin.device
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.vocab_size = model.config.vocab_size
        self.is_cuda = self.device.type == "cuda"
        self.use_graphs = use_graphs and self.is_cuda
        # the 16-bit GPU prefill (metadata built on the device, padded rows); float32 (the tests' GPU-vs-CPU
        # runs) keeps the gather path
        dtype = model.model.embed_tokens.weight.dtype
        self.varlen_prefill = self.is_cuda and dtype in (torch.float16, torch.bfloat16)
        # its attention: the Triton kernel that reads the paged cache (True), or torch's flash attention over
        # each layer's context copied out of it first (False: bench/prefill.py's baseline, where torch has flash)
        self.paged_prefill = True
        self.pad_prefills = True  # varlen prefills run padded_num_tokens rows (bench/prefill.py turns it off for its baseline)
        attn = model.model.layers[0].self_attn
        self.tile_queries = prefill_tile_queries(attn.num_heads, attn.num_kv_heads, attn.head_dim)
        # graphs of the paged prefill's forward (prefill_graphs.py): padded 16-bit prefills with CUDA graphs,
        # not under tensor parallelism (a capture per rank at once, unproven); bench/prefill.py turns them off
        self.graph_prefills = self.use_graphs and self.varlen_prefill and model.tp is None
        self.prefill_graphs: PrefillGraphs | None = None
        self.graph_sizes = sorted({1, 2, 4, 8, *range(16, max_num_seqs + 1, 16), max_num_seqs})
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple]] = {}  # size -> (graph, _decode_step's outputs)
        self.filtered_graphs = filtered_graphs
        self.kv_cache: Tensor | None = None
        self.times = StepTimes()
        self.state = DecodeState(self.graph_sizes[-1], self.max_blocks_per_seq, self.vocab_size, self.device)
        self._penalised: tuple[list[Sequence], RepetitionPenalty] | None = None  # the decode batch and its seen tokens
        self._slot = 0  # two steps may be in flight (the engine launches the next before waiting): two slots
        if self.is_cuda:  # sampled ids and logprobs land here, both in one wait
            self._host_ids = torch.empty(2, self.graph_sizes[-1], dtype=torch.int64, pin_memory=True)
            self._host_logprobs = torch.empty(2, self.graph_sizes[-1], dtype=torch.float32, pin_memory=True)
            self._host_floors = torch.empty(2, self.graph_sizes[-1], dtype=torch.float32, pin_memory=True)
            # start, sampled, on host, and a prefill's forward launched (after its host-built inputs)
            self._events = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(2)]
        self.record_routes = record_routes
        if record_routes:  # routing replay: every forward writes its experts into model.routes, read per step
            if not hasattr(model, "record_routes"):
                raise ValueError(f"--routing_replay needs a mixture-of-experts model; {model.config.model_type} has no experts")
            model.record_routes(max(padded_num_tokens(max_num_batched_tokens), self.graph_sizes[-1]))
            if self.is_cuda:
                self._host_routes = torch.empty(2, *model.routes[:, : self.graph_sizes[-1]].transpose(0, 1).shape, dtype=model.routes.dtype, pin_memory=True)
        self._route_rows: list[int] | None = None  # a prefill's row of each sequence's last token (written by _prefill)

    # --- KV cache ------------------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int) -> None:
        config, attn = self.model.config, self.model.model.layers[0].self_attn
        shape = (config.num_hidden_layers, 2, num_blocks * self.block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.model.model.embed_tokens.weight.dtype, device=self.device)
        for layer, cache in zip(self.model.model.layers, self.kv_cache):
            layer.self_attn.k_cache, layer.self_attn.v_cache = cache[0], cache[1]
        if self.use_graphs:
            self.capture_graphs()
        if self.graph_prefills:
            self.prefill_graphs = PrefillGraphs.allocate(
                max_rows=padded_num_tokens(self.max_num_batched_tokens), max_num_seqs=self.max_num_seqs, max_blocks_per_seq=self.max_blocks_per_seq,
                block_size=self.block_size, tile_queries=self.tile_queries, device=self.device,
            )  # fmt: skip

    def free_kv_cache(self) -> None:
        self.graphs.clear()
        if self.prefill_graphs is not None:
            self.prefill_graphs.clear()
        self.prefill_graphs = None
        self.state.reset()
        self._penalised = None
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)
        self.kv_cache = None
        if self.is_cuda:
            torch.cuda.empty_cache()

    def bytes_per_block(self) -> int:
        config, attn = self.model.config, self.model.model.layers[0].self_attn
        itemsize = self.model.model.embed_tokens.weight.element_size()
        return config.num_hidden_layers * 2 * self.block_size * attn.num_kv_heads * attn.head_dim * itemsize

    def block_copy_slots(self, copies: list[tuple[int, int]]) -> tuple[Tensor, Tensor]:
        """(source, destination) cache slots of whole-block copies, on the host."""
        offsets = torch.arange(self.block_size)
        src = torch.tensor([s for s, _ in copies])[:, None] * self.block_size + offsets  # [C, block]
        dst = torch.tensor([d for _, d in copies])[:, None] * self.block_size + offsets
        return src.flatten(), dst.flatten()

    def copy_blocks(self, slots: tuple[Tensor, Tensor]) -> None:
        src, dst = slots
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    # --- one step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> Launched:
        """Queues the step on the device and the copy of its results to the host; returns at once on CUDA."""
        start = time.perf_counter()
        slot, self._slot = self._slot, 1 - self._slot
        if self.is_cuda:
            self._events[slot][0].record()
        if batch.is_prefill:
            self.state.invalidate()  # the decode batch changes after a prefill: rebuilt at the next decode
            self._penalised = None
            logits, sampling = self._prefill(batch, slot)
            token_ids, logprobs, floors = self._sample(logits, sampling)
        else:
            token_ids, logprobs, logits, floors = self._decode(batch.seqs)
        num_top = max(s.params.top_logprobs for s in batch.seqs)
        top = logits[: len(batch.seqs)].float().log_softmax(-1).topk(num_top, dim=-1) if num_top else None
        routes = self._step_routes(batch) if self.record_routes else None  # [B, M, k]
        if self.is_cuda:  # both results in one pinned copy each, waited for once
            self._events[slot][1].record()
            host_ids, host_logprobs = self._host_ids[slot, : len(token_ids)], self._host_logprobs[slot, : len(token_ids)]
            host_ids.copy_(token_ids, non_blocking=True)
            host_logprobs.copy_(logprobs, non_blocking=True)
            if floors is not None:
                floors = self._host_floors[slot, : len(floors)].copy_(floors, non_blocking=True)
            if routes is not None:
                routes = self._host_routes[slot, : len(routes)].copy_(routes, non_blocking=True)
            self._events[slot][2].record()
            token_ids, logprobs = host_ids, host_logprobs
        prepare = time.perf_counter() - start
        self.times.prepare_s += prepare
        return Launched(token_ids, logprobs, slot, batch.is_prefill, prepare, None if top is None else (top.indices, top.values), routes, floors)

    def _step_routes(self, batch: ScheduledBatch) -> Tensor:
        """[B, M, k] the experts of the forward row each sequence sampled from: its last token's (a prefill)
        or its only one (a decode). Queued before the next step can overwrite model.routes."""
        routes = self.model.routes  # [M, R, k]
        if not batch.is_prefill:
            return routes[:, : len(batch.seqs)].transpose(0, 1).contiguous()
        rows = self._to_device([torch.tensor(self._route_rows)])[0]
        return routes[:, rows].transpose(0, 1).contiguous()

    def routes(self, launched: Launched) -> list[bytes] | None:
        """Per row, its [M, k] experts as bytes (Completion.routes' layout); None when not recording."""
        if launched.routes is None:
            return None
        rows = launched.routes.numpy()
        return [row.tobytes() for row in rows]

    def wait(self, launched: Launched) -> tuple[list[int], list[float]]:
        """The step's only wait on the device; its sampled ids and logprobs as lists."""
        start = time.perf_counter()
        if self.is_cuda:
            events = self._events[launched.slot]
            events[2].synchronize()
            elapsed = events[0].elapsed_time(events[1]) / 1000
            self.times.gpu_s += elapsed
            if launched.is_prefill:
                self.times.prefill_gpu_s += events[3].elapsed_time(events[1]) / 1000
            else:
                self.times.decode_gpu_s += elapsed
        token_list, logprob_list = launched.token_ids.tolist(), launched.logprobs.tolist()
        waited = time.perf_counter() - start
        self.times.num_steps += 1
        self.times.device_wait_s += waited
        if launched.is_prefill:
            self.times.num_prefill_steps += 1
            self.times.prefill_s += launched.prepare_s + waited
        return token_list, logprob_list

    def _prefill(self, batch: ScheduledBatch, slot: int) -> tuple[Tensor, SamplingTensors]:
        """Launches the forward of the new tokens; returns the logits each sequence samples from and its
        sampling tensors. Every input crosses to the device before the launch, in _to_device's copies; on
        the varlen path only token ids, lengths and block tables cross: positions and the attention
        metadata ([N] and [sum C] slots) are computed there (built on the host, they were tensor ops over every
        context position: ~80k of them in a prefill of 256 next turns)."""
        computing = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens) if n > 0]
        query_lens, context_lens = [n for _, n in computing], [s.num_tokens for s, _ in computing]
        if self.record_routes:  # each sequence's last new token's row, through sample_rows when some compute nothing
            ends = list(itertools.accumulate(query_lens, initial=-1))[1:]
            self._route_rows = [ends[r] for r in batch.sample_rows] if len(computing) != len(batch.seqs) else ends
        tables = [s.block_table for s, _ in computing]
        meta = None if self.varlen_prefill else build_gather_metadata(query_lens, context_lens, tables, self.block_size, HOST)
        sampling = self._sampling_tensors(batch.seqs)
        num_tokens = sum(query_lens)
        padding = padded_num_tokens(num_tokens) - num_tokens if self.varlen_prefill and self.pad_prefills else 0
        ids = array.array("q")
        for seq, n in computing:
            ids.extend(seq.token_ids[seq.num_tokens - n :])
        ids.extend([0] * padding)
        inputs = {"ids": int_tensor(ids), "qlens": int_tensor(query_lens), "lens": int_tensor(context_lens)}
        if self.varlen_prefill:
            inputs["tables"] = padded_tables(tables)
        if len(computing) != len(batch.seqs):
            inputs["rows"] = torch.tensor(batch.sample_rows)
        if batch.block_copies:
            inputs["copy_src"], inputs["copy_dst"] = self.block_copy_slots(batch.block_copies)
        meta_fields, sampling_fields = _tensor_fields(meta) if meta is not None else {}, _tensor_fields(sampling)
        moved = iter(self._to_device([*inputs.values(), *meta_fields.values(), *sampling_fields.values()]))
        inputs = {k: next(moved) for k in inputs}
        meta_fields = {k: next(moved) for k in meta_fields}
        sampling = replace(sampling, **{k: next(moved) for k in sampling_fields})
        if self.is_cuda:
            self._events[slot][3].record()
        if self.graph_prefills and self.prefill_graphs is not None and self.varlen_prefill and self.paged_prefill and self.pad_prefills:
            # the forward replayed from its row count's graph, or run on the graphs' buffers (prefill_graphs.py)
            self.prefill_graphs.load(inputs["ids"], inputs["qlens"], inputs["lens"], inputs["tables"])
            last = self.prefill_graphs.forward(self.model, num_tokens + padding)[: len(computing)]  # [B_computing, E]
        else:
            last = self._forward_eagerly(inputs, meta, meta_fields, query_lens, context_lens, padding)
        logits = self.model.compute_logits(last)  # [B_computing, V]: each sequence's last token's
        if batch.block_copies:
            self.copy_blocks((inputs["copy_src"], inputs["copy_dst"]))
        return (logits[inputs["rows"]] if "rows" in inputs else logits), sampling

    def _forward_eagerly(self, inputs: dict[str, Tensor], meta, meta_fields: dict[str, Tensor], query_lens: list[int], context_lens: list[int], padding: int) -> Tensor:
        """The prefill's forward launched op by op; the hidden state of each sequence's last token [B_computing, E]."""
        qlens, lens, num_tokens = inputs["qlens"], inputs["lens"], sum(query_lens)
        positions = token_positions(qlens, lens, num_tokens)  # [N]
        if meta is None and self.paged_prefill:
            meta = paged_prefill_metadata(qlens, lens, inputs["tables"], positions, self.block_size, tile_queries=self.tile_queries)
        elif meta is None:
            meta = varlen_metadata(qlens, lens, inputs["tables"], positions, self.block_size, max_q=max(query_lens), max_k=max(context_lens), num_keys=sum(context_lens))
        else:
            meta = replace(meta, **meta_fields)
        if padding:  # padded rows sit at position 0 and write their KV into slot 0 (the scratch block's)
            positions, meta.slot_mapping = F.pad(positions, (0, padding)), F.pad(meta.slot_mapping, (0, padding))
        hidden = self.model(inputs["ids"], positions, meta)  # [N (+ padding), E]
        return hidden[torch.cumsum(qlens, 0) - 1]

    def _to_device(self, tensors: list[Tensor]) -> list[Tensor]:
        return to_device_packed(tensors, self.device, pin_memory=True) if self.is_cuda else tensors

    def floors(self, launched: Launched) -> list[float] | None:
        """Per row, the lowest tempered logit its filters kept (-inf: none filtered); None when no row
        filters. Read after `wait`."""
        return None if launched.floors is None else launched.floors.tolist()

    def top_logprobs(self, launched: Launched) -> list[dict[int, float]] | None:
        """Per row, the most likely tokens of the model's own distribution (before temperature and
        filters, as vLLM reports them) and their logprobs, best first; None when no row asked."""
        if launched.top is None:
            return None
        ids, values = (t.tolist() for t in launched.top)
        return [dict(zip(row_ids, row_values)) for row_ids, row_values in zip(ids, values)]

    def _decode(self, seqs: list[Sequence]) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        batch, state = len(seqs), self.state
        graph_size = next((g for g in self.graph_sizes if g >= batch), None) if self.use_graphs else None
        state.load(seqs, graph_size or batch)
        penalty = self._decode_penalty(seqs, graph_size or batch)
        if graph_size is None:
            token_ids, logprobs, logits, _, floors = self._decode_step(batch, needs_filter=state.needs_filter, penalty=penalty)
        else:
            graph, (token_ids, logprobs, logits, sampling, floors) = self.graphs[graph_size]
            graph.replay()
            if (state.needs_filter and not self.filtered_graphs) or penalty is not None:  # resample these rows, fix their next input
                token_ids, logprobs, floors = self._sample(logits, replace(sampling, needs_filter=state.needs_filter, penalty=penalty))
                state.input_ids[:batch].copy_(token_ids[:batch])
            elif not state.needs_filter:  # a filtered graph's floors of rows that filter nothing: not asked for
                floors = None
        state.advanced()
        return token_ids[:batch], logprobs[:batch], logits[:batch], None if floors is None else floors[:batch]

    def _decode_penalty(self, seqs: list[Sequence], rows: int) -> RepetitionPenalty | None:
        """The decode batch's repetition penalty (None when no row has one). Built from the host's token
        lists when the batch changes; while it stays, a step only marks its input tokens (last step's
        samples, which the host may not have read yet: the look-ahead), so a steady step costs O(B)."""
        if all(s.params.repetition_penalty == 1.0 for s in seqs):
            self._penalised = None
            return None
        last_ids = self.state.input_ids[: len(seqs)]
        if self._penalised is not None:
            held, penalty = self._penalised
            if len(held) == len(seqs) and penalty.seen.shape[0] == rows and all(map(operator.is_, seqs, held)):
                penalty.seen[torch.arange(len(seqs), device=self.device), last_ids] = True
                return penalty
        penalties = [s.params.repetition_penalty for s in seqs]
        penalty = repetition_penalty([s.token_ids for s in seqs], penalties, self.vocab_size, self.device, last_ids=last_ids, pad=rows - len(seqs))
        self._penalised = (list(seqs), penalty)
        return penalty

    def _decode_step(
        self, rows: int, *, needs_filter: bool, penalty: RepetitionPenalty | None = None
    ) -> tuple[Tensor, Tensor, Tensor, SamplingTensors, Tensor | None]:
        """One decode step of state rows [0, rows), all on the device (this is what a graph captures):
        forward, sample, and advance the state to the next step's inputs."""
        state = self.state
        meta, sampling = state.step(rows, self.block_size, gather=not self.is_cuda, needs_filter=needs_filter)
        logits = self.model.compute_logits(self.model(state.input_ids[:rows], state.positions[:rows], meta))  # [rows, V]
        sampling = replace(sampling, penalty=penalty)
        token_ids, logprobs, floors = self._sample(logits, sampling)
        state.advance(rows, token_ids)
        return token_ids, logprobs, logits, sampling, floors

    # --- CUDA graphs ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Decode graphs of every size in graph_sizes. Python's garbage collector is off meanwhile, and the
        capture is thread-local: an earlier engine's graphs, freed by a collection or by another thread in
        the middle of a capture, once invalidated it on an H200 (bench/engine.py building one engine after
        another: "operation not permitted when stream is capturing")."""
        self.state.reset()
        pool = None
        collecting = gc.isenabled()
        gc.collect()
        gc.disable()
        try:
            for size in reversed(self.graph_sizes):
                self._decode_step(size, needs_filter=self.filtered_graphs)  # warm up (Triton compiles, cuBLAS picks kernels) outside the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    outputs = self._decode_step(size, needs_filter=self.filtered_graphs)
                pool = graph.pool()
                self.graphs[size] = (graph, outputs)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize()
        self.state.reset()  # the warm-ups wrote sampled ids into the padded rows

    # --- sampling ------------------------------------------------------------------------------------
    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """A prefill's sampling tensors on the host (the runner moves them with the step's other inputs);
        a repetition penalty's on the device."""
        top_k, floats, needs_filter = sampling_rows([s.params for s in seqs], self.vocab_size)
        keys = row_keys(torch.tensor([s.seed for s in seqs]), torch.tensor([s.num_tokens for s in seqs]))
        temperatures, top_p, min_p = torch.tensor(floats, dtype=torch.float32)
        penalty = repetition_penalty([s.token_ids for s in seqs], [s.params.repetition_penalty for s in seqs], self.vocab_size, self.device)
        return SamplingTensors(
            temperatures=temperatures, top_k=torch.tensor(top_k), top_p=top_p, min_p=min_p, keys=keys, needs_filter=needs_filter, penalty=penalty
        )  # fmt: skip

    def _sample(self, logits: Tensor, sampling: SamplingTensors) -> tuple[Tensor, Tensor, Tensor | None]:
        """(token_ids, logprobs, floors) [B]: what every sampling path returns (floors None when no row filters).
        On CUDA the Triton kernels (sampler_kernel.py): filters as thresholds searched without a sort, a
        repetition penalty applied first; elsewhere sampler.sample."""
        if not self.is_cuda:
            return sample(logits, sampling)
        from tandemrl.generation.engine.layers.sampler_kernel import sample_filtered, sample_unfiltered

        if sampling.penalty is not None:
            logits = penalise(logits.float(), sampling.penalty)
        if sampling.needs_filter:
            return sample_filtered(logits, sampling.temperatures, sampling.top_k, sampling.top_p, sampling.min_p, sampling.keys)
        return (*sample_unfiltered(logits, sampling.temperatures, sampling.keys), None)
