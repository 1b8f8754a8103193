"""Triton grouped GEMMs of the mixture-of-experts MLP (moe.py holds the torch reference; tests/gpu checks
one against the other). Imported only on CUDA.

Legend: N tokens, E hidden size, X experts, I expert width, k experts per token, S = N * k (token, expert)
pairs, M rows of a tile.

`align` sorts the pairs by expert and pads each expert's run to a multiple of M, so every tile of M rows
belongs to one expert; `_grouped_gemm` then multiplies each tile by its expert's weight. Every size is a
function of N alone (the padded length is bounded by S + X * (M - 1), tiles past the true end exit at
once), so nothing waits on the device: a decode step is captured in a CUDA graph whole. Each pair's output
lands in its own row and the k rows of a token are summed after the down projection (no atomics, so the
result does not depend on scheduling).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandemrl.generation.engine.layers.activation import silu_mul


def align(ids: Tensor, num_experts: int, block_m: int) -> tuple[Tensor, Tensor, Tensor]:
    """(pair of each padded row [R] (S where padding), expert of each tile [R / M] (X past the end),
    padded length [1]), R = S + X * (M - 1) rounded up to M; device ops only, no sync.

    Example: ids [[1], [0], [1]] (S 3), X 2, M 2 -> pairs [1, 3, 0, 2, 3, 3], tile experts [0, 1, 2], length [4]
    """
    flat = ids.flatten()  # [S]
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [X]
    ends = torch.cumsum(padded, 0)  # [X]
    order = torch.argsort(flat, stable=True)  # [S] pairs grouped by expert
    experts = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (torch.cumsum(counts, 0) - counts)[experts]  # place within its expert's run
    rows = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    pairs = torch.full((rows,), num_pairs, dtype=torch.int32, device=ids.device)
    pairs[(ends - padded)[experts] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(0, rows, block_m, device=ids.device)
    tile_experts = torch.searchsorted(ends, tile_starts, right=True).to(torch.int32)  # X where past every run
    return pairs, tile_experts, ends[-1:].to(torch.int32)


@triton.jit
def _grouped_gemm(
    a_ptr, w_ptr, c_ptr, scale_ptr, pairs_ptr, tile_experts_ptr, length_ptr,
    num_pairs, n_out, n_in, stride_a, stride_we, stride_wn, stride_c,
    TOP_K: tl.constexpr, SCALE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # c[pair] = a[pair // TOP_K] @ w[expert]^T (* scale[pair]) for one [BLOCK_M, BLOCK_N] tile; w is [X, n_out, n_in]
    pid = tl.program_id(0)
    num_m = tl.num_programs(0) // tl.cdiv(n_out, BLOCK_N)
    num_n = tl.cdiv(n_out, BLOCK_N)
    group = pid // (GROUP_M * num_n)  # tiles of GROUP_M row blocks share the weight columns they read (L2 reuse)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % rows_in_group)
    pid_n = (pid % (GROUP_M * num_n)) // rows_in_group
    if pid_m * BLOCK_M >= tl.load(length_ptr):
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [M]
    valid = pairs < num_pairs
    a_rows = pairs // TOP_K  # the token's row of x (gate/up), the pair's own row (down: TOP_K 1)
    expert = tl.load(tile_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_a + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(n_in, BLOCK_K)):
        in_k = offs_k < n_in - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=in_k[:, None] & (offs_n[None, :] < n_out), other=0.0)
        if IEEE:  # float32 inputs: exact products (the tests' path), not TF32
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALE:
        acc = acc * tl.load(scale_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_c + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < n_out))


def _gemm(a: Tensor, w: Tensor, out: Tensor, aligned: tuple[Tensor, Tensor, Tensor], block_m: int, *, top_k: int, scale: Tensor | None) -> None:
    pairs, tile_experts, length = aligned
    num_pairs, (n_out, n_in) = out.shape[0], w.shape[1:]
    block_n, block_k = (64, 64) if block_m <= 16 else (128, 64)
    grid = (len(tile_experts) * triton.cdiv(n_out, block_n),)
    _grouped_gemm[grid](
        a, w, out, scale if scale is not None else out, pairs, tile_experts, length,
        num_pairs, n_out, n_in, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, SCALE=scale is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, num_warps=4, num_stages=3,
    )  # fmt: skip


def fused_experts(x: Tensor, gate_up: Tensor, down: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
    """moe.experts_reference on the GPU: x [N, E], gate_up [X, 2I, E], down [X, E, I], weights/ids [N, k] -> [N, E]."""
    num_tokens, top_k = ids.shape
    num_pairs = num_tokens * top_k
    block_m = 16 if num_pairs <= 1024 else 64  # decode: few pairs per expert, little padding
    aligned = align(ids, gate_up.shape[0], block_m)
    h = torch.empty(num_pairs, gate_up.shape[1], dtype=x.dtype, device=x.device)  # [S, 2I]
    _gemm(x, gate_up, h, aligned, block_m, top_k=top_k, scale=None)
    act = silu_mul(h)  # [S, I]
    y = torch.empty(num_pairs, down.shape[1], dtype=x.dtype, device=x.device)  # [S, E]
    _gemm(act, down, y, aligned, block_m, top_k=1, scale=weights.flatten())
    return y.view(num_tokens, top_k, -1).sum(dim=1)
