"""Packed attention for any transformers causal LM: each sequence of a packed row attends to itself only.

Legend: N packed tokens, S sequences, H query heads, K key/value heads, D head size.
Registered with transformers as the attention function "tandem_packed"; the model forward passes the
row's layout as `cu_seq_lens_q` (S + 1 start offsets, int32) and `max_length_q`. The cost grows with
the sum of squared sequence lengths, never with the square of the micro-batch: on CUDA in 16-bit it
is torch's variable-length flash attention; elsewhere (CPU, float32) a causal SDPA per sequence.
No dense [N, N] mask is built: transformers skips mask creation for attention functions it does not
know. A layer's `sliding_window` W (Mistral, Gemma, ...: a query sees its last W tokens) and `softcap` c
(Gemma 2: scores c * tanh(s / c)), which transformers passes as keyword arguments, are honoured: a window
through flash attention's window size, a soft cap (flash here has none) by the per-sequence path.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import Tensor

NAME = "tandem_packed"


@functools.cache
def register() -> str:
    """Registers the attention function with transformers (once per process); returns its name."""
    from transformers import AttentionInterface

    _VARLEN.update(_varlen_options() or {})
    AttentionInterface.register(NAME, packed_attention)
    return NAME


def use_packed_attention(model: torch.nn.Module) -> None:
    """Switches `model` (a transformers PreTrainedModel) to packed attention."""
    model.set_attn_implementation(register())


def layout(cu_seqlens: Tensor, max_seqlen: int) -> dict:
    """The forward kwargs that describe a packed row: where each sequence starts, and the longest.

    Example: sequences of 3 and 2 tokens -> cu_seqlens [0, 3, 5], max_seqlen 3
    """
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_seqlen, "max_length_k": max_seqlen}


def packed_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention signature: query [1, H, N, D], key/value [1, K, N, D] -> ([1, N, H, D], None)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        raise ValueError("packed attention needs cu_seq_lens_q (train.attention.layout of the packed row)")
    assert query.shape[0] == 1, "packed rows have batch size 1"
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D], [N, K, D]
    max_len = int(kwargs.get("max_length_q") or q.shape[0])
    window, softcap = int(kwargs.get("sliding_window") or 0), float(kwargs.get("softcap") or 0.0)
    flash = q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and _VARLEN and not softcap
    if flash and (not window or "window_size" in _VARLEN):
        out = _flash(q, k, v, cu, max_len, scaling, window)
    else:
        out = _per_sequence(q, k, v, cu, scaling, window, softcap)
    return out.unsqueeze(0), None  # [1, N, H, D]


_VARLEN: dict = {}  # varlen_attn's causal GQA options, filled by register(); empty where torch lacks it


def _varlen_options() -> dict | None:
    """Keyword arguments for a causal GQA call of torch's varlen_attn, or None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True} if "is_causal" in params else None
    if causal is None:
        return None
    return causal | ({"enable_gqa": True} if "enable_gqa" in params else {})


def _flash(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, scaling: float | None, window: int = 0) -> Tensor:
    from torch.nn.attention.varlen import varlen_attn

    options = dict(_VARLEN)
    if window:  # keys i - (W - 1) .. i
        options["window_size"] = (window - 1, 0)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and "enable_gqa" not in options:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if scaling is not None:
        options["scale"] = scaling
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **options)  # [N, H, D]


def _per_sequence(q: Tensor, k: Tensor, v: Tensor, cu: Tensor, scaling: float | None, window: int = 0, softcap: float = 0.0) -> Tensor:
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)  # [N, H, D]
    bounds = cu.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H or K, L, D]
        if groups > 1:
            ks, vs = ks.repeat_interleave(groups, dim=0), vs.repeat_interleave(groups, dim=0)
        if not window and not softcap:
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling).transpose(0, 1)
            continue
        positions = torch.arange(end - start, device=q.device)
        distance = positions[:, None] - positions[None, :]  # [L, L] query - key
        allowed = (distance >= 0) & (distance < window) if window else distance >= 0
        if not softcap:
            out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, scale=scaling).transpose(0, 1)
            continue
        # transformers' eager order: scale, cap, mask, softmax in float32
        scores = (qs @ ks.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)  # [H, L, L]
        scores = (torch.tanh(scores / softcap) * softcap).masked_fill(~allowed, float("-inf"))
        out[start:end] = (scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ vs).transpose(0, 1)
    return out
