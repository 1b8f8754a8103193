"""What each supported transformers config asks of the engine's one decoder (models/llama.py): every way the
families differ, named, read from the config once (`Family.of`), so the decoder branches on fields, never on
model types. `unsupported_reason` says why a config cannot run (the factory then falls back to transformers).

| model_type | differences from Llama |
|---|---|
| llama | none (Llama 3's RoPE scaling is a RoPE type) |
| qwen2 | qkv bias; sliding window on the layers layer_types names |
| qwen3 | per-head RMSNorm of q and k |
| qwen3_moe | as qwen3, with sparse MLPs (models/qwen3_moe.py replaces them) |
| olmoe | RMSNorm of the whole q and k projections; sparse MLPs (models/qwen3_moe.py) |
| mixtral | as mistral, with sparse MLPs (models/qwen3_moe.py) |
| mistral | a sliding window on every layer (when sliding_window is set) |
| phi3 | q/k/v and gate/up fused in the checkpoint; window on every layer; partial rotary, longrope |
| olmo2 | norms after attention and MLP (none before); RMSNorm of the whole q and k projections |
| smollm3 | layers without RoPE (no_rope_layers 0) |
| gemma2 | (1 + w) norms before and after attention and MLP; embeddings x sqrt(E); gelu-tanh MLP; scale 1/sqrt(query_pre_attn_scalar); attention and final logits soft-capped; window on alternate layers |
| gemma3_text | as gemma2 without caps, with per-head q/k norms and a RoPE of its own for windowed layers |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from tandemrl.generation.engine.layers.attention import AttentionOptions
from tandemrl.generation.engine.layers.rope import ROPE_TYPES, rope_parameters

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "olmoe", "mixtral", "mistral", "phi3", "olmo2", "smollm3", "gemma2", "gemma3_text")
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
GEMMA = ("gemma2", "gemma3_text")


@dataclass(frozen=True, kw_only=True, slots=True)
class Layer:
    """One decoder layer's attention rule and RoPE table (an index into the model's tables; -1: no RoPE)."""

    attention: AttentionOptions
    rope: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Family:
    """The named differences of one config; written by `Family.of` alone."""

    model_type: str
    qkv_bias: bool  # Qwen2, attention_bias
    o_bias: bool
    mlp_bias: bool
    qk_norm: Literal["", "head", "projection"]  # Qwen3 / Gemma 3: each head; OLMo 2: each whole projection
    norms: Literal["pre", "post", "sandwich"]  # Llama: before attention and MLP; OLMo 2: after; Gemma: both
    norm_offset: float  # Gemma stores RMSNorm weights as w - 1 and applies (1 + w)
    norm_in_float32: bool  # Gemma, OLMo 2: normed x times w in float32, then rounded; Llama rounds first
    activation: Literal["silu", "gelu_tanh"]
    embed_scale: float  # Gemma: sqrt(hidden_size), rounded to the activation dtype; else 1
    final_softcap: float  # Gemma 2: logits = c * tanh(logits / c); 0: none
    fused_checkpoint: bool  # Phi-3: the checkpoint holds qkv_proj and gate_up_proj themselves
    rope_layer_types: tuple[str | None, ...]  # the RoPE tables: one per layer type with its own (Gemma 3: two)
    layers: tuple[Layer, ...]

    @property
    def freeable_window(self) -> int:
        """The window every layer has (0 when a layer sees its whole context): the KV cache frees what falls out of it."""
        windows = [layer.attention.window for layer in self.layers]
        return min(windows) if windows and all(windows) else 0

    @staticmethod
    def of(config: Any) -> Family:
        """The family of a transformers config; ValueError (the reason) when the engine cannot run it."""
        reason = unsupported_reason(config)
        if reason is not None:
            raise ValueError(reason)
        kind, gemma = config.model_type, config.model_type in GEMMA
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        scale = (config.query_pre_attn_scalar if gemma else head_dim) ** -0.5
        softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
        rope_types: tuple[str | None, ...] = ("sliding_attention", "full_attention") if kind == "gemma3_text" else (None,)
        layers = []
        for i, layer_type in enumerate(_layer_types(config)):
            window = _window(config, layer_type)
            rope = rope_types.index(layer_type) if kind == "gemma3_text" else 0
            if kind == "smollm3" and not config.no_rope_layers[i]:
                rope = -1
            layers.append(Layer(attention=AttentionOptions(scale=scale, window=window, softcap=softcap), rope=rope))
        return Family(
            model_type=kind,
            qkv_bias=kind == "qwen2" or bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm="head" if kind in ("qwen3", "qwen3_moe", "gemma3_text") else "projection" if kind in ("olmo2", "olmoe") else "",
            norms="sandwich" if gemma else "post" if kind == "olmo2" else "pre",
            norm_offset=1.0 if gemma else 0.0,
            norm_in_float32=gemma or kind == "olmo2",
            activation=ACTIVATIONS[_activation(config)],  # type: ignore[arg-type]
            embed_scale=config.hidden_size**0.5 if gemma else 1.0,
            final_softcap=float(getattr(config, "final_logit_softcapping", None) or 0.0),
            fused_checkpoint=kind == "phi3",
            rope_layer_types=rope_types,
            layers=tuple(layers),
        )


def unsupported_reason(config: Any) -> str | None:
    """Why the engine cannot run this transformers config, or None when it can."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model type {model_type!r} is not one of the engine's {', '.join(SUPPORTED_MODEL_TYPES)}"
    for layer_type in ("sliding_attention", "full_attention") if model_type == "gemma3_text" else (None,):
        kind = rope_parameters(config, layer_type)["rope_type"]
        if kind not in ROPE_TYPES:
            return f"rope type {kind!r} is not supported by the engine (it runs {', '.join(ROPE_TYPES)})"
    if _activation(config) not in ACTIVATIONS:
        return f"activation {_activation(config)!r} is not supported by the engine"
    if getattr(config, "clip_qkv", None) is not None:
        return "clip_qkv (OLMoE's clamp of q, k and v) is not supported by the engine"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention is not supported by the engine"
    unknown = set(_layer_types(config)) - {"full_attention", "sliding_attention"}
    if unknown:
        return f"layer types {sorted(unknown)} are not supported by the engine"
    return None


def _activation(config: Any) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def _layer_types(config: Any) -> list[str]:
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


def _window(config: Any, layer_type: str) -> int:
    """The layer's sliding window (0: none), by transformers' rule of each family."""
    window = getattr(config, "sliding_window", None) or 0
    if config.model_type in ("mistral", "phi3", "mixtral"):  # every layer, whenever the config sets one
        return window
    if config.model_type == "smollm3" and not config.use_sliding_window:
        return 0
    return window if layer_type == "sliding_attention" else 0
