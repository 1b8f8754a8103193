"""Triton kernels of the fused logprob head (algo/logprobs.py): a chunk's float32 logits read once per pass.

Legend: C rows of the chunk, V vocab. `row_stats` is the forward: per row, in one pass (online softmax:
a running max, the sum of exp and the exp-weighted sum of the tempered logits), the row's max, the
log-sum-exp, the target's logprob and the entropy. `logits_grad` is the backward: per row, in one pass,
the gradient of sum(grad * logprob + grad_entropy * entropy) with respect to the raw logits, written in
the weight's dtype. Both take the matmul's raw logits and apply the temperature themselves, so no [C, V]
pass divides; both temper z = (x - max) / T, the max off first (logprobs.py's `_tempered`: logits of ~60
at T = 1e-4 are ~6e5 tempered, where float32's spacing is 1/16), so lse is that of z.
Imported only on CUDA where triton is installed; tests/unit/algo/test_logprobs_kernel.py checks both
against the torch path in triton's interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

TILE = 4096  # vocab entries a program reads per loop step


@triton.jit
def _row_stats_kernel(
    logits_ptr, target_ptr, max_ptr, lse_ptr, logprobs_ptr, entropy_ptr, stride, inv_temp,
    V: tl.constexpr, WITH_ENTROPY: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    # one program per row, z = (x - max) / T with max the running max of the raw logits x. After each tile
    # the max moves to the tile's, each z so far by step = (old - new) / T: sum_exp = sum exp(z) is rescaled
    # by exp(step), and sum_exp_z = sum exp(z) z becomes (sum_exp_z + step * sum_exp) * exp(step). The max
    # starts at the row's first logit (finite: the matmul's, or EXCLUDED), so the first step is finite too.
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    run_max = tl.load(base).to(tl.float32)
    sum_exp = 0.0
    sum_exp_z = 0.0
    for start in range(0, V, TILE):  # V is a constant: one compile per vocab size
        v = start + tl.arange(0, TILE)
        valid = v < V
        x = tl.load(base + v, mask=valid, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, tl.max(x, 0))
        step = (run_max - new_max) * inv_temp
        scale = tl.exp(step)
        z = (x - new_max) * inv_temp
        e = tl.where(valid, tl.exp(z), 0.0)
        if WITH_ENTROPY:
            sum_exp_z = (sum_exp_z + step * sum_exp) * scale + tl.sum(e * tl.where(valid, z, 0.0), 0)
        sum_exp = sum_exp * scale + tl.sum(e, 0)
        run_max = new_max
    lse = tl.log(sum_exp)
    target = tl.load(target_ptr + row)
    z_target = (tl.load(base + target).to(tl.float32) - run_max) * inv_temp
    tl.store(max_ptr + row, run_max)
    tl.store(lse_ptr + row, lse)
    tl.store(logprobs_ptr + row, z_target - lse)
    if WITH_ENTROPY:  # H = lse - E_p[z]
        tl.store(entropy_ptr + row, lse - sum_exp_z / sum_exp)
    else:
        tl.store(entropy_ptr + row, 0.0)


@triton.jit
def _logits_grad_kernel(
    logits_ptr, out_ptr, target_ptr, max_ptr, lse_ptr, grad_ptr, entropy_ptr, grad_entropy_ptr, stride, out_stride, V, inv_temp,
    TILE: tl.constexpr,
):  # fmt: skip
    # one program per (row, tile): d/dz of grad * logprob + grad_entropy * entropy with p = softmax(z) is
    # grad * (onehot(target) - p) - grad_entropy * p * (z - E_p[z]), E_p[z] = lse - entropy; times 1/T.
    # z = (x - max) / T with the forward's max, whose lse this is
    row = tl.program_id(0).to(tl.int64)
    v = tl.program_id(1) * TILE + tl.arange(0, TILE)
    valid = v < V
    lse = tl.load(lse_ptr + row)
    grad = tl.load(grad_ptr + row)
    grad_entropy = tl.load(grad_entropy_ptr + row)
    mean_z = lse - tl.load(entropy_ptr + row)
    target = tl.load(target_ptr + row)
    z = (tl.load(logits_ptr + row * stride + v, mask=valid, other=0.0).to(tl.float32) - tl.load(max_ptr + row)) * inv_temp
    probs = tl.exp(z - lse)
    out = probs * (-grad - grad_entropy * (z - mean_z)) + tl.where(v == target, grad, 0.0)
    tl.store(out_ptr + row * out_stride + v, (out * inv_temp).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=valid)


def row_stats(logits: Tensor, target_ids: Tensor, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(lse, logprobs, entropy, row_max) [C] float32 of the raw logits [C, V]: lse of (logits - row_max) /
    temperature, row_max each row's max; entropy 0 without with_entropy."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "rows of logits are contiguous"
    lse, logprobs, entropy, row_max = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(4))
    _row_stats_kernel[(rows,)](
        logits, target_ids.contiguous(), row_max, lse, logprobs, entropy, logits.stride(0), 1.0 / temperature,
        V=vocab, WITH_ENTROPY=with_entropy, TILE=TILE, num_warps=8,
    )  # fmt: skip
    return lse, logprobs, entropy, row_max


def logits_grad(
    logits: Tensor, row_max: Tensor, lse: Tensor, target_ids: Tensor, grad: Tensor, entropy: Tensor, grad_entropy: Tensor, temperature: float,
    dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    """The gradient [C, V] in `dtype` with respect to the raw logits [C, V]; the per-row inputs are [C] float32
    (row_max and lse: `row_stats`')."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "rows of logits are contiguous"
    out = torch.empty(rows, vocab, dtype=dtype, device=logits.device)
    tile = 2048
    _logits_grad_kernel[(rows, triton.cdiv(vocab, tile))](
        logits, out, target_ids.contiguous(), row_max, lse, grad.contiguous(), entropy, grad_entropy.contiguous(), logits.stride(0), out.stride(0),
        vocab, 1.0 / temperature, TILE=tile, num_warps=8,
    )  # fmt: skip
    return out
