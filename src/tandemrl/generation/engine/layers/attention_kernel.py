"""Triton paged attention read straight from the KV cache through block tables: decode (one query per
sequence) and prefill (query tiles of one sequence each), the GPU paths of attention.py.

Legend: B sequences, H query heads, K key/value heads, G = H / K, D head dim, M blocks per sequence.
Both take a layer's AttentionOptions: the score scale, a sliding window (keys before a query's last W
positions are neither read nor seen) and a tanh soft cap. Imported only on CUDA; tests/gpu checks them
against attention.py's pure-PyTorch path.
"""

from __future__ import annotations

import functools

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
    q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, scale, splits, min_chunk,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_btb, stride_ob, stride_oh,
    H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
    IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    # one program per (sequence, key/value head, split): its G query heads share every key load (GQA), and
    # a long context (with a window, the window's keys) is cut into up to `splits` chunks of at least
    # min_chunk keys, each a program (split-KV, "flash-decoding"), so a step of few sequences still has
    # enough programs to keep the memory busy. A context of one chunk writes its output here (the
    # short-context path); otherwise each chunk writes its normalised partial output and log-sum-exp,
    # merged by _merge_splits_kernel.
    # (Past 60 lines, one kernel on purpose: the online-softmax loop's running max, sum and accumulator live in
    # registers across it; the cap is _capped, the merge its own kernel. A split wants a GPU to show it is free.)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + b)
    span = ctx
    if WINDOW > 0:
        span = tl.minimum(ctx, WINDOW)
    num_splits = tl.minimum(splits, tl.cdiv(span, min_chunk))
    chunk = tl.cdiv(tl.cdiv(span, num_splits), TILE) * TILE
    if split < num_splits:
        g = tl.arange(0, GP)
        d = tl.arange(0, DP)  # a head dim that is no power of two (Phi-3's 96) is padded to one, masked
        dims = d < D
        q_rows = kv_head * G + g
        heads = g < G
        q = tl.load(q_ptr + b * stride_qb + q_rows[:, None] * stride_qh + d[None, :], mask=heads[:, None] & dims[None, :], other=0.0)
        m = tl.full([GP], float("-inf"), tl.float32)
        den = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, DP], tl.float32)
        first = ctx - span + split * chunk
        end = tl.minimum(first + chunk, ctx)  # a last chunk may be empty (chunks are whole tiles)
        for start in range(first, end, TILE):
            t = start + tl.arange(0, TILE)
            valid = t < end
            block = tl.load(bt_ptr + b * stride_btb + t // BLOCK, mask=valid, other=0)
            slot = block.to(tl.int64) * BLOCK + t % BLOCK
            offsets = slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
            k = tl.load(k_ptr + offsets, mask=valid[:, None] & dims[None, :], other=0.0)  # [TILE, DP]
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], _capped(s * scale, SOFTCAP), float("-inf"))  # [GP, TILE]
            m_new = tl.maximum(m, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m - m_new)
            v = tl.load(v_ptr + offsets, mask=valid[:, None] & dims[None, :], other=0.0)  # [TILE, DP]
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            den = den * alpha + tl.sum(p, 1)
            m = m_new
        out = acc / tl.where(den == 0.0, 1.0, den)[:, None]
        if num_splits == 1:
            tl.store(out_ptr + b * stride_ob + q_rows[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty), mask=heads[:, None] & dims[None, :])
        else:
            part = (b * H + q_rows) * splits + split  # [GP] partial of (sequence, head, split)
            tl.store(part_out_ptr + part[:, None] * D + d[None, :], out, mask=heads[:, None] & dims[None, :])
            tl.store(part_lse_ptr + part, m + tl.log(den), mask=heads)  # -inf for an empty chunk


@triton.jit
def _merge_splits_kernel(
    lens_ptr, part_out_ptr, part_lse_ptr, out_ptr, splits, min_chunk, stride_ob, stride_oh,
    H: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    # one program per (sequence, query head): the chunks' outputs weighted by their share of the softmax
    # mass, exp(lse_s - lse) (flash-decoding's reduction); contexts of one chunk were written whole
    b = tl.program_id(0)
    head = tl.program_id(1)
    span = tl.load(lens_ptr + b)
    if WINDOW > 0:
        span = tl.minimum(span, WINDOW)
    num_splits = tl.minimum(splits, tl.cdiv(span, min_chunk))
    if num_splits > 1:
        s = tl.arange(0, SP)
        d = tl.arange(0, DP)
        dims = d < D
        parts = (b * H + head) * splits + s
        valid = s < num_splits
        lse = tl.load(part_lse_ptr + parts, mask=valid, other=float("-inf"))  # [SP]
        top = tl.max(lse, 0)  # finite: the first chunk holds keys
        weights = tl.exp(lse - top)
        outs = tl.load(part_out_ptr + parts[:, None] * D + d[None, :], mask=valid[:, None] & dims[None, :], other=0.0)  # [SP, DP]
        out = tl.sum(outs * weights[:, None], 0) / tl.sum(weights, 0)
        tl.store(out_ptr + b * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dims)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def decode_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int, *, programs_per_sm: int = 4, min_chunk: int = 256) -> int:
    """Chunks a context may be cut into: enough (sequence, key/value head, chunk) programs for
    programs_per_sm on every multiprocessor, no chunk under min_chunk keys. From shapes known on the host
    (max_context: the block tables' width in positions, or the window), so a CUDA graph's grid is fixed;
    a sequence shorter than that uses fewer chunks (its extra programs return at once).

    Example: 128 sequences x 2 heads, 8k positions, 132 SMs -> 3; 512 x 2 -> 1 (already 1024 programs)
    """
    wanted = -(-programs_per_sm * num_sms // (batch * num_kv_heads))
    return max(1, min(wanted, -(-max_context // min_chunk)))


def decode_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, block_size: int, *, options=None,
    splits: int | None = None, tile: int | None = None, min_chunk: int = 256, programs_per_sm: int | None = None, num_warps: int = 4,
    num_stages: int | None = None,
) -> Tensor:  # fmt: skip
    """q [B, H, D] (one query per sequence), caches [S, K, D], block_tables [B, M] -> [B, H, D].
    `options`: the layer's AttentionOptions (None: scale D ** -0.5, no window, no cap).

    Launch settings: `splits` (default decode_splits of the shapes, with `programs_per_sm`: 4 for a head
    dim of 64 or less, else 2), `tile` keys an iteration, `min_chunk` (a multiple of tile) fewest keys of
    a chunk, `num_warps`, `num_stages`. The defaults were the fastest of the settings bench/decode.py --sweep
    tries (bf16, one layer's cache, blocks of 16 in random order) at 128 sequences of 4k (head dim 64) and
    of 8k (128) positions (figures: bench/RESULTS.md, bench/decode.py)."""
    batch, num_heads, dim = q.shape
    num_kv_heads = k_cache.shape[1]
    groups = num_heads // num_kv_heads
    scale, window, softcap = (dim**-0.5, 0, 0.0) if options is None else (options.scale, options.window, options.softcap)
    # a head dim over 128 (Gemma's 256): half the keys a stage, one stage less, so the staged k and v tiles
    # stay within an SM's shared memory (64 keys x 256 x 2 bytes x k and v x 3 stages would not)
    tile, num_stages = tile or (64 if dim <= 128 else 32), num_stages or (3 if dim <= 128 else 2)
    if splits is None:
        span = block_tables.shape[1] * block_size if window == 0 else min(window, block_tables.shape[1] * block_size)
        per_sm = programs_per_sm or (4 if dim <= 64 else 2)
        splits = decode_splits(batch, num_kv_heads, span, _num_sms(q.device), programs_per_sm=per_sm, min_chunk=min_chunk)
    out = torch.empty_like(q)
    part_out = torch.empty(batch, num_heads, splits, dim, dtype=torch.float32, device=q.device) if splits > 1 else out
    part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device) if splits > 1 else out
    _decode_attention_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, scale, splits, min_chunk,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        H=num_heads, G=groups, GP=max(16, triton.next_power_of_2(groups)), D=dim, DP=triton.next_power_of_2(dim), BLOCK=block_size, TILE=tile,
        IEEE=q.dtype == torch.float32, WINDOW=window, SOFTCAP=softcap, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            context_lens, part_out, part_lse, out, splits, min_chunk, out.stride(0), out.stride(1),
            H=num_heads, D=dim, DP=triton.next_power_of_2(dim), SP=max(2, triton.next_power_of_2(splits)), WINDOW=window,
        )  # fmt: skip
    return out


@triton.jit
def _prefill_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, cu_q_ptr, lens_ptr, tile_seq_ptr, tile_start_ptr, num_seqs, scale,
    stride_qn, stride_qh, stride_ks, stride_kh, stride_btb, stride_on, stride_oh,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, TILE_Q: tl.constexpr,
    TILE: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    # one program per (query tile, key/value head): TILE_Q consecutive queries of one sequence times the G
    # query heads that share the head's keys, as TILE_Q * GP rows; the keys are read through the block table
    # straight from the cache, causal from the bottom right (a query at position p sees positions 0..p)
    # (Past 60 lines for the decode kernel's reason: one online-softmax loop whose state stays in registers.)
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
        d = tl.arange(0, DP)  # padded to a power of two, masked (see the decode kernel)
        dims = d < D
        heads = kv_head * G + g
        q_offsets = (q_start + qi).to(tl.int64)[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=rows[:, None] & dims[None, :], other=0.0)  # [R, DP]
        m = tl.full([TILE_Q * GP], float("-inf"), tl.float32)
        den = tl.zeros([TILE_Q * GP], tl.float32)
        acc = tl.zeros([TILE_Q * GP, DP], tl.float32)
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
            k = tl.load(k_ptr + kv_offsets, mask=keys[:, None] & dims[None, :], other=0.0)  # [TILE, DP]
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
            v = tl.load(v_ptr + kv_offsets, mask=keys[:, None] & dims[None, :], other=0.0)  # [TILE, DP]
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            den = den * alpha + tl.sum(p, 1)
            m = m_new
        out = acc / den[:, None]
        out_offsets = (q_start + qi).to(tl.int64)[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=rows[:, None] & dims[None, :])


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
        G=groups, GP=triton.next_power_of_2(groups), D=dim, DP=triton.next_power_of_2(dim), BLOCK=meta.block_size, TILE_Q=meta.tile_queries, TILE=tile or (64 if dim <= 64 else 32),
        IEEE=q.dtype == torch.float32, WINDOW=window, SOFTCAP=softcap, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
