"""Triton kernels of the GPU path: paged decode attention and fused Gumbel-max sampling.

Legend: B sequences, H query heads, K key/value heads, G = H / K, D head dim, M blocks per sequence,
V vocab. Imported only on CUDA; the pure-PyTorch reference of each is in attention.py / sampler.py,
and tests/gpu checks one against the other.
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


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _sample_chunk_kernel(
    logits_ptr, temps_ptr, keys_ptr, max_ptr, sum_ptr, score_ptr, index_ptr, logit_ptr,
    stride_b, V, S, CHUNK: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    # program (row, chunk) over CHUNK vocab entries: the max and the sum of exp of the tempered logits,
    # and the argmax of tempered logit + Gumbel noise (Gumbel-max; greedy rows get no noise) with that
    # logit. Many chunks per row keep every SM busy; the hash runs in 32-bit integers.
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    greedy = temp == 0.0
    inv_temp = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temp))
    key = tl.load(keys_ptr + row).to(tl.uint32)
    first = chunk * CHUNK
    run_max = tl.full([TILE], float("-inf"), tl.float32)
    for start in range(0, CHUNK, TILE):  # pass 1, the max (the chunk stays in cache for pass 2)
        v = first + start + tl.arange(0, TILE)
        z = tl.load(logits_ptr + row * stride_b + v, mask=v < V, other=float("-inf")).to(tl.float32) * inv_temp
        run_max = tl.maximum(run_max, z)
    chunk_max = tl.max(run_max, 0)
    shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
    run_sum = tl.zeros([TILE], tl.float32)
    best_score = tl.full([TILE], float("-inf"), tl.float32)
    # lanes past the vocab never win: they must not alias a real token when the winner is read back
    best_logit = tl.full([TILE], float("-inf"), tl.float32)
    best_index = tl.full([TILE], -1, tl.int32)
    for start in range(0, CHUNK, TILE):  # pass 2
        v = first + start + tl.arange(0, TILE)
        valid = v < V
        z = tl.load(logits_ptr + row * stride_b + v, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        run_sum += tl.where(valid, tl.exp(z - shift), 0.0)
        bits = _mix32((key + v.to(tl.uint32) * 0x9E3779B9) & 0xFFFFFFFF)
        uniform = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        noise = tl.where(greedy, 0.0, -tl.log(-tl.log(uniform)))
        score = tl.where(valid, z + noise, float("-inf"))
        better = score > best_score
        best_score = tl.where(better, score, best_score)
        best_logit = tl.where(better, z, best_logit)
        best_index = tl.where(better, v, best_index)
    top = tl.max(best_score, 0)
    # the first lane holding the best score, so ties break towards the lower index (as torch.argmax)
    index = tl.min(tl.where(best_score == top, best_index, V), 0)
    out = row * S + chunk
    tl.store(max_ptr + out, chunk_max)
    tl.store(sum_ptr + out, tl.sum(run_sum, 0))
    tl.store(score_ptr + out, top)
    tl.store(index_ptr + out, index)
    tl.store(logit_ptr + out, tl.max(tl.where(best_index == index, best_logit, float("-inf")), 0))


@triton.jit
def _sample_combine_kernel(max_ptr, sum_ptr, score_ptr, index_ptr, logit_ptr, tokens_ptr, logprobs_ptr, V, S, SP: tl.constexpr):
    # one program per row over its S chunks: logsumexp of the tempered logits, and the best chunk's token
    row = tl.program_id(0)
    c = tl.arange(0, SP)
    valid = c < S
    at = row * S + c
    maxes = tl.load(max_ptr + at, mask=valid, other=float("-inf"))
    row_max = tl.max(maxes, 0)
    sums = tl.load(sum_ptr + at, mask=valid, other=0.0)
    lse = row_max + tl.log(tl.sum(sums * tl.exp(tl.where(maxes == float("-inf"), float("-inf"), maxes - row_max)), 0))
    scores = tl.load(score_ptr + at, mask=valid, other=float("-inf"))
    indices = tl.load(index_ptr + at, mask=valid, other=V)
    top = tl.max(scores, 0)
    index = tl.min(tl.where(valid & (scores == top), indices, V), 0)  # the lowest index among equal scores
    logit = tl.max(tl.where(valid & (indices == index), tl.load(logit_ptr + at, mask=valid, other=float("-inf")), float("-inf")), 0)
    tl.store(tokens_ptr + row, index.to(tl.int64))
    tl.store(logprobs_ptr + row, logit - lse)


def sample_unfiltered(logits: Tensor, temperatures: Tensor, keys: Tensor, chunk: int = 8192) -> tuple[Tensor, Tensor]:
    """Gumbel-max over logits [B, V] of rows without top-k/top-p/min-p -> (token_ids [B], logprobs [B])."""
    batch, vocab_size = logits.shape
    tile = 1024
    chunk = max(tile, min(chunk, triton.next_power_of_2(vocab_size)))
    chunks = triton.cdiv(vocab_size, chunk)
    parts = torch.empty(4, batch, chunks, dtype=torch.float32, device=logits.device)  # max, sum, score, logit
    indices = torch.empty(batch, chunks, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    _sample_chunk_kernel[(batch, chunks)](
        logits, temperatures, keys, parts[0], parts[1], parts[2], indices, parts[3],
        logits.stride(0), vocab_size, chunks, CHUNK=chunk, TILE=tile, num_warps=4,
    )  # fmt: skip
    _sample_combine_kernel[(batch,)](
        parts[0], parts[1], parts[2], indices, parts[3], tokens, logprobs, vocab_size, chunks, SP=max(16, triton.next_power_of_2(chunks)),
    )  # fmt: skip
    return tokens, logprobs


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, E, eps, HAS_RES: tl.constexpr, BLOCK_E: tl.constexpr):
    # one row: (x + residual) rounded to the activation dtype, then RMSNorm in float32 (as transformers)
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    x = tl.load(x_ptr + row * stride_x + e, mask=valid, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + e, mask=valid, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_o + e, x, mask=valid)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / E + eps)).to(x.dtype)
    w = tl.load(w_ptr + e, mask=valid, other=0.0)
    tl.store(out_ptr + row * stride_o + e, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=valid)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
    """x [R, E] (any leading shape) -> RMSNorm(x [+ residual]); with a residual also returns the sum."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    res2 = residual.reshape(-1, shape[-1]) if residual is not None else x2
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0), out.stride(0), shape[-1], eps,
        HAS_RES=residual is not None, BLOCK_E=triton.next_power_of_2(shape[-1]), num_warps=4,
    )  # fmt: skip
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


@triton.jit
def _rope_cache_kernel(
    qkv_ptr, pos_ptr, table_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, stride_n, stride_p, stride_s, stride_k,
    H: tl.constexpr, K: tl.constexpr, HKP: tl.constexpr, KP: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    # one token: rotate-half RoPE in place on its H query and K key heads (transformers' roundings to the
    # activation dtype), then its rotated keys and its values into its cache slot
    n = tl.program_id(0)
    pos = tl.load(pos_ptr + n)
    i = tl.arange(0, HALF)[None, :]  # [1, HALF]
    h = tl.arange(0, HKP)[:, None]  # [HKP, 1] head of the q|k part
    heads = (h < H + K) & (i < HALF)
    base = qkv_ptr + n * stride_n + h * 2 * HALF
    x1 = tl.load(base + i, mask=heads)
    x2 = tl.load(base + HALF + i, mask=heads)
    dtype = x1.dtype
    row = table_ptr + pos * stride_p + i
    cos1 = tl.load(row).to(dtype).to(tl.float32)
    cos2 = tl.load(row + HALF).to(dtype).to(tl.float32)
    sin1 = tl.load(row + 2 * HALF).to(dtype).to(tl.float32)
    sin2 = tl.load(row + 3 * HALF).to(dtype).to(tl.float32)
    a1 = (x1.to(tl.float32) * cos1).to(dtype).to(tl.float32)
    b1 = (-x2.to(tl.float32) * sin1).to(dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * cos2).to(dtype).to(tl.float32)
    b2 = (x1.to(tl.float32) * sin2).to(dtype).to(tl.float32)
    r1 = (a1 + b1).to(dtype)
    r2 = (a2 + b2).to(dtype)
    tl.store(base + i, r1, mask=heads)
    tl.store(base + HALF + i, r2, mask=heads)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    keys = heads & (h >= H)
    k_row = k_cache_ptr + slot * stride_s + (h - H) * stride_k
    tl.store(k_row + i, r1, mask=keys)
    tl.store(k_row + HALF + i, r2, mask=keys)
    kv = tl.arange(0, KP)[:, None]  # [KP, 1]
    d = tl.arange(0, 2 * HALF)[None, :]  # [1, D]
    values = (kv < K) & (d < 2 * HALF)
    v = tl.load(qkv_ptr + n * stride_n + (H + K) * 2 * HALF + kv * 2 * HALF + d, mask=values)
    tl.store(v_cache_ptr + slot * stride_s + kv * stride_k + d, v, mask=values)


def rope_and_cache_(
    qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, positions: Tensor, table: Tensor,
    slot_mapping: Tensor, k_cache: Tensor, v_cache: Tensor,
) -> None:  # fmt: skip
    """In place: RoPE on the q and k heads of each row of qkv [N, (H + 2K) * D] (table [P, 2, D]); then
    each row's rotated k and its v into k_cache / v_cache [S, K, D] at slot_mapping [N]."""
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1 and qkv.stride(1) == 1
    _rope_cache_kernel[(qkv.shape[0],)](
        qkv, positions, table, slot_mapping, k_cache, v_cache, qkv.stride(0), table.stride(0), k_cache.stride(0), k_cache.stride(1),
        H=num_heads, K=num_kv_heads, HKP=triton.next_power_of_2(num_heads + num_kv_heads), KP=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2, num_warps=2,
    )  # fmt: skip


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
