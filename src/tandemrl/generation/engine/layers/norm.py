"""Triton RMSNorm, with the residual add fused (as transformers rounds it), in both of transformers' orders:
Llama's (the normed x rounded, then times w) and Gemma's / OLMo 2's (times offset + w in float32, then
rounded). Imported only on CUDA; models/llama.py holds the torch path and tests/gpu checks one against the other."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _normed(x, w, E, eps, OFFSET: tl.constexpr, IN_F32: tl.constexpr):
    # RMSNorm of one row x (activation dtype) by w, in float32, in the family's order; float32, not yet rounded
    xf = x.to(tl.float32)
    normed = xf * tl.rsqrt(tl.sum(xf * xf, 0) / E + eps)
    if IN_F32:
        return normed * (OFFSET + w.to(tl.float32))
    return (OFFSET + w.to(tl.float32)) * normed.to(x.dtype).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, w0_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, E, eps,
    HAS_RES: tl.constexpr, PRE_NORM: tl.constexpr, BLOCK_E: tl.constexpr, OFFSET: tl.constexpr, IN_F32: tl.constexpr,
):  # fmt: skip
    # one row: (x + residual) rounded to the activation dtype, then RMSNorm in float32 (as transformers);
    # PRE_NORM: x is first normed by w0 and rounded (Gemma's norm after attention, then the one before the MLP)
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    x = tl.load(x_ptr + row * stride_x + e, mask=valid, other=0.0)
    if PRE_NORM:
        x = _normed(x, tl.load(w0_ptr + e, mask=valid, other=0.0), E, eps, OFFSET, IN_F32).to(x.dtype)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + e, mask=valid, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_o + e, x, mask=valid)
    y = _normed(x, tl.load(w_ptr + e, mask=valid, other=0.0), E, eps, OFFSET, IN_F32)
    tl.store(out_ptr + row * stride_o + e, y.to(out_ptr.dtype.element_ty), mask=valid)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, *, offset: float = 0.0, in_float32: bool = False,
    pre_weight: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """x [R, E] (any leading shape) -> RMSNorm(x [+ residual]) * (offset + weight); with a residual also
    returns the sum. `in_float32`: the product in float32, then rounded (else the normed x is rounded first).
    `pre_weight`: x is first replaced by its own RMSNorm by pre_weight, rounded (two norms in one pass, as
    two calls would give them: Gemma's after attention and before the MLP)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    res2 = residual.reshape(-1, shape[-1]) if residual is not None else x2
    _rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, weight if pre_weight is None else pre_weight, out, res_out, x2.stride(0), res2.stride(0), out.stride(0), shape[-1], eps,
        HAS_RES=residual is not None, PRE_NORM=pre_weight is not None, BLOCK_E=triton.next_power_of_2(shape[-1]), OFFSET=offset,
        IN_F32=in_float32, num_warps=4,
    )  # fmt: skip
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)
