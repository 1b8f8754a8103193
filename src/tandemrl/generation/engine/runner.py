"""Runs one scheduled step on the device: inputs -> model forward -> logits -> sampled tokens.

Legend: B sequences sampled, N tokens computed, L layers, S cache slots, K kv heads, D head dim, V vocab.

Owns the KV cache tensor [L, 2, S, K, D] (S = blocks * block_size). On CUDA, decode steps replay a
CUDA graph captured at the smallest bucketed batch size >= B (padded rows write into the scratch
block 0 and are discarded); prefill runs eagerly. On CPU everything is eager and pure PyTorch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from tandemrl.generation.engine.attention import AttentionMetadata, build_gather_metadata
from tandemrl.generation.engine.models import LlamaForCausalLM
from tandemrl.generation.engine.sampler import SamplingTensors, row_keys, sample
from tandemrl.generation.engine.scheduler import ScheduledBatch
from tandemrl.generation.engine.sequence import Sequence


@dataclass(slots=True)
class StepTimes:
    """Seconds spent, summed over steps: host work (inputs, bookkeeping) vs waiting for the device."""

    num_steps: int = 0
    prepare_s: float = 0.0  # building inputs on the host and launching
    device_wait_s: float = 0.0  # from the last launch until the sampled tokens are on the host
    gpu_s: float = 0.0  # device busy time from first launch to sampled tokens (CUDA events), 0 on CPU
    schedule_s: float = 0.0  # written by the engine: scheduler.schedule()
    postprocess_s: float = 0.0  # written by the engine: appending tokens, stop checks, callbacks


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, *, block_size: int, max_num_seqs: int, max_model_len: int, use_graphs: bool) -> None:
        self.model = model
        self.device = model.rope_cos_sin.device
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.vocab_size = model.config.vocab_size
        self.is_cuda = self.device.type == "cuda"
        self.use_graphs = use_graphs and self.is_cuda
        self.graph_sizes = sorted({1, 2, 4, 8, *range(16, max_num_seqs + 1, 16), max_num_seqs})
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.kv_cache: Tensor | None = None
        self.times = StepTimes()
        self._table_key: list[int] | None = None

    # --- KV cache ------------------------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int) -> None:
        config, attn = self.model.config, self.model.model.layers[0].self_attn
        shape = (config.num_hidden_layers, 2, num_blocks * self.block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.model.model.embed_tokens.weight.dtype, device=self.device)
        for layer, cache in zip(self.model.model.layers, self.kv_cache):
            layer.self_attn.k_cache, layer.self_attn.v_cache = cache[0], cache[1]
        if self.use_graphs:
            self.capture_graphs()

    def free_kv_cache(self) -> None:
        self.graphs.clear()
        for layer in self.model.model.layers:
            layer.self_attn.k_cache = layer.self_attn.v_cache = torch.empty(0)
        self.kv_cache = None
        if self.is_cuda:
            torch.cuda.empty_cache()

    def bytes_per_block(self) -> int:
        config, attn = self.model.config, self.model.model.layers[0].self_attn
        itemsize = self.model.model.embed_tokens.weight.element_size()
        return config.num_hidden_layers * 2 * self.block_size * attn.num_kv_heads * attn.head_dim * itemsize

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        offsets = torch.arange(self.block_size)
        src = torch.tensor([s for s, _ in copies])[:, None] * self.block_size + offsets  # [C, block]
        dst = torch.tensor([d for _, d in copies])[:, None] * self.block_size + offsets
        src, dst = src.flatten().to(self.device), dst.flatten().to(self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    # --- one step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[float]]:
        start = time.perf_counter()
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.is_cuda else None
        if events:
            events[0].record()
        sampling = self._sampling_tensors(batch.seqs)  # before any launch: host copies never wait on the device
        if batch.is_prefill:
            self._table_key = None  # block tables may have changed under the decode cache
            logits = self._prefill(batch)
        else:
            logits = self._decode(batch.seqs)
        token_ids, logprobs = self._sample(logits, sampling)
        if events:
            events[1].record()
        launched = time.perf_counter()
        token_list, logprob_list = token_ids.tolist(), logprobs.tolist()
        if events:
            self.times.gpu_s += events[0].elapsed_time(events[1]) / 1000
        self.times.num_steps += 1
        self.times.prepare_s += launched - start
        self.times.device_wait_s += time.perf_counter() - launched
        return token_list, logprob_list

    def _prefill(self, batch: ScheduledBatch) -> Tensor:
        computing = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens) if n > 0]
        input_ids, positions = [], []
        for seq, n in computing:
            input_ids += seq.token_ids[seq.num_tokens - n :]
            positions += range(seq.num_tokens - n, seq.num_tokens)
        meta = build_gather_metadata(
            [n for _, n in computing], [s.num_tokens for s, _ in computing], [s.block_table for s, _ in computing], self.block_size, self.device
        )
        meta.block_size = self.block_size
        ids = torch.tensor(input_ids, device=self.device)
        hidden = self.model(ids, torch.tensor(positions, device=self.device), meta)  # [N, E]
        last = torch.tensor([n for _, n in computing]).cumsum(0) - 1
        logits = self.model.compute_logits(hidden[last.to(self.device)])  # [B_computing, V]
        if batch.block_copies:
            self.copy_blocks(batch.block_copies)
        if len(computing) != len(batch.seqs):
            logits = logits[torch.tensor(batch.sample_rows, device=self.device)]
        return logits

    def _decode(self, seqs: list[Sequence]) -> Tensor:
        batch = len(seqs)
        positions = [s.num_tokens - 1 for s in seqs]
        input_ids = [s.token_ids[-1] for s in seqs]
        size = self.block_size
        slots = [s.block_table[p // size] * size + p % size for s, p in zip(seqs, positions)]
        if not self.is_cuda:
            lens = [p + 1 for p in positions]
            meta = build_gather_metadata([1] * batch, lens, [s.block_table for s in seqs], size, self.device)
            return self.model.compute_logits(self.model(torch.tensor(input_ids), torch.tensor(positions), meta))
        graph_size = next((g for g in self.graph_sizes if g >= batch), None) if self.use_graphs else None
        rows = graph_size or batch
        host = self._host_inputs[:, :rows]
        host[:, batch:] = 0
        host[3, batch:] = 1  # padded rows attend to one slot of the scratch block
        host[0, :batch] = torch.tensor(input_ids)
        host[1, :batch] = torch.tensor(positions)
        host[2, :batch] = torch.tensor(slots)
        host[3, :batch] = host[1, :batch] + 1
        self._static_inputs[:, :rows].copy_(host, non_blocking=True)
        self._static_tables[:rows].copy_(self._block_tables(seqs, rows), non_blocking=True)
        self._static_lens[:rows].copy_(self._static_inputs[3, :rows])
        if graph_size is None:
            return self._forward_decode(rows)[:batch]
        graph, logits = self.graphs[graph_size]
        graph.replay()
        return logits[:batch]

    def _forward_decode(self, rows: int) -> Tensor:
        meta = AttentionMetadata(
            slot_mapping=self._static_inputs[2, :rows],
            block_tables=self._static_tables[:rows],
            context_lens=self._static_lens[:rows],
            block_size=self.block_size,
        )
        hidden = self.model(self._static_inputs[0, :rows], self._static_inputs[1, :rows], meta)
        return self.model.compute_logits(hidden)

    def _block_tables(self, seqs: list[Sequence], rows: int) -> Tensor:
        """[rows, M] int32 on the host; rebuilt only when the batch changed, else only grown rows."""
        tables, lens = self._host_tables, self._table_lens
        key = [s.seq_id for s in seqs]
        if key != self._table_key:
            tables.zero_()
            for i, seq in enumerate(seqs):
                tables[i, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
                lens[i] = len(seq.block_table)
            self._table_key = key
        else:
            for i, seq in enumerate(seqs):
                if len(seq.block_table) != lens[i]:
                    tables[i, lens[i] : len(seq.block_table)] = torch.tensor(seq.block_table[lens[i] :], dtype=torch.int32)
                    lens[i] = len(seq.block_table)
        return tables[:rows]

    # --- CUDA graphs ---------------------------------------------------------------------------------
    def _allocate_static(self) -> None:
        max_rows = self.graph_sizes[-1]
        self._host_inputs = torch.zeros((4, max_rows), dtype=torch.int64, pin_memory=True)  # ids, pos, slots, lens
        self._host_tables = torch.zeros((max_rows, self.max_blocks_per_seq), dtype=torch.int32, pin_memory=True)
        self._table_lens = [0] * max_rows
        self._static_inputs = torch.zeros((4, max_rows), dtype=torch.int64, device=self.device)
        self._static_tables = torch.zeros((max_rows, self.max_blocks_per_seq), dtype=torch.int32, device=self.device)
        self._static_lens = torch.ones(max_rows, dtype=torch.int32, device=self.device)

    def prepare_cuda(self) -> None:
        if self.is_cuda:
            self._allocate_static()

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        self._table_key = None
        self._static_inputs.zero_()
        self._static_lens.fill_(1)
        self._static_tables.zero_()
        pool = None
        for size in reversed(self.graph_sizes):
            self._forward_decode(size)  # warm up (Triton compiles, cuBLAS picks kernels) outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward_decode(size)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    # --- sampling ------------------------------------------------------------------------------------
    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        params = [s.params for s in seqs]
        top_k = [self.vocab_size if p.top_k == -1 else p.top_k for p in params]
        needs_filter = any(p.top_p < 1.0 or p.min_p > 0.0 or p.top_k != -1 for p in params)
        keys = row_keys(torch.tensor([s.seed for s in seqs]), torch.tensor([s.num_tokens for s in seqs]))
        to = dict(device=self.device, non_blocking=True)
        return SamplingTensors(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32).to(**to),
            top_k=torch.tensor(top_k).to(**to),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32).to(**to),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32).to(**to),
            keys=keys.to(**to),
            needs_filter=needs_filter,
        )

    def _sample(self, logits: Tensor, sampling: SamplingTensors) -> tuple[Tensor, Tensor]:
        if self.is_cuda and not sampling.needs_filter:
            from tandemrl.generation.engine.triton_kernels import sample_unfiltered

            return sample_unfiltered(logits, sampling.temperatures, sampling.keys)
        return sample(logits, sampling)
