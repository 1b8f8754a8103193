"""Triton "decode GEMM": out = x @ weight.T for the skinny matmuls of a decode step (one row per sequence,
128-512 rows), with the weight held as nn.Linear holds it, [N out, K in], contiguous along K. Imported only
on CUDA; tests/unit/generation/engine/test_gemm_kernel.py checks it in triton's interpreter on CPU and
bench/decode.py (`--only matmul`) times it against cuBLAS.

Why: at 128 rows a layer projection is a read of its weight (x and out are small), so it should run at the
memory's copy bandwidth; cuBLAS (F.linear) moves the weight at only 0.39-0.77 of it on an H200 at Mistral-7B
and Qwen2.5-7B widths (one kernel timed alone, L2 flushed): a 4096 x 4096 weight cut into output tiles
gives it ~32 programs for 132 multiprocessors.

Layout and work split: one program covers every row of x (BLOCK_M = the rows rounded up to a power of two,
16 at least; past 256 rows the rows are tiled too, each tile rereading the weight tile from L2), BLOCK_N
output columns (BLOCK_N rows of the weight, loaded [BLOCK_N, BLOCK_K] along K and multiplied as
tl.dot(x, tl.trans(w))), and one of `split_k` equal ranges of K, walked in BLOCK_K steps (a loop that Triton
software-pipelines, `num_stages` loads in flight). Programs: M tiles x split_k x N tiles, so split-K gives
the small matrices enough programs to fill the GPU. Accumulation in float32, output in x's dtype.

Split-K protocol (split_k > 1), one launch, no reduce kernel, no memset: each program stores its float32
partial [BLOCK_M, BLOCK_N] in its slice of a workspace [split_k, M, N], then (after a CTA barrier, so every
thread's stores come before it) adds 1 to its output tile's int32 counter with an acq_rel atomic at GPU
scope. The program that draws split_k - 1 is the last: every other partial is visible to it (their
release, its acquire), so it sums the split_k partials in split order (a fixed order: the result does not
depend on which program came last), writes the output and sets the counter back to 0, leaving the
counters as it found them: the kernel can run again, and be replayed in a CUDA graph, with no reset. The
workspace and the (zeroed) counters are allocated once per (device, M, N, split_k) and cached in this
module; calls sharing them must run in order on one stream (the decode step does), and the first call of a
shape should come before a CUDA graph capture (so the buffers are not allocated from the graph's pool).

Gated (gated="silu" / "gelu_tanh", split_k 1 only): the weight is the MLP's fused [gate | up], [2I, K],
gate rows [0, I), up rows [I, 2I); a program multiplies its gate tile and the matching up tile together
and stores act(gate) * up, [M, I]: the gate_up matmul and the activation kernel (activation.gated) in one
pass, rounding as that pair does (gate and up to x's dtype, act(gate) to x's dtype, then the product).
"""

from __future__ import annotations

import itertools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from tandemrl.generation.engine.layers.activation import ACTIVATIONS

MAX_BLOCK_M = 256
_WORKSPACES: dict[tuple, tuple[Tensor, Tensor]] = {}  # (device, M, N, split_k) -> (partials [split_k, M, N] fp32, counters int32)


@triton.jit
def _activation(g, GELU: tl.constexpr):
    # silu(g) = g / (1 + e^-g); tanh-GELU as activation.py writes it (tl has no tanh), both in float32
    if GELU:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * z)))
    else:
        return g / (1.0 + tl.exp(-g))


@triton.jit
def _decode_gemm_kernel(
    x_ptr, w_ptr, out_ptr, part_ptr, count_ptr,
    M, N, K, stride_x, stride_w, stride_o, k_per_split, split_k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, GATED: tl.constexpr, GELU: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    # program -> (row tile, K split, column tile), row tiles fastest (those sharing a weight tile run together)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    pid_k = (pid // num_m) % split_k
    pid_n = pid // (num_m * split_k)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    col_ok = offs_n < N  # N: the output width (gated: I, the up rows start at I)
    k_start = pid_k * k_per_split  # k_per_split: a whole number of BLOCK_K steps
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_x + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + (k_start + offs_k)[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptrs = w_ptr + (N + offs_n)[:, None].to(tl.int64) * stride_w + (k_start + offs_k)[None, :]  # gated: the up rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            in_k = (k + offs_k) < K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & in_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & in_k[None, :], other=0.0)
        if IEEE:  # float32 inputs (the tests): exact products, not TF32
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            if EVEN_K:
                u = tl.load(up_ptrs, mask=col_ok[:, None], other=0.0)
            else:
                u = tl.load(up_ptrs, mask=col_ok[:, None] & in_k[None, :], other=0.0)
            if IEEE:
                acc_up = tl.dot(x, tl.trans(u), acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(x, tl.trans(u), acc_up)
            up_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out_ty = out_ptr.dtype.element_ty
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_o + offs_n[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if GATED:  # as the matmul then activation.gated round: gate, up, act(gate) each to the output dtype
        gate = acc.to(out_ty).to(tl.float32)
        act = _activation(gate, GELU).to(out_ty).to(tl.float32)
        tl.store(out_ptrs, (act * acc_up.to(out_ty).to(tl.float32)).to(out_ty), mask=mask)
    elif SPLIT:
        # partials [split_k, M, N] as [split_k * M, N]: split s, row m at row s * M + m
        tl.store(part_ptr + (pid_k * M + offs_m)[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the one thread that counts releases them
        tile = pid_n * num_m + pid_m
        ticket = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == split_k - 1:  # the last of the tile's splits: the others' partials are visible (acquire)
            # every partial read back (its own too, from L2: acc need not stay in registers beside total), in
            # split order whichever program came last: the same sum every run; .cg: from L2, not L1
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(0, split_k):
                total += tl.load(part_ptr + (s * M + offs_m)[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ty), mask=mask)
            tl.store(count_ptr + tile, 0)  # as found: the next launch (or graph replay) starts from 0
    else:
        tl.store(out_ptrs, acc.to(out_ty), mask=mask)


def default_block_m(rows: int) -> int:
    """The rows rounded up to a power of two (16 at least, MAX_BLOCK_M at most: past it the rows are tiled)."""
    return min(MAX_BLOCK_M, max(16, triton.next_power_of_2(rows)))


def _workspace(device: torch.device, rows: int, width: int, split_k: int) -> tuple[Tensor, Tensor]:
    key = (device, rows, width, split_k)
    if key not in _WORKSPACES:  # counters for the smallest tiles (16 x 16): enough for any block sizes
        partials = torch.empty(split_k, rows, width, dtype=torch.float32, device=device)
        counters = torch.zeros(triton.cdiv(rows, 16) * triton.cdiv(width, 16), dtype=torch.int32, device=device)
        _WORKSPACES[key] = (partials, counters)
    return _WORKSPACES[key]


def decode_linear(
    x: Tensor, weight: Tensor, *, block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int,
    gated: str | None = None, block_m: int | None = None,
) -> Tensor:  # fmt: skip
    """x [M, K] @ weight[N, K].T -> [M, N] in x's dtype (float32 accumulation), or with gated="silu" /
    "gelu_tanh" and weight [2I, K] = [gate | up] rows, act(x @ gate.T) * (x @ up.T) -> [M, I] (split_k 1).
    block_m: rows per program, default_block_m(M) unless given (a power of two, 16 at least)."""
    rows, depth = x.shape
    width, weight_depth = weight.shape
    if weight_depth != depth:
        raise ValueError(f"x [{rows}, {depth}] and weight [{width}, {weight_depth}] do not share K")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must be contiguous along K")
    if gated is not None:
        if gated not in ACTIVATIONS:
            raise ValueError(f"no fused kernel for activation {gated!r}; one of {ACTIVATIONS}")
        if split_k != 1:
            raise ValueError("a gated decode_linear runs with split_k 1 (its epilogue needs whole sums)")
        if width % 2:
            raise ValueError(f"a gated weight holds [gate | up] rows: an even count, not {width}")
        width //= 2
    block_m = block_m or default_block_m(rows)
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, 16 at least, not {block_m}")
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows == 0 or width == 0:
        return out
    k_per_split = triton.cdiv(triton.cdiv(depth, block_k), split_k) * block_k
    partials, counters = _workspace(x.device, rows, width, split_k) if split_k > 1 else (out, out)
    grid = (triton.cdiv(rows, block_m) * split_k * triton.cdiv(width, block_n),)
    _decode_gemm_kernel[grid](
        x, weight, out, partials, counters,
        rows, width, depth, x.stride(0), weight.stride(0), out.stride(0), k_per_split, split_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split_k > 1, GATED=gated is not None,
        GELU=gated == "gelu_tanh", EVEN_K=depth % block_k == 0, IEEE=x.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def candidate_configs(
    rows: int, width: int, depth: int, *, gated: bool = False, num_sms: int = 132, limit: int = 16,
    shared_memory: int = 227 * 1024,
) -> list[dict]:  # fmt: skip
    """Launch settings worth timing for x [rows, depth] @ weight [width, depth].T (gated: width = 2I rows,
    I outputs), at most `limit`, each a dict of decode_linear's keywords.

    Tiles: block_n 32 / 64 / 128, block_k 64 / 128 / 256, block_m the default (and 128 past 128 rows); a
    split_k of 1 / 2 / 4 / 8 such that the programs make 0.75-4.5 waves of num_sms (each split at least
    two K steps; gated: split_k 1 only); warps 8 for accumulators of 128 x 128 or more, else 4; stages 4
    where they fit in shared_memory, else 3. Ordered by closeness to two waves; the first also comes with
    the other warp count and with 3 / 5 stages."""
    outputs = width // 2 if gated else width
    weight_rows = 2 if gated else 1  # weight tiles a program loads per K step
    base = []
    block_ms = sorted({default_block_m(rows)} | ({128} if rows > 128 else set()))
    for block_m, block_n, block_k in itertools.product(block_ms, (32, 64, 128), (64, 128, 256)):
        per_stage = (block_m + weight_rows * block_n) * block_k * 2  # bytes of one pipeline stage (16-bit)
        if 3 * per_stage > shared_memory or block_m * block_n * weight_rows > 128 * 256:  # shared memory, registers
            continue
        tiles = triton.cdiv(rows, block_m) * triton.cdiv(outputs, block_n)
        k_steps = triton.cdiv(depth, block_k)
        for split_k in (1,) if gated else (1, 2, 4, 8):
            waves = tiles * split_k / num_sms
            if split_k > 1 and (k_steps < 2 * split_k or waves > 4.5):
                continue
            if split_k == 1 and waves < 0.75 and not gated and k_steps >= 4 and 2 * waves <= 4.5:
                continue  # too few programs while split_k 2 (allowed: two K steps a split) would add more
            stages = 4 if 4 * per_stage <= shared_memory else 3
            warps = 8 if block_m * block_n * weight_rows >= 128 * 128 else 4
            base.append(dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=warps, num_stages=stages))
    base.sort(key=lambda c: abs(math.log2(triton.cdiv(rows, c["block_m"]) * triton.cdiv(outputs, c["block_n"]) * c["split_k"] / (2 * num_sms))))
    variants = []
    for config in base[:1]:
        per_stage = (config["block_m"] + weight_rows * config["block_n"]) * config["block_k"] * 2
        variants.append({**config, "num_warps": 12 - config["num_warps"]})
        variants += [{**config, "num_stages": s} for s in (3, 5) if s != config["num_stages"] and s * per_stage <= shared_memory]
    chosen = base[: max(limit - len(variants), 1)] + variants
    return chosen[:limit]
