"""Triton fused act(gate) * up of the MLP, act silu (Llama, Qwen, Mistral, Phi-3, OLMo 2, SmolLM3) or tanh-GELU
(Gemma 2/3): one pass over [gate | up] instead of three (activation, then product); and Gemma 2's final
logit soft-cap in one pass instead of three. Imported only on CUDA; models/llama.py holds the torch paths
and tests/gpu checks each against its torch form, bit for bit."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import libdevice

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


@triton.jit
def _softcap_kernel(x_ptr, n, inv_cap, cap, BLOCK: tl.constexpr):
    # in place, one block: cap * tanh(x / cap) with torch's roundings of a 16-bit tensor (each op computes in
    # float32 and rounds): x times the float32 reciprocal of cap (torch divides by a scalar so), tanh
    # (libdevice's tanhf, which torch's CUDA tanh calls), times cap
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = i < n
    x = tl.load(x_ptr + i, mask=valid, other=0.0)
    y = (x.to(tl.float32) * inv_cap).to(x.dtype).to(tl.float32)
    y = libdevice.tanh(y).to(x.dtype).to(tl.float32)
    tl.store(x_ptr + i, (y * cap).to(x.dtype), mask=valid)


def softcap_(x: Tensor, cap: float) -> Tensor:
    """In place: x = cap * tanh(x / cap), equal bit for bit to torch.tanh(x / cap) * cap on a contiguous
    16-bit x (Gemma 2's final logits: one read and write of [rows, vocab] instead of three)."""
    assert x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16)
    block = 4096
    _softcap_kernel[(triton.cdiv(x.numel(), block),)](x, x.numel(), _reciprocal32(cap), cap, BLOCK=block, num_warps=8)
    return x


@functools.cache
def _reciprocal32(cap: float) -> float:
    # 1 / cap in float32, as torch's opmath computes it for a tensor divided by a scalar (once per cap, not a step)
    return (torch.tensor(1.0) / torch.tensor(cap, dtype=torch.float32)).item()
