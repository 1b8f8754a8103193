"""Triton paged attention read straight from the KV cache through block tables: decode (one query per
sequence) and prefill (query tiles of one sequence each), the GPU paths of attention.py.

Legend: B sequences, H query heads, K key/value heads, G = H / K, D head dim, M blocks per sequence.
Both take a layer's AttentionOptions: the score scale, a sliding window (keys before a query's last W
positions are neither read nor seen) and a tanh soft cap. Imported only on CUDA; tests/gpu checks them
against attention.py's pure-PyTorch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _capped(s, SOFTCAP: tl.constexpr):
    # SOFTCAP * tanh(s / SOFTCAP), tanh written through exp (tl has none): 2 / (1 + e^-2x) - 1
    if SOFTCAP > 0:
        s = SOFTCAP * (2.0 / (1.0 + tl.exp(-2.0 * s / SOFTCAP)) - 1.0)
    return s


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, scale,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_btb, stride_ob, stride_oh,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr, IEEE: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    # one program per (sequence, key/value head): its G query heads share every key load (GQA); with a
    # window, the tiles from the one holding the window's first key
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
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(ctx - WINDOW, 0) // TILE * TILE
    for start in range(lo, ctx, TILE):
        t = start + tl.arange(0, TILE)
        valid = t < ctx
        if WINDOW > 0:
            valid = valid & (t >= ctx - WINDOW)
        block = tl.load(bt_ptr + b * stride_btb + t // BLOCK, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK + t % BLOCK
        offsets = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0)  # [TILE, D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], _capped(s * scale, SOFTCAP), float("-inf"))  # [GP, TILE]
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
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, block_size: int, *, options=None
) -> Tensor:
    """q [B, H, D] (one query per sequence), caches [S, K, D], block_tables [B, M] -> [B, H, D].
    `options`: the layer's AttentionOptions (None: scale D ** -0.5, no window, no cap)."""
    batch, num_heads, dim = q.shape
    num_kv_heads = k_cache.shape[1]
    groups = num_heads // num_kv_heads
    out = torch.empty_like(q)
    scale, window, softcap = (dim**-0.5, 0, 0.0) if options is None else (options.scale, options.window, options.softcap)
    _decode_attention_kernel[(batch, num_kv_heads)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        G=groups, GP=max(16, triton.next_power_of_2(groups)), D=dim, BLOCK=block_size, TILE=64,
        IEEE=q.dtype == torch.float32, WINDOW=window, SOFTCAP=softcap, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_q_ptr, lens_ptr, tile_seq_ptr, tile_start_ptr, num_seqs, scale,
    stride_qn, stride_qh, stride_ks, stride_kh, stride_btb, stride_on, stride_oh,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TILE_Q: tl.constexpr, TILE: tl.constexpr,
    IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    # one program per (query tile, key/value head): TILE_Q consecutive queries of one sequence times the G
    # query heads that share the head's keys, as TILE_Q * GP rows; the keys are read through the block table
    # straight from the cache, causal from the bottom right (a query at position p sees positions 0..p)
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.load(tile_seq_ptr + t)
    if b < num_seqs:  # tiles past the last sequence's are the grid's spare room
        first = tl.load(tile_start_ptr + t)  # the tile's first query, counted within its sequence
        q_start = tl.load(cu_q_ptr + b)
        num_q = tl.load(cu_q_ptr + b + 1) - q_start
        ctx = tl.load(lens_ptr + b)
        r = tl.arange(0, TILE_Q * GP)
        qi = first + r // GP  # [R] query of each row, within the sequence
        g = r % GP
        rows = (qi < num_q) & (g < G)
        pos = ctx - num_q + qi  # [R] its position: it sees keys 0..pos
        d = tl.arange(0, D)
        heads = kv_head * G + g
        q_offsets = (q_start + qi).to(tl.int64)[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=rows[:, None], other=0.0)  # [R, D]
        m = tl.full([TILE_Q * GP], float("-inf"), tl.float32)
        den = tl.zeros([TILE_Q * GP], tl.float32)
        acc = tl.zeros([TILE_Q * GP, D], tl.float32)
        end = ctx - num_q + tl.minimum(first + TILE_Q, num_q)  # keys [0, end) cover every row's
        lo = 0
        if WINDOW > 0:  # from the tile holding the first row's first key in its window
            lo = tl.maximum(ctx - num_q + first - WINDOW + 1, 0) // TILE * TILE
        for start in range(lo, end, TILE):
            kpos = start + tl.arange(0, TILE)
            keys = kpos < end
            block = tl.load(bt_ptr + b * stride_btb + kpos // BLOCK, mask=keys, other=0)
            slot = block.to(tl.int64) * BLOCK + kpos % BLOCK
            kv_offsets = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=keys[:, None], other=0.0)  # [TILE, D]
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            seen = keys[None, :] & (kpos[None, :] <= pos[:, None])  # [R, TILE]
            if WINDOW > 0:
                seen = seen & (kpos[None, :] > pos[:, None] - WINDOW)
            s = tl.where(seen, _capped(s * scale, SOFTCAP), float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # without a window finite from the first tile on: key 0 is every row's
            m_ref = m_new
            if WINDOW > 0:  # a later row's window may start in a later tile: until then it adds zeros, not NaNs
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_ref[:, None])
            alpha = tl.exp(m - m_ref)
            v = tl.load(v_ptr + kv_offsets, mask=keys[:, None], other=0.0)  # [TILE, D]
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            den = den * alpha + tl.sum(p, 1)
            m = m_new
        out = acc / den[:, None]
        out_offsets = (q_start + qi).to(tl.int64)[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=rows[:, None])


def prefill_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta, *, options=None, tile: int | None = None, num_warps: int = 8, num_stages: int = 2
) -> Tensor:
    """q [N, H, D] of a prefill step, caches [S, K, D], meta a PagedPrefillMetadata -> [N, H, D]. Rows of
    q past meta.num_queries (the runner's padding) are left as they come out of torch.empty, or zeros when
    num_queries is None (a prefill graph's padded rows).

    Launch settings: `tile` keys an iteration (64, or 32 for a head dim over 64), `num_warps`, `num_stages`.
    The defaults were the fastest of the settings tried for next turns over cached contexts, prompts and a
    long prompt, at head dims 64 and 128 (figures: bench/RESULTS.md, bench/prefill.py)."""
    num_heads, dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    groups = num_heads // num_kv_heads
    out = torch.empty_like(q) if meta.num_queries is not None else torch.zeros_like(q)  # rows no tile covers: zeros
    scale, window, softcap = (dim**-0.5, 0, 0.0) if options is None else (options.scale, options.window, options.softcap)
    _prefill_attention_kernel[(len(meta.tile_seqs), num_kv_heads)](
        q, k_cache, v_cache, out, meta.block_tables, meta.cu_seq_q, meta.context_lens, meta.tile_seqs, meta.tile_starts,
        len(meta.context_lens), scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), meta.block_tables.stride(0), out.stride(0), out.stride(1),
        G=groups, GP=triton.next_power_of_2(groups), D=dim, BLOCK=meta.block_size, TILE_Q=meta.tile_queries, TILE=tile or (64 if dim <= 64 else 32),
        IEEE=q.dtype == torch.float32, WINDOW=window, SOFTCAP=softcap, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
