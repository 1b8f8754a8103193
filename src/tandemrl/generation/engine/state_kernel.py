"""One Triton launch for a decode step's per-row inputs, the GPU form of decode_state.py's `metadata` and
`sampling` keys: each row's cache slot (from its block table and position), its context length as int32,
and its noise key (sampler.row_keys of its seed and the position sampled). In torch these are ~35 kernels
of a few rows each, every step (~2 us each inside a CUDA graph); here one. Imported only on CUDA; tests
check it against the torch forms in triton's interpreter and on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandemrl.generation.engine.layers.sampler_kernel import mix32


@triton.jit
def _step_inputs_kernel(
    positions_ptr, lens_ptr, seeds_ptr, tables_ptr, slots_ptr, lens32_ptr, keys_ptr, rows, stride_t,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * TILE + tl.arange(0, TILE)
    valid = r < rows
    position = tl.load(positions_ptr + r, mask=valid, other=0)
    block = tl.load(tables_ptr + r * stride_t + position // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    tl.store(slots_ptr + r, block * BLOCK_SIZE + position % BLOCK_SIZE, mask=valid)
    tl.store(lens32_ptr + r, tl.load(lens_ptr + r, mask=valid, other=1).to(tl.int32), mask=valid)
    seed = tl.load(seeds_ptr + r, mask=valid, other=0)
    tl.store(keys_ptr + r, mix32((mix32(seed) + (position + 1) * 0x9E3779B9) & 0xFFFFFFFF), mask=valid)


def step_inputs(positions: Tensor, lens: Tensor, seeds: Tensor, tables: Tensor, block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """positions, lens, seeds [R] int64 (contiguous), tables [R, M] int32 -> (slots [R] int64: the cache slot
    of each row's position, lens [R] int32, keys [R] int64: the noise key of the position after it)."""
    rows = positions.shape[0]
    slots = torch.empty(rows, dtype=torch.int64, device=positions.device)
    lens32 = torch.empty(rows, dtype=torch.int32, device=positions.device)
    keys = torch.empty(rows, dtype=torch.int64, device=positions.device)
    tile = 128
    _step_inputs_kernel[(triton.cdiv(rows, tile),)](
        positions, lens, seeds, tables, slots, lens32, keys, rows, tables.stride(0), BLOCK_SIZE=block_size, TILE=tile, num_warps=4
    )  # fmt: skip
    return slots, lens32, keys
