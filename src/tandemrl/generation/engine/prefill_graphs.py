"""CUDA graphs of the 16-bit GPU prefill's forward, one per padded row count (runner.padded_num_tokens).

Legend: N rows of the step (padded), B sequences that compute, R = max_num_seqs, M blocks per sequence, E hidden.

An eager prefill launches ~200 kernels from Python, holding the GIL the event loop needs at a multi-turn
boundary; a replay launches them in one call (launch host time: bench/RESULTS.md, bench/prefill.py). A large
prefill is bound by the device either way (the kernels of an eager launch start while it goes on); smaller
prefills, host-bound, gain the most. What varies between steps goes through static device buffers: token ids [N], query and
context lengths [R] (zero queries past the step's B sequences) and block tables [R, M]; positions, cache
slots and the paged kernel's query tiles are computed inside the graph from them, at fixed shapes (the
tile grid is sized for R sequences; a padded row sits at position 0 and writes the scratch slot). The
graph's output is the hidden state of each sequence's last row, [R, E]; the runner computes logits and
samples from its first B rows, eagerly.

A row count is captured at its second use after the cache was allocated (its first runs eagerly, as
without graphs, so one that recurs seldom costs no capture); the use that captures runs the same
computation eagerly first, on the same buffers, so kernels are compiled and cuBLAS has picked its
algorithms before the capture, and its results are that step's. Every graph shares one memory pool
(steps never overlap on the device: one stream) and is dropped with the KV cache, whose addresses it
holds. Capture records work without running it, on a side stream, in the thread-local mode: another
thread's CUDA calls (a colocated trainer's under --max_staleness > 0) are not refused meanwhile. A capture
that fails anyway is logged once and leaves that row count eager.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from tandemrl.generation.engine.layers.attention import PagedPrefillMetadata, prefill_tiles

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefillGraphs:
    """The static buffers, the graphs by row count and the use counts (written by the runner's thread)."""

    ids: Tensor  # [N max] int64
    query_lens: Tensor  # [R] int64
    context_lens: Tensor  # [R] int64
    block_tables: Tensor  # [R, M] int64
    block_size: int
    tile_queries: int
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = field(default_factory=dict)  # N -> (graph, its [R, E] output)
    uses: dict[int, int] = field(default_factory=dict)  # N -> prefills of that row count since the cache was allocated
    refused: set[int] = field(default_factory=set)  # row counts whose capture failed: eager from then on
    pool: tuple | None = None
    stream: torch.cuda.Stream | None = None

    @classmethod
    def allocate(cls, *, max_rows: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int, tile_queries: int, device: torch.device) -> PrefillGraphs:
        def zeros(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(ids=zeros(max_rows), query_lens=zeros(max_num_seqs), context_lens=zeros(max_num_seqs),
                   block_tables=zeros(max_num_seqs, max_blocks_per_seq), block_size=block_size, tile_queries=tile_queries)  # fmt: skip

    def load(self, ids: Tensor, query_lens: Tensor, context_lens: Tensor, block_tables: Tensor) -> None:
        """This step's inputs (on the device) into the static buffers, in stream order (a step in flight
        read the last ones before these copies run)."""
        num_seqs, width = block_tables.shape
        self.ids[: len(ids)].copy_(ids)
        self.query_lens[:num_seqs].copy_(query_lens)
        self.query_lens[num_seqs:].zero_()
        self.context_lens[:num_seqs].copy_(context_lens)
        self.block_tables[:num_seqs, :width].copy_(block_tables)

    def forward(self, model, num_rows: int) -> Tensor:
        """The step's [R, E] last-row hidden states: a replay of row count num_rows's graph; without one,
        eagerly, and at that row count's second use its graph is captured after."""
        held = self.graphs.get(num_rows)
        if held is not None:
            held[0].replay()
            return held[1]
        out = self._body(model, num_rows)
        self.uses[num_rows] = self.uses.get(num_rows, 0) + 1
        if self.uses[num_rows] >= 2 and num_rows not in self.refused:
            try:
                self._capture(model, num_rows)
            except Exception as error:  # noqa: BLE001 - the step's result is computed already; this count stays eager
                self.refused.add(num_rows)
                log.warning("prefill graph of %d rows not captured (%s: %s); prefills of that size run eagerly", num_rows, type(error).__name__, error)
        return out

    def clear(self) -> None:
        self.graphs.clear()
        self.uses.clear()
        self.refused.clear()
        self.pool = None

    def _capture(self, model, num_rows: int) -> None:
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:
                out = self._body(model, num_rows)
            finally:
                graph.capture_end()
        self.graphs[num_rows] = (graph, out)

    def _body(self, model, num_rows: int) -> Tensor:
        positions, meta = self.metadata(num_rows)
        hidden = model(self.ids[:num_rows], positions, meta)  # [N, E]
        return hidden[meta.cu_seq_q[1:].to(torch.int64) - 1]  # [R, E]: a sequence without queries reads row N - 1

    def metadata(self, num_rows: int) -> tuple[Tensor, PagedPrefillMetadata]:
        """Positions [N] and the paged kernel's metadata from the static buffers, at fixed shapes: row r
        belongs to the first sequence whose queries end past it; rows past the last query are padding."""
        qlens, lens, tables, size, tile = self.query_lens, self.context_lens, self.block_tables, self.block_size, self.tile_queries
        num_seqs = len(qlens)
        ends = torch.cumsum(qlens, 0)  # [R]
        rows = torch.arange(num_rows, device=qlens.device)
        owner = torch.searchsorted(ends, rows, right=True).clamp(max=num_seqs - 1)  # [N]
        real = rows < ends[-1]
        positions = torch.where(real, lens[owner] - (ends[owner] - rows), 0)
        slots = torch.where(real, tables[owner, positions // size] * size + positions % size, 0)
        tile_seqs, tile_starts = prefill_tiles(qlens, num_rows, tile)
        meta = PagedPrefillMetadata(
            slot_mapping=slots,
            cu_seq_q=F.pad(ends, (1, 0)).to(torch.int32),
            context_lens=lens.to(torch.int32),
            block_tables=tables,
            tile_seqs=tile_seqs,
            tile_starts=tile_starts,
            block_size=size,
            tile_queries=tile,
            num_queries=None,  # not known on the host: the kernel's output starts as zeros (padded rows stay 0)
        )
        return positions, meta
