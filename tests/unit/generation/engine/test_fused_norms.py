"""The fused norms of models/llama.py's FUSED_NORMS against the kernels they replace and the torch path,
in triton's interpreter on CPU (where triton is installed; tests/gpu runs them on a GPU): Gemma's norm after
attention and the one before the MLP in one pass (norm.py, pre_weight), and each q/k head's RMSNorm inside the
RoPE + cache kernel (rope_kernel.py, HeadNorm), in both of transformers' norm orders."""

from __future__ import annotations

import importlib.util
import os

import numpy
import pytest
import torch

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (CI)")
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' modules are imported: they run on CPU tensors
    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        needs_triton = pytest.mark.skip(reason="triton's interpreter needs numpy < 2.4")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ORDERS = [(0.0, False), (1.0, True)]  # Qwen3's (normed x rounded, then times w), Gemma's ((1 + w) in float32, then rounded)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit in the interpreter; on a GPU a reduction over another thread layout may round an ulp apart."""
    if DEVICE == "cpu":
        return torch.equal(a.cpu(), b.cpu())
    tol = 1e-6 if a.dtype == torch.float32 else 1e-2
    return torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset, in_float32", ORDERS)
def test_two_norms_in_one_pass_equal_two_calls_and_the_torch_path(dtype, offset, in_float32):
    from tandemrl.generation.engine.layers.norm import rms_norm
    from tandemrl.generation.engine.models.llama import RMSNorm

    torch.manual_seed(0)
    first, second = (RMSNorm(96, 1e-6, offset=offset, in_float32=in_float32).to(dtype) for _ in range(2))
    first.weight.data.normal_()
    second.weight.data.normal_()
    h, residual = (torch.randn(7, 96, dtype=dtype) * 3 for _ in range(2))
    on = lambda t: t.to(DEVICE)  # noqa: E731
    kw = dict(offset=offset, in_float32=in_float32)
    fused, fused_sum = rms_norm(on(h), on(second.weight), 1e-6, on(residual), pre_weight=on(first.weight), **kw)
    normed = rms_norm(on(h), on(first.weight), 1e-6, **kw)
    two, two_sum = rms_norm(normed, on(second.weight), 1e-6, on(residual), **kw)
    assert _same(fused, two) and _same(fused_sum, two_sum)  # the same roundings
    expected_sum = first._norm(h) + residual
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the kernel's float32 sum of squares and torch's round apart by an ulp
    assert torch.allclose(fused_sum.cpu().float(), expected_sum.float(), atol=tol * 5, rtol=tol)
    assert torch.allclose(fused.cpu().float(), second._norm(expected_sum).float(), atol=tol * 5, rtol=tol * 2)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset, in_float32", ORDERS)
@pytest.mark.parametrize("rotary", [32, 24])  # whole heads, and 3/4 of them (partial rotary)
def test_head_norm_in_the_rope_kernel_equals_the_norm_kernel_then_rope(dtype, offset, in_float32, rotary):
    from tandemrl.generation.engine.layers.norm import rms_norm
    from tandemrl.generation.engine.layers.rope import apply_rope
    from tandemrl.generation.engine.layers.rope_kernel import HeadNorm, rope_and_cache_
    from tandemrl.generation.engine.models.llama import RMSNorm

    torch.manual_seed(1)
    n, heads, kv_heads, dim, slots = 5, 6, 2, 32, 16
    q_norm, k_norm = (RMSNorm(dim, 1e-6, offset=offset, in_float32=in_float32).to(dtype) for _ in range(2))
    q_norm.weight.data.normal_()
    k_norm.weight.data.normal_()
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, dtype=dtype) * 2
    positions, slot_mapping = torch.randint(0, 64, (n,)), torch.randperm(slots)[:n]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary, 2).float() / rotary))
    emb = torch.arange(64).float()[:, None] * inv_freq
    table = torch.stack((torch.cat((emb, emb), -1).cos(), torch.cat((emb, emb), -1).sin()), 1)  # [P, 2, R]
    on = lambda t: t.to(DEVICE)  # noqa: E731
    kw = dict(offset=offset, in_float32=in_float32)
    # the kernels it replaces: the norm kernel on each head, then RoPE + cache
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    normed_q = rms_norm(on(q.reshape(-1, dim)), on(q_norm.weight), 1e-6, **kw).reshape(n, -1)
    normed_k = rms_norm(on(k.reshape(-1, dim)), on(k_norm.weight), 1e-6, **kw).reshape(n, -1)
    two = torch.cat((normed_q, normed_k, on(v)), dim=-1)
    two_cache = torch.zeros(2, slots, kv_heads, dim, dtype=dtype, device=DEVICE)
    rope_and_cache_(two, heads, kv_heads, dim, on(positions), on(table), on(slot_mapping), two_cache[0], two_cache[1])
    fused, cache = on(qkv.clone()), torch.zeros(2, slots, kv_heads, dim, dtype=dtype, device=DEVICE)
    norm = HeadNorm(on(q_norm.weight), on(k_norm.weight), 1e-6, offset, in_float32)
    rope_and_cache_(fused, heads, kv_heads, dim, on(positions), on(table), on(slot_mapping), cache[0], cache[1], norm)
    assert _same(fused, two) and _same(cache, two_cache)
    # and the torch path (models/llama.py's RMSNorm, rope.py's apply_rope)
    cos_sin = table[positions].to(dtype)
    expected_q = apply_rope(q_norm._norm(q.view(n, heads, dim)), cos_sin[:, :1], cos_sin[:, 1:])
    expected_k = apply_rope(k_norm._norm(k.view(n, kv_heads, dim)), cos_sin[:, :1], cos_sin[:, 1:])
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    assert torch.allclose(fused.cpu()[:, : heads * dim].view(n, heads, dim).float(), expected_q.float(), atol=tol, rtol=tol)
    assert torch.allclose(cache.cpu()[0][slot_mapping].float(), expected_k.float(), atol=tol, rtol=tol)
    assert torch.equal(cache.cpu()[1][slot_mapping], v.view(n, kv_heads, dim))
