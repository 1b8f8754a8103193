"""Triton fused silu(gate) * up of the MLP. Imported only on CUDA; models/llama.py holds the torch path
and tests/gpu checks one against the other."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    # one block of one row of x = [gate | up]: silu(gate) rounded to the activation dtype (as torch), times up
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = col < I
    gate = tl.load(x_ptr + row * stride_x + col, mask=valid, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + col, mask=valid, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + col, (silu * up.to(tl.float32)).to(gate.dtype), mask=valid)


def silu_mul(x: Tensor) -> Tensor:
    """x [N, 2I] = [gate | up] -> silu(gate) * up [N, I], one pass."""
    rows, width = x.shape
    half = width // 2
    out = torch.empty(rows, half, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(half, block))](x, out, x.stride(0), out.stride(0), half, BLOCK=block, num_warps=4)
    return out
