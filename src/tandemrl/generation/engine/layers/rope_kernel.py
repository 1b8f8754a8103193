"""Triton rotary embedding fused with the KV-cache write (and the per-head q/k RMSNorm before it where the
family has one): one token per program over all its q/k heads.
Imported only on CUDA; rope.py holds the tables and the torch path, and tests/gpu checks one against the other."""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _norm_heads_(
    row_ptr, q_w_ptr, k_w_ptr, eps, H: tl.constexpr, K: tl.constexpr, HKP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    OFFSET: tl.constexpr, IN_F32: tl.constexpr,
):  # fmt: skip
    # in place: each of one token's H query and K key heads RMS-normed by q_w or k_w, as norm.py's kernel
    # computes and rounds it
    h = tl.arange(0, HKP)[:, None]  # [HKP, 1]
    d = tl.arange(0, DP)[None, :]  # [1, DP]
    inside = (h < H + K) & (d < D)
    at = row_ptr + h * D + d
    x = tl.load(at, mask=inside, other=0.0)
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 1)[:, None] / D + eps)  # [HKP, DP]
    w = tl.where(h < H, tl.load(q_w_ptr + d, mask=d < D, other=0.0), tl.load(k_w_ptr + d, mask=d < D, other=0.0)).to(tl.float32)
    if IN_F32:
        y = normed * (OFFSET + w)
    else:
        y = (OFFSET + w) * normed.to(x.dtype).to(tl.float32)
    tl.store(at, y.to(x.dtype), mask=inside)


@triton.jit
def _rope_cache_kernel(
    qkv_ptr, pos_ptr, table_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, q_w_ptr, k_w_ptr, eps, stride_n, stride_p, stride_s, stride_k,
    H: tl.constexpr, K: tl.constexpr, HKP: tl.constexpr, KP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    HALF: tl.constexpr, HALFP: tl.constexpr, HEAD_NORM: tl.constexpr, OFFSET: tl.constexpr, IN_F32: tl.constexpr,
):  # fmt: skip
    # one token: with HEAD_NORM, each of its H query and K key heads first RMS-normed in place (Qwen3's and
    # Gemma 3's q_norm / k_norm: weights q_w, k_w; as norm.py's kernel, rounded); then rotate-half RoPE in
    # place on the first 2 * HALF dims of those heads (transformers' roundings to the activation dtype; the
    # rest of a head passes through: partial rotary), then its keys and its values into its cache slot
    n = tl.program_id(0)
    if HEAD_NORM:
        _norm_heads_(qkv_ptr + n * stride_n, q_w_ptr, k_w_ptr, eps, H, K, HKP, D, DP, OFFSET, IN_F32)
        tl.debug_barrier()  # the normed heads, as stored, are what the rotation below loads
    pos = tl.load(pos_ptr + n)
    i = tl.arange(0, HALFP)[None, :]  # [1, HALFP]
    h = tl.arange(0, HKP)[:, None]  # [HKP, 1] head of the q|k part
    heads = (h < H + K) & (i < HALF)
    base = qkv_ptr + n * stride_n + h * D
    x1 = tl.load(base + i, mask=heads)
    x2 = tl.load(base + HALF + i, mask=heads)
    dtype = x1.dtype
    row = table_ptr + pos * stride_p + i
    half = i < HALF
    cos1 = tl.load(row, mask=half).to(dtype).to(tl.float32)
    cos2 = tl.load(row + HALF, mask=half).to(dtype).to(tl.float32)
    sin1 = tl.load(row + 2 * HALF, mask=half).to(dtype).to(tl.float32)
    sin2 = tl.load(row + 3 * HALF, mask=half).to(dtype).to(tl.float32)
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
    d = tl.arange(0, DP)[None, :]  # [1, DP]
    values = (kv < K) & (d < D)
    v = tl.load(qkv_ptr + n * stride_n + (H + K) * D + kv * D + d, mask=values)
    tl.store(v_cache_ptr + slot * stride_s + kv * stride_k + d, v, mask=values)
    if 2 * HALF < D:  # the keys' unrotated tail
        tail = values & (d >= 2 * HALF)
        k_tail = tl.load(qkv_ptr + n * stride_n + (H + kv) * D + d, mask=tail)
        tl.store(k_cache_ptr + slot * stride_s + kv * stride_k + d, k_tail, mask=tail)


@dataclass(frozen=True)
class HeadNorm:
    """Each q and k head's RMSNorm before RoPE (Qwen3, Gemma 3), as models/llama.py's RMSNorm computes it."""

    q_weight: Tensor  # [D]
    k_weight: Tensor  # [D]
    eps: float
    offset: float = 0.0
    in_float32: bool = False


def rope_and_cache_(
    qkv: Tensor, num_heads: int, num_kv_heads: int, head_dim: int, positions: Tensor, table: Tensor,
    slot_mapping: Tensor, k_cache: Tensor, v_cache: Tensor, head_norm: HeadNorm | None = None,
) -> None:  # fmt: skip
    """In place: RoPE on the q and k heads of each row of qkv [N, (H + 2K) * D] (table [P, 2, R], R <= D
    rotary dims), each head first RMS-normed when `head_norm` is given; then each row's rotated k and its v
    into k_cache / v_cache [S, K, D] at slot_mapping [N]."""
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(2) == 1 and qkv.stride(1) == 1
    half = table.shape[-1] // 2
    norm = head_norm or HeadNorm(table, table, 0.0)  # unread without HEAD_NORM
    _rope_cache_kernel[(qkv.shape[0],)](
        qkv, positions, table, slot_mapping, k_cache, v_cache, norm.q_weight, norm.k_weight, norm.eps, qkv.stride(0), table.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        H=num_heads, K=num_kv_heads, HKP=triton.next_power_of_2(num_heads + num_kv_heads), KP=triton.next_power_of_2(num_kv_heads),
        D=head_dim, DP=triton.next_power_of_2(head_dim), HALF=half, HALFP=triton.next_power_of_2(half),
        HEAD_NORM=head_norm is not None, OFFSET=norm.offset, IN_F32=norm.in_float32, num_warps=2,
    )  # fmt: skip
