"""The decode batch's inputs, kept on the device between steps, so a steady decode step builds nothing.

Legend: R rows (the largest decode batch), B sequences of the step, M blocks per sequence, V vocab.

Invariant: while `valid`, rows [0, B) hold the inputs of the next decode step of `seqs` (in order):
the step itself (inside the CUDA graph) writes its sampled tokens into `input_ids` and advances
`positions` and `context_lens` of the active rows, and the host only writes the block-table entries
of sequences that took a new block. Any other change (a sequence joined, finished, was preempted or
aborted; a prefill ran; graphs were captured; a step failed) rewrites every row from the host.
Padded rows (active 0) sit at position 0 of the scratch block 0 and never advance.
"""

from __future__ import annotations

import array
import operator

import torch
from torch import Tensor

from tandemrl.generation.engine.layers.attention import DecodeMetadata, GatherMetadata, decode_gather_metadata, int_tensor, padded_tables
from tandemrl.generation.engine.layers.sampler import SamplingTensors, row_keys, sampling_rows
from tandemrl.generation.engine.sequence import Sequence

# rows of the packed int64 state; one packed tensor so a rebuild is one host-to-device copy
IDS, POSITIONS, LENS, SEEDS, ACTIVE, TOP_K = range(6)


class DecodeState:
    """Persistent device tensors of the decode batch plus the host's record of what they hold."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int, vocab_size: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.vocab_size = vocab_size
        self.ints = torch.zeros((6, max_rows), dtype=torch.int64, device=device)
        self.floats = torch.zeros((3, max_rows), dtype=torch.float32, device=device)  # temperature, top_p, min_p
        self.block_tables = torch.zeros((max_rows, max_blocks_per_seq), dtype=torch.int32, device=device)
        # host staging; reused every rebuild, safe because a rebuild launches only when no step is in flight
        # (the engine's look-ahead step continues an unchanged batch, which never rebuilds)
        self._host_ints = torch.zeros(6 * max_rows, dtype=torch.int64, pin_memory=pin)
        self._host_floats = torch.zeros(3 * max_rows, dtype=torch.float32, pin_memory=pin)
        self._host_tables = torch.zeros(max_rows * max_blocks_per_seq, dtype=torch.int32, pin_memory=pin)
        self.seqs: list[Sequence] = []
        self.num_table_entries: list[int] = []  # [B] block-table entries already on the device
        self.rows = 0
        self.needs_filter = False
        self.valid = False
        self.reset()

    @property
    def input_ids(self) -> Tensor:
        return self.ints[IDS]

    @property
    def positions(self) -> Tensor:
        return self.ints[POSITIONS]

    def reset(self) -> None:
        """Every row padded (graph capture runs on this); forgets the batch."""
        top_k, floats, _ = sampling_rows([], self.vocab_size, pad=self.ints.shape[1])
        self.ints.zero_()
        self.ints[LENS] = 1
        self.ints[TOP_K] = torch.tensor(top_k)
        self.floats.copy_(torch.tensor(floats, dtype=torch.float32))
        self.block_tables.zero_()
        self.valid = False

    def load(self, seqs: list[Sequence], rows: int) -> None:
        """Makes rows [0, rows) hold the next decode step's inputs of `seqs`; rows >= len(seqs)."""
        unchanged = self.valid and rows == self.rows and len(seqs) == len(self.seqs) and all(map(operator.is_, seqs, self.seqs))
        self.valid = False  # until the step has advanced the state (advanced())
        if unchanged:
            self._write_new_blocks()
        else:
            self._write_all(seqs, rows)

    def advanced(self) -> None:
        self.valid = True

    def invalidate(self) -> None:
        self.valid = False

    def _write_new_blocks(self) -> None:
        """Only block-table entries added since the last step cross to the device (a new block every
        block_size steps per sequence)."""
        rows, cols, blocks = [], [], []
        for i, seq in enumerate(self.seqs):
            have, table = self.num_table_entries[i], seq.block_table
            if len(table) != have:
                rows += [i] * (len(table) - have)
                cols += range(have, len(table))
                blocks += table[have:]
                self.num_table_entries[i] = len(table)
        if rows:
            index = torch.tensor([rows, cols, blocks]).to(self.ints.device, non_blocking=True)  # [3, new]
            self.block_tables.index_put_((index[0], index[1]), index[2].to(torch.int32))

    def _write_all(self, seqs: list[Sequence], rows: int) -> None:
        pad = rows - len(seqs)
        top_k, floats, self.needs_filter = sampling_rows([s.params for s in seqs], self.vocab_size, pad=pad)
        ints = array.array("q", [s.token_ids[-1] for s in seqs])
        for row in ([0] * pad, [s.num_tokens - 1 for s in seqs], [0] * pad, [s.num_tokens for s in seqs], [1] * pad,
                    [s.seed for s in seqs], [0] * pad, [1] * len(seqs), [0] * pad, top_k):  # fmt: skip
            ints.extend(row)
        _stage(self._host_ints, int_tensor(ints).view(6, rows), self.ints[:, :rows])
        _stage(self._host_floats, torch.tensor(floats, dtype=torch.float32), self.floats[:, :rows])
        self._write_tables(seqs, rows)
        self.seqs, self.rows = list(seqs), rows

    def _write_tables(self, seqs: list[Sequence], rows: int) -> None:
        # columns past a sequence's table are never read (bounded by its context length), so only the
        # widest table's columns are written; a padded row's column 0 must be the scratch block 0
        self.num_table_entries = [len(s.block_table) for s in seqs]
        width = max(self.num_table_entries, default=1) or 1
        tables = padded_tables([s.block_table for s in seqs] + [[0]] * (rows - len(seqs)), torch.int32) if rows else torch.zeros(0, width, dtype=torch.int32)
        _stage(self._host_tables, tables, self.block_tables[:rows, : tables.shape[1]])

    # --- read inside the step (and captured in the CUDA graph) ---------------------------------------
    def metadata(self, rows: int, block_size: int, *, gather: bool) -> GatherMetadata | DecodeMetadata:
        """Attention metadata of rows [0, rows); each row's slot comes from its table and position."""
        positions, tables, lens = self.ints[POSITIONS, :rows], self.block_tables[:rows], self.ints[LENS, :rows]
        blocks = tables.gather(1, (positions // block_size)[:, None])[:, 0].to(torch.int64)
        slots = blocks * block_size + positions % block_size  # [rows]
        if gather:  # the pure-PyTorch path (CPU): gather each row's context
            return decode_gather_metadata(tables, lens, slots, block_size)
        # int32 lengths: the Triton decode kernel is tested (tests/gpu) with int32 lengths
        return DecodeMetadata(slot_mapping=slots, block_tables=tables, context_lens=lens.to(torch.int32), block_size=block_size)

    def sampling(self, rows: int, *, needs_filter: bool, keys: Tensor | None = None) -> SamplingTensors:
        """Rows [0, rows)'s sampling tensors; the noise key of a row is (seed, position sampled)."""
        return SamplingTensors(
            temperatures=self.floats[0, :rows],
            top_k=self.ints[TOP_K, :rows],
            top_p=self.floats[1, :rows],
            min_p=self.floats[2, :rows],
            keys=row_keys(self.ints[SEEDS, :rows], self.ints[POSITIONS, :rows] + 1) if keys is None else keys,
            needs_filter=needs_filter,
        )

    def step(self, rows: int, block_size: int, *, gather: bool, needs_filter: bool) -> tuple[GatherMetadata | DecodeMetadata, SamplingTensors]:
        """metadata() and sampling() of rows [0, rows); on a GPU their slots, lengths and keys from one kernel
        (state_kernel.py) instead of ~35 torch kernels of a few rows each."""
        if gather or self.ints.device.type != "cuda":
            return self.metadata(rows, block_size, gather=gather), self.sampling(rows, needs_filter=needs_filter)
        from tandemrl.generation.engine.state_kernel import step_inputs

        tables = self.block_tables[:rows]
        slots, lens, keys = step_inputs(self.ints[POSITIONS, :rows], self.ints[LENS, :rows], self.ints[SEEDS, :rows], tables, block_size)
        meta = DecodeMetadata(slot_mapping=slots, block_tables=tables, context_lens=lens, block_size=block_size)
        return meta, self.sampling(rows, needs_filter=needs_filter, keys=keys)

    def advance(self, rows: int, token_ids: Tensor) -> None:
        """The next step's inputs of rows [0, rows): the sampled token at the next position."""
        active = self.ints[ACTIVE, :rows]
        self.ints[IDS, :rows].copy_(token_ids)
        self.ints[POSITIONS, :rows] += active
        self.ints[LENS, :rows] += active


def _stage(buffer: Tensor, values: Tensor, destination: Tensor) -> None:
    """values -> a contiguous prefix of the (pinned) host buffer -> destination, without waiting."""
    staged = buffer[: values.numel()].view(values.shape)
    staged.copy_(values)
    destination.copy_(staged, non_blocking=True)
