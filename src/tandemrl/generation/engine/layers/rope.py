"""Rotary position embeddings: every scaling a supported checkpoint asks for, as one position-indexed table.

Legend: P positions of the table, R rotary dims (head dim x partial_rotary_factor), N tokens, H heads.

The engine looks cos/sin up by position (`rope_table`: [P, 2, R] float32, the attention factor of YaRN and
LongRoPE folded in), so a key's rotation never changes once it is in the cache. Types, after transformers 5's
modeling_rope_utils: default, linear, llama3 (Llama 3.1's frequency bands), yarn (Peng et al. 2023: bands
interpolated by a ramp, cos/sin scaled by 0.1 ln(factor) + 1), dynamic (NTK-aware: the base grows with the
length) and longrope (Phi-3: per-dimension factors, short below the pretraining length, long past it).
Two types depend on the sequence length in transformers, which recomputes the frequencies each forward
from the longest position: the table gives position p what transformers gives a token decoded at p (dynamic:
the base for length p + 1; longrope: long factors from the pretraining length on). Below the pretraining
length (dynamic: max_position_embeddings) both equal transformers exactly.
The GPU applies the table in layers/rope_kernel.py (fused with the cache write); `apply_rope` is the torch path.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict:
    """The flat RoPE parameters of `config` (of `layer_type`'s layers when they differ: Gemma 3), with
    rope_type, rope_theta and partial_rotary_factor always set."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None and layer_type in rope:
        rope = rope[layer_type]
    rope = dict(rope)
    rope.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    return rope


def rotary_dim(config: Any, rope: dict) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * rope["partial_rotary_factor"])


def inv_freq(rope: dict, dim: int, max_position_embeddings: int) -> tuple[Tensor, float]:
    """([R/2] float32 inverse frequencies, the factor cos/sin are scaled by) of a length-independent type
    (dynamic and longrope: their frequencies below the pretraining length)."""
    base, kind = rope["rope_theta"], rope["rope_type"]
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    match kind:
        case "default" | "dynamic":
            return plain, 1.0
        case "linear":
            return plain / rope["factor"], 1.0
        case "llama3":
            return _llama3(plain, rope), 1.0
        case "yarn":
            return _yarn(rope, dim, max_position_embeddings)
        case "longrope":
            return _longrope(rope, dim, max_position_embeddings, long=False)
    raise ValueError(f"rope type {kind!r} is not one of the engine's {', '.join(ROPE_TYPES)}")


def rope_table(config: Any, max_positions: int, layer_type: str | None = None) -> Tensor:
    """[P, 2, R] float32: cos and sin of every position, scaled by the type's attention factor."""
    rope = rope_parameters(config, layer_type)
    dim, kind = rotary_dim(config, rope), rope["rope_type"]
    positions = torch.arange(max_positions, dtype=torch.float32)[:, None]  # [P, 1]
    freq, factor = inv_freq(rope, dim, config.max_position_embeddings)
    freqs = positions * freq[None, :]  # [P, R/2]
    if kind == "dynamic":
        freqs = torch.where(positions < config.max_position_embeddings, freqs, positions * _dynamic(rope, dim, config.max_position_embeddings, max_positions))
    elif kind == "longrope":
        original = rope["original_max_position_embeddings"]
        long_freq, _ = _longrope(rope, dim, config.max_position_embeddings, long=True)
        freqs = torch.where(positions < original, freqs, positions * long_freq[None, :])
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, R]
    return torch.stack((emb.cos() * factor, emb.sin() * factor), dim=1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [N, H, D], cos/sin [N, 1, R] in x's dtype; rotate-half convention of transformers, on the first R
    dims of each head (the rest pass through: partial rotary)."""
    dim = cos.shape[-1]
    rot, rest = (x, None) if dim == x.shape[-1] else (x[..., :dim], x[..., dim:])
    half = dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rest is None else torch.cat((out, rest), dim=-1)


def _llama3(freq: Tensor, rope: dict) -> Tensor:
    # Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between the bands
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > old_len / low, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: dict, dim: int, max_position_embeddings: int) -> tuple[Tensor, float]:
    base, original = rope["rope_theta"], rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / original

    def scale_of(mscale: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = scale_of(mscale) / scale_of(mscale_all_dim) if mscale and mscale_all_dim else scale_of()
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original length
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(fast), dim_of(slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    powers = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1 - ramp  # 1: the dimension keeps its frequency, 0: it is interpolated
    return (1.0 / (factor * powers)) * ramp + (1.0 / powers) * extrapolated, float(attention_factor)


def _dynamic(rope: dict, dim: int, max_position_embeddings: int, max_positions: int) -> Tensor:
    """[P, R/2]: the frequencies NTK-aware scaling gives a sequence of length p + 1 (the base for p + 1 tokens)."""
    factor = rope["factor"]
    lengths = torch.arange(1, max_positions + 1, dtype=torch.float64).clamp(min=max_position_embeddings)[:, None]
    bases = rope["rope_theta"] * ((factor * lengths / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return (1.0 / (bases.float() ** exponents[None, :])).float()


def _longrope(rope: dict, dim: int, max_position_embeddings: int, *, long: bool) -> tuple[Tensor, float]:
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * rope["rope_theta"] ** shape), float(attention_factor)
