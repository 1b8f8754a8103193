"""Triton paged decode attention (one query per sequence), the GPU path of attention.py's decode.

Legend: B sequences, H query heads, K key/value heads, G = H / K, D head dim, M blocks per sequence.
Imported only on CUDA; tests/gpu checks it against attention.py's pure-PyTorch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_btb, stride_ob, stride_oh,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # one program per (sequence, key/value head): its G query heads share every key load (GQA)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(lens_ptr + b)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    q_rows = kv_head * G + g
    q = tl.load(q_ptr + b * stride_qb + q_rows[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None], other=0.0)
    m = tl.full([GP], float("-inf"), tl.float32)
    den = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for start in range(0, ctx, TILE):
        t = start + tl.arange(0, TILE)
        valid = t < ctx
        block = tl.load(bt_ptr + b * stride_btb + t // BLOCK, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK + t % BLOCK
        offsets = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0)  # [TILE, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * scale, float("-inf"))  # [GP, TILE]
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0)  # [TILE, D]
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        den = den * alpha + tl.sum(p, 1)
        m = m_new
    out = acc / den[:, None]
    tl.store(out_ptr + b * stride_ob + q_rows[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=(g < G)[:, None])


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, block_size: int
) -> Tensor:
    """q [B, H, D] (one query per sequence), caches [S, K, D], block_tables [B, M] -> [B, H, D]."""
    batch, num_heads, dim = q.shape
    num_kv_heads = k_cache.shape[1]
    groups = num_heads // num_kv_heads
    out = torch.empty_like(q)
    _decode_attention_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, dim**-0.5,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        G=groups, GP=max(16, triton.next_power_of_2(groups)), D=dim, BLOCK=block_size, TILE=64,
        IEEE=q.dtype == torch.float32, num_warps=4,
    )  # fmt: skip
    return out
