"""Triton fused act(gate) * up of the MLP, act silu (Llama, Qwen, Mistral, Phi-3, OLMo 2, SmolLM3) or tanh-GELU
(Gemma 2/3): one pass over [gate | up] instead of three (activation, then product). Imported only on CUDA;
models/llama.py holds the torch path and tests/gpu checks one against the other."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def _gated_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr, GELU: tl.constexpr):
    # one block of one row of x = [gate | up]: act(gate) in float32 rounded to the activation dtype (as torch
    # computes F.silu / F.gelu of a 16-bit tensor), times up, rounded
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = col < I
    gate = tl.load(x_ptr + row * stride_x + col, mask=valid, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + col, mask=valid, other=0.0)
    g = gate.to(tl.float32)
    if GELU:  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(z) = 1 - 2 / (1 + e^2z) (tl has no tanh)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        act = 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * z)))
    else:
        act = g / (1.0 + tl.exp(-g))
    act = act.to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + col, (act * up.to(tl.float32)).to(gate.dtype), mask=valid)


def gated(x: Tensor, activation: str = "silu") -> Tensor:
    """x [N, 2I] = [gate | up] -> act(gate) * up [N, I], one pass; activation "silu" or "gelu_tanh"."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"no fused kernel for activation {activation!r}; one of {ACTIVATIONS}")
    rows, width = x.shape
    half = width // 2
    out = torch.empty(rows, half, dtype=x.dtype, device=x.device)
    block = 1024
    _gated_kernel[(rows, triton.cdiv(half, block))](
        x, out, x.stride(0), out.stride(0), half, BLOCK=block, GELU=activation == "gelu_tanh", num_warps=4
    )  # fmt: skip
    return out


def silu_mul(x: Tensor) -> Tensor:
    """x [N, 2I] = [gate | up] -> silu(gate) * up [N, I], one pass."""
    return gated(x, "silu")


# --- act(gate) * up fused into the down projection (a candidate for decode steps; bench/decode.py --only mlp) ---


@triton.jit
def _gated_down_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, I, k_per_split, split_k, stride_x, stride_w, stride_o,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GELU: tl.constexpr,
):  # fmt: skip
    # one (row tile, column tile, K split) program: act(gate) * up of its K range computed as it is loaded (never
    # written out), times the down weights' rows; with split_k > 1 (a runtime value: one compile for any) each split leaves its float32 partial and the
    # last split of a tile to arrive (a counter per tile, reset by that split) sums them in split order, so the
    # result does not depend on arrival order
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], tl.float32)
    first = pid_k * k_per_split
    for k in range(first, tl.minimum(first + k_per_split, I), BK):
        rk = k + tl.arange(0, BK)
        mask = (rm[:, None] < M) & (rk[None, :] < I)
        gate = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mask, other=0.0)
        up = tl.load(x_ptr + rm[:, None] * stride_x + I + rk[None, :], mask=mask, other=0.0)
        g = gate.to(tl.float32)
        if GELU:
            act = 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * 0.7978845608028654 * (g + 0.044715 * g * g * g))))
        else:
            act = g / (1.0 + tl.exp(-g))
        a = (act.to(gate.dtype).to(tl.float32) * up.to(tl.float32)).to(gate.dtype)  # as the unfused pass rounds it
        w = tl.load(w_ptr + rn[:, None] * stride_w + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < I), other=0.0)
        acc += tl.dot(a, tl.trans(w))
    out_mask = (rm[:, None] < M) & (rn[None, :] < N)
    out_offsets = rm[:, None] * stride_o + rn[None, :]
    if split_k == 1:
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tile_rows = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + pid_k * M * N + tile_rows, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial stored before the counter says so
        tile = pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == split_k - 1:
            total = tl.zeros([BM, BN], tl.float32)
            for s in range(split_k):  # L1 bypassed: the other splits' partials were written by other multiprocessors
                total += tl.load(part_ptr + s * M * N + tile_rows, mask=out_mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + out_offsets, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call (a CUDA graph replays it as is)


_COUNTERS: dict[torch.device, Tensor] = {}


def gated_down(x: Tensor, weight: Tensor, activation: str = "silu", *, block_m: int = 64, block_n: int = 64, block_k: int = 64,
               split_k: int = 0, num_warps: int = 4, num_stages: int = 3) -> Tensor:  # fmt: skip
    """x [M, 2I] = [gate | up], weight [N, I] -> (act(gate) * up) @ weight.T [M, N] in one kernel (no [M, I]
    intermediate, no separate reduce). split_k 0: enough K splits for ~2 programs a multiprocessor. The
    per-tile counters live across calls (zeroed once, reset by the kernel), one set a device: calls on two
    streams at once (two engines on one GPU) would share them, so wiring this into the engine needs a set per
    engine; the first call must not be under CUDA graph capture."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"no fused kernel for activation {activation!r}; one of {ACTIVATIONS}")
    m, width = x.shape
    inner, n = width // 2, weight.shape[0]
    tiles_m, tiles_n = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    if not split_k:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132
        split_k = max(1, min(triton.cdiv(2 * sms, tiles_m * tiles_n), triton.cdiv(inner, 4 * block_k)))
    k_per_split = triton.cdiv(triton.cdiv(inner, split_k), block_k) * block_k
    split_k = triton.cdiv(inner, k_per_split)  # no empty split
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    counters = _COUNTERS.get(x.device)
    if counters is None or counters.numel() < tiles_m * tiles_n:
        counters = _COUNTERS[x.device] = torch.zeros(max(4096, tiles_m * tiles_n), dtype=torch.int32, device=x.device)
    _gated_down_kernel[(tiles_m, tiles_n, split_k)](
        x, weight, out, part, counters, m, n, inner, k_per_split, split_k, x.stride(0), weight.stride(0), out.stride(0),
        BM=block_m, BN=block_n, BK=block_k, GELU=activation == "gelu_tanh", num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
