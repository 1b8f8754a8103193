"""The engine's decoder, one for every family it serves: Llama 3, Qwen2/2.5/3, Mistral, Phi-3, OLMo 2, SmolLM3,
Gemma 2 and Gemma 3 text. How the families differ is named in models/family.py (`Family`): this code reads
its fields, never a model type. One flat token dimension (no padding), paged attention, fused qkv and gate/up.

Legend: N tokens of the step, E hidden size, H query heads, K key/value heads, D head dim, V vocab.

Parameter names are the Hugging Face ones, except the fused `qkv_proj` and `gate_up_proj`, which
`load_weight` fills from q/k/v_proj and gate/up_proj (Phi-3's checkpoint has them fused already), so
`update_weights` takes Hugging Face names. With tensor parallelism (parallel.py) every parameter holds
this rank's shard, and `load_weights` cuts it from the full Hugging Face tensor (`_split`): query heads,
key/value heads (each rank one of them when there are fewer than ranks), MLP columns and vocab rows are
split, and OLMo 2's whole-projection q/k norms with their heads; other norms are whole on every rank.
Numerics follow transformers: RMSNorm in float32, rotate-half RoPE from a float32 cos/sin table.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandemrl.generation.engine.layers import lora
from tandemrl.generation.engine.layers.attention import AttentionMetadata, paged_attention
from tandemrl.generation.engine.layers.rope import apply_rope, rope_table
from tandemrl.generation.engine.layers.sharded import RowParallelLinear, VocabParallelEmbedding, gathered_logits
from tandemrl.generation.engine.models.family import SUPPORTED_MODEL_TYPES, Family, Layer, unsupported_reason
from tandemrl.generation.engine.models.load_plan import LOAD_BATCH, LoadPlan, copy_all
from tandemrl.generation.engine.parallel import Shard, TensorParallel

__all__ = ["SUPPORTED_MODEL_TYPES", "LlamaForCausalLM", "unsupported_reason"]

# On CUDA, each q/k head's RMSNorm (Qwen3, Gemma 3) inside the RoPE + cache kernel instead of two norm kernels and
# a copy of qkv, and Gemma's norm after attention and the one before the MLP in one kernel: the same arithmetic and
# roundings as the kernels it replaces. On since an H200 timed it (Gemma-3-4B decode device time 1.033x less,
# bench/RESULTS.md); False runs the separate kernels (`bench/families.py --fused_norms off,on` times both).
FUSED_NORMS = True


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + w). `in_float32`: the product taken in float32, then rounded (Gemma, OLMo 2);
    else the normed x rounded first (Llama)."""

    def __init__(self, size: int, eps: float, *, offset: float = 0.0, in_float32: bool = False, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.offset, self.in_float32 = eps, offset, in_float32
        self.tp = tp  # set: the normed vector is split over the ranks (OLMo 2's q/k projections): its mean is over all

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """RMSNorm(x), or with `residual`: (RMSNorm(x + residual), x + residual). Fused on CUDA."""
        if x.is_cuda and self.tp is None:
            from tandemrl.generation.engine.layers.norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual, offset=self.offset, in_float32=self.in_float32)
        if residual is not None:
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        if self.tp is None:
            mean_square = x.pow(2).mean(-1, keepdim=True)
        else:  # each rank holds 1 / size of the vector (or a replica of one head: the sum then counts it size / K times)
            mean_square = self.tp.all_reduce(x.pow(2).sum(-1, keepdim=True)) / (x.shape[-1] * self.tp.size)
        x = x * torch.rsqrt(mean_square + self.eps)
        if self.in_float32:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return (self.offset + self.weight) * x.to(dtype) if self.offset else self.weight * x.to(dtype)


def check_shardable(config: Any, size: int) -> None:
    """Raises ValueError when `size` ranks cannot split this model's heads and MLP evenly."""
    heads, kv_heads, inner = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if heads % size or inner % size or (kv_heads % size and size % kv_heads):
        raise ValueError(
            f"--tensor_parallel_size {size} does not divide the model ({heads} attention heads, {kv_heads} key/value "
            f"heads, MLP width {inner}); pick a size that divides the heads and the MLP width"
        )


class Attention(nn.Module):
    def __init__(self, config: Any, family: Family, layer: Layer, head_dim: int, tp: TensorParallel | None) -> None:
        super().__init__()
        size = tp.size if tp is not None else 1
        self.num_heads = config.num_attention_heads // size  # this rank's
        self.num_kv_heads = max(config.num_key_value_heads // size, 1)  # one, replicated, when fewer than ranks
        self.head_dim = head_dim
        self.options, self.rope_index = layer.attention, layer.rope
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.qkv_sizes = [self.num_heads * head_dim, self.num_kv_heads * head_dim, self.num_kv_heads * head_dim]
        self.qkv_proj = lora.Linear(hidden, sum(self.qkv_sizes), bias=family.qkv_bias)
        self.o_proj = RowParallelLinear(self.num_heads * head_dim, hidden, bias=family.o_bias, tp=tp)
        norm = dict(offset=family.norm_offset, in_float32=family.norm_in_float32)
        if family.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(head_dim, eps, **norm), RMSNorm(head_dim, eps, **norm)
        elif family.qk_norm == "projection":
            self.q_norm = RMSNorm(self.qkv_sizes[0], eps, **norm, tp=tp)
            self.k_norm = RMSNorm(self.qkv_sizes[1], eps, **norm, tp=tp)
        self.per_head_norm = family.qk_norm == "head"
        self.k_cache = self.v_cache = torch.empty(0)  # [S, K, D] views into the runner's cache

    def forward(self, x: Tensor, ropes: list[tuple[Tensor, Tensor]], meta: AttentionMetadata) -> Tensor:
        """`ropes`: per RoPE table, (positions [N], table [P, 2, R]) on CUDA, else (cos, sin) [N, 1, R]."""
        qkv = self.qkv_proj(x)  # [N, (H + 2K) * D]
        head_norm = None
        if FUSED_NORMS and self.per_head_norm and self.rope_index >= 0 and x.is_cuda:  # normed in the RoPE kernel below
            from tandemrl.generation.engine.layers.rope_kernel import HeadNorm

            head_norm = HeadNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.offset, self.q_norm.in_float32)
        elif hasattr(self, "q_norm"):
            q, k, v = qkv.split(self.qkv_sizes, dim=-1)
            if self.per_head_norm:
                q, k = self.q_norm(q.unflatten(-1, (-1, self.head_dim))).flatten(1), self.k_norm(k.unflatten(-1, (-1, self.head_dim))).flatten(1)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
            qkv = torch.cat((q, k, v), dim=-1)
        q, k, v = (t.view(len(x), -1, self.head_dim) for t in qkv.split(self.qkv_sizes, dim=-1))  # [N, H or K, D]
        cached = False
        if self.rope_index >= 0 and x.is_cuda:  # one fused kernel: RoPE in place on the qkv buffer, then k and v into the cache
            from tandemrl.generation.engine.layers.rope_kernel import rope_and_cache_

            positions, table = ropes[self.rope_index]
            rope_and_cache_(
                qkv, self.num_heads, self.num_kv_heads, self.head_dim, positions, table, meta.slot_mapping, self.k_cache, self.v_cache, head_norm
            )  # fmt: skip
            cached = True
        elif self.rope_index >= 0:
            cos, sin = ropes[self.rope_index]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, self.k_cache, self.v_cache, meta, cached=cached, options=self.options)  # [N, H, D]
        return self.o_proj(out.reshape(len(x), -1))


class MLP(nn.Module):
    def __init__(self, config: Any, family: Family, tp: TensorParallel | None) -> None:
        super().__init__()
        inner = config.intermediate_size // (tp.size if tp is not None else 1)  # this rank's columns
        self.gate_up_proj = lora.Linear(config.hidden_size, 2 * inner, bias=family.mlp_bias)
        self.down_proj = RowParallelLinear(inner, config.hidden_size, bias=family.mlp_bias, tp=tp)
        self.activation = family.activation

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if x.is_cuda:  # one fused pass: act(gate) * up
            from tandemrl.generation.engine.layers.activation import gated

            return self.down_proj(gated(gate_up.view(-1, gate_up.shape[-1]), self.activation).view(*x.shape[:-1], -1))
        gate, up = gate_up.chunk(2, dim=-1)
        gate = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * up)


class DecoderLayer(nn.Module):
    """Norm placements (family.norms): "pre" norms the input of attention and of the MLP (Llama); "post" norms
    their outputs (OLMo 2); "sandwich" both (Gemma). The residual stream is carried as (output, residual), the
    sum taken by the next norm (fused on CUDA), as transformers rounds it."""

    def __init__(self, config: Any, family: Family, layer: Layer, head_dim: int, tp: TensorParallel | None) -> None:
        super().__init__()
        self.self_attn = Attention(config, family, layer, head_dim, tp)
        self.mlp = MLP(config, family, tp)
        self.norms = family.norms
        size, norm = config.hidden_size, dict(eps=config.rms_norm_eps, offset=family.norm_offset, in_float32=family.norm_in_float32)
        if self.norms != "post":
            self.input_layernorm = RMSNorm(size, **norm)
        self.post_attention_layernorm = RMSNorm(size, **norm)
        if self.norms == "sandwich":
            self.pre_feedforward_layernorm = RMSNorm(size, **norm)
        if self.norms != "pre":
            self.post_feedforward_layernorm = RMSNorm(size, **norm)

    def forward(self, x: Tensor, residual: Tensor | None, ropes: list, meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next norm adds them."""
        if self.norms == "post":
            h = x if residual is None else x + residual
            h = self.post_attention_layernorm(self.self_attn(h, ropes, meta)) + h
            return self.post_feedforward_layernorm(self.mlp(h)), h
        h, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        h = self.self_attn(h, ropes, meta)
        if self.norms == "sandwich":
            if FUSED_NORMS and h.is_cuda and self.post_attention_layernorm.tp is None:  # both norms in one kernel
                from tandemrl.generation.engine.layers.norm import rms_norm

                pre, post = self.pre_feedforward_layernorm, self.post_attention_layernorm
                h, residual = rms_norm(h, pre.weight, pre.eps, residual, offset=pre.offset, in_float32=pre.in_float32, pre_weight=post.weight)
            else:
                h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Backbone(nn.Module):
    def __init__(self, config: Any, family: Family, head_dim: int, tp: TensorParallel | None, vocab_rows: tuple[int, int]) -> None:
        super().__init__()
        start, rows = vocab_rows
        self.embed_tokens = VocabParallelEmbedding(rows, config.hidden_size, start=start, tp=tp)
        self.layers = nn.ModuleList(DecoderLayer(config, family, layer, head_dim, tp) for layer in family.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, offset=family.norm_offset, in_float32=family.norm_in_float32)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [N], positions [N], meta) -> hidden [N, E]; compute_logits(hidden) -> [*, V].
    `tp`: this rank's group when the model is split across ranks (every rank runs the same calls).
    The decoder of every family (the name is the first one's)."""

    def __init__(self, config: Any, max_positions: int, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.family = Family.of(config)
        self.tp = tp
        self.shard = Shard(tp.rank, tp.size) if tp is not None else Shard()
        check_shardable(config, self.shard.size)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rows = -(-config.vocab_size // self.shard.size)  # the last rank's rows padded with zeros
        self.vocab_rows = (self.shard.rank * rows, rows)
        self.model = Backbone(config, self.family, self.head_dim, tp, self.vocab_rows)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        self.max_positions = max_positions
        self.rope_cos_sin = torch.empty(0)  # [T, P, 2, R] float32, set by rope_table(); kept out of .to(dtype)
        self._routes: dict[str, tuple[str | None, int | None, int]] = {}  # written by _route alone
        self._adapter_routes: dict[str, tuple[lora.Adapter, str, int, slice]] = {}  # written by _adapter_target alone
        self._load_plan: LoadPlan | None = None  # the last list load_weights copied (written by load_weights alone)
        self._full_shapes: dict[str, torch.Size] = {}  # each Hugging Face name's whole shape, as loaded (written by load_weights alone)

    def rope_table(self) -> Tensor:
        """[T, P, 2, R]: a cos/sin table per RoPE the layers use (Gemma 3: its windowed layers' and the others')."""
        return torch.stack([rope_table(self.config, self.max_positions, layer_type) for layer_type in self.family.rope_layer_types])

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        x = self.model.embed_tokens(input_ids)  # [N, E]
        if self.family.embed_scale != 1.0:  # Gemma: the scale rounded to the activation dtype first, as transformers
            x = x * float(torch.tensor(self.family.embed_scale, dtype=x.dtype))
        if x.is_cuda:
            ropes = [(positions, table) for table in self.rope_cos_sin]
        else:
            cos_sin = self.rope_cos_sin[:, positions].to(x.dtype)  # [T, N, 2, R]
            ropes = [(table[:, :1], table[:, 1:]) for table in cos_sin]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, ropes, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        logits = gathered_logits(hidden, weight, self.config.vocab_size, self.tp)
        cap = self.family.final_softcap
        if cap and logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16) and logits.is_contiguous():
            from tandemrl.generation.engine.layers.activation import softcap_

            return softcap_(logits, cap)  # the same bits in one pass
        return logits if not cap else torch.tanh(logits / cap) * cap  # Gemma 2, in the logits' dtype as transformers

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Copies Hugging Face-named tensors into this model (a q/k/v or gate/up tensor into its shard of
        the fused weight). Returns the names of the parameters written.

        A list laid out as the last one (names, storage, shapes, strides, dtypes; one rank) is copied by that
        load's plan, with no per-tensor routing: a server's staged update is the same list of views into the
        same buffer every time. The very list object of the last load, when it can be weakly referenced (a
        server's StagedTensors, handed over unchanged every update), skips even building the key.

        A tensor of another shape than its parameter's (or of a name this model lacks) is a ValueError naming
        it; a list is checked whole before any copy, so a refused one leaves the weights as they were (a
        stream, e.g. colocated LoRA merges made one at a time, is copied as it comes, in batches)."""
        plan = self._load_plan
        if plan is not None and plan.source is not None and plan.source() is weights:
            plan.replay(weights)
            return set(plan.written)
        key = [(n, t.data_ptr(), t.shape, t.stride(), t.dtype) for n, t in weights] if isinstance(weights, list) and self.shard.size == 1 else None
        if key is not None and plan is not None and plan.key == key:
            plan.replay(weights)
            return set(plan.written)
        params, written = dict(self.named_parameters()), set()
        targets: list[Tensor] = []
        sources: list[Tensor] = []
        plan = LoadPlan(key=key or [], batches=[], written=written)
        whole = isinstance(weights, list)
        for index, (given, tensor) in enumerate(weights):
            name = "model.embed_tokens.weight" if given == "lm_head.weight" and self.tie_word_embeddings else given
            full = tensor
            if ".lora_" in name:  # an adapter (peft's name), where the engine serves beside a shared base: layers/lora.py
                target = self._adapter_target(name, tensor)
            else:
                tensor = self._split(name, tensor)
                param_name, start, size = self._route(name, params)
                if param_name is None:
                    continue
                target = params[param_name]
                if start is not None:
                    target = target[start : start + size]
            if tensor.shape != target.shape:  # copy_ broadcasts: a [1, H] tensor would fill every row of a [V, H] one
                part = " (this rank's part)" if self.shard.size > 1 else ""
                raise ValueError(f"tensor {given} has shape {list(tensor.shape)}{part}; this model's is {list(target.shape)}")
            self._full_shapes[given] = full.shape
            if target.data_ptr() != tensor.data_ptr():
                plan.add(target, index)
                targets.append(target)
                sources.append(tensor)
            if len(targets) == LOAD_BATCH and not whole:
                copy_all(targets, sources)
            written.add(name)
        for first in range(0, len(targets), LOAD_BATCH):
            copy_all(targets[first : first + LOAD_BATCH], sources[first : first + LOAD_BATCH])
        self._load_plan = plan.grouped([t for _, t in weights]) if key is not None else None
        if self._load_plan is not None:
            with contextlib.suppress(TypeError):  # a plain list cannot be weakly referenced: keyed every time
                self._load_plan.source = weakref.ref(weights)
        return written

    def attach_adapters(self, rank: int) -> None:
        """Zero LoRA adapters of `rank` on every projection (layers/lora.py): the engine then serves the base
        weights it holds plus the adapters that weight updates write under peft's names. One rank only."""
        if self.shard.size > 1:
            raise ValueError("the engine applies LoRA adapters beside its base on one rank only (--tensor_parallel_size 1)")
        fused = 1 if self.family.fused_checkpoint else None  # Phi-3: the trainer's own qkv/gate_up carry one adapter each
        for layer in self.model.layers:
            lora.attach(layer.self_attn.qkv_proj, slots=fused or 3, rank=rank)
            lora.attach(layer.self_attn.o_proj, slots=1, rank=rank)
            lora.attach(layer.mlp.gate_up_proj, slots=fused or 2, rank=rank)
            lora.attach(layer.mlp.down_proj, slots=1, rank=rank)

    def base_views(self, names: Iterable[str]) -> dict[str, Tensor]:
        """For Hugging Face names: the engine's tensor that holds each (a row range of a fused one for q/k/v and
        gate/up), for a trainer that keeps its frozen base in them. One rank only."""
        assert self.shard.size == 1, "one rank"
        params, views = dict(self.named_parameters()), {}
        for given in names:
            name = "model.embed_tokens.weight" if given == "lm_head.weight" and self.tie_word_embeddings else given
            param_name, start, size = self._route(name, params)
            if param_name is not None:
                views[given] = params[param_name] if start is None else params[param_name][start : start + size]
        return views

    def _adapter_target(self, name: str, tensor: Tensor) -> Tensor:
        """Where peft's adapter tensor `name` goes: its rows of the projection's stacked A, or its block of B.
        An adapter of rank r below the engine's R fills the first r of its slot's R (the rest stay zero).

        Example: "model.layers.0.self_attn.k_proj.lora_B.weight" [K, R] -> qkv_proj's B[Q : Q + K, R : 2R]
        """
        route = self._adapter_routes.get(name)
        if route is None:  # names only: cached, as _route's (a sync sends ~14 adapter tensors a layer, every step)
            route = self._adapter_routes[name] = self._find_adapter_route(name)
        adapter, leaf, slot, rows = route
        rank = tensor.shape[0 if leaf == "A.weight" else -1]
        if rank > adapter.rank:
            raise ValueError(f"update_weights: {name!r} has rank {rank}; this engine takes adapters of rank <= {adapter.rank} (--max_lora_rank)")
        columns = slice(slot * adapter.rank, slot * adapter.rank + rank)
        return adapter.a[columns] if leaf == "A.weight" else adapter.b[rows, columns]

    def _find_adapter_route(self, name: str) -> tuple[lora.Adapter, str, int, slice]:
        """(the projection's adapters, "A.weight" or "B.weight", the part's slot, the part's rows of B)."""
        owner, _, leaf = name.partition(".lora_")
        if leaf not in ("A.weight", "B.weight"):
            raise ValueError(f"update_weights: {name!r}: an adapter tensor is lora_A.weight or lora_B.weight")
        path, _, part = owner.rpartition(".")
        fused = next(((f, index) for p, f, index in _FUSED if p == part), None)
        try:
            module = self.get_submodule(f"{path}.{fused[0]}" if fused else owner)
        except AttributeError:
            raise ValueError(f"update_weights: the model has no layer for the adapter {name!r}") from None
        adapter = getattr(module, "adapter", None)
        if adapter is None:
            raise ValueError(f"update_weights: {name!r} is a LoRA adapter, and this engine holds none (it serves merged weights)")
        slot = fused[1] if fused else 0
        sizes = self._fused_sizes(fused[0]) if fused else [adapter.b.shape[0]]
        return adapter, leaf, slot, slice(sum(sizes[:slot]), sum(sizes[: slot + 1]))

    def check_shapes(self, weights: list[tuple[str, Tensor]]) -> None:
        """ValueError naming the first tensor whose whole shape is not the one this name loaded with: what a
        tensor-parallel leader checks before any rank hears of an update (each rank checks its part only as
        it copies, after the tensors before it)."""
        for name, tensor in weights:
            expected = self._full_shapes.get(name)
            if expected is not None and tensor.shape != expected:
                raise ValueError(f"tensor {name} has shape {list(tensor.shape)}; this model's is {list(expected)}")

    def _route(self, name: str, params: dict[str, Tensor]) -> tuple[str | None, int | None, int]:
        """(the parameter that Hugging Face's `name` goes to, its first row there or None for all, rows),
        (None, None, 0) for a name to skip. Names only: cached, since every update of ~300 tensors paid
        for these string and module look-ups again."""
        route = self._routes.get(name)
        if route is None:
            route = self._routes[name] = self._find_route(name, params)
        return route

    def _find_route(self, name: str, params: dict[str, Tensor]) -> tuple[str | None, int | None, int]:
        for part, fused, index in _FUSED:
            fused_name = name.replace(f".{part}.", f".{fused}.")
            if fused_name != name and fused_name in params:
                sizes = self._fused_sizes(fused)
                return fused_name, sum(sizes[:index]), sizes[index]
        if name in params:
            return name, None, 0
        if "rotary_emb" in name:
            return None, None, 0
        raise ValueError(f"update_weights: the model has no parameter {name!r}")

    def _fused_sizes(self, fused: str) -> list[int]:
        if fused == "qkv_proj":
            return self.model.layers[0].self_attn.qkv_sizes
        size = self.config.intermediate_size // self.shard.size
        return [size, size]

    def _split(self, name: str, tensor: Tensor) -> Tensor:
        """This rank's part of the full Hugging Face tensor `name` (the tensor itself on one rank)."""
        if self.shard.size == 1:
            return tensor
        config, head_dim = self.config, self.head_dim
        heads, kv_heads = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            start, rows = self.vocab_rows
            part = tensor[start : start + rows]
            return torch.cat((part, part.new_zeros(rows - len(part), *part.shape[1:]))) if len(part) < rows else part
        if ".qkv_proj." in name:  # fused in the checkpoint (Phi-3): each part cut as its own projection's
            q, k, v = tensor.split([heads, kv_heads, kv_heads])
            return torch.cat((self._split(".q_proj.", q), self._split(".k_proj.", k), self._split(".v_proj.", v)))
        if ".gate_up_proj." in name:
            gate, up = tensor.chunk(2)
            return torch.cat((self._split(".gate_proj.", gate), self._split(".up_proj.", up)))
        if self.family.qk_norm == "projection" and (".q_norm." in name or ".k_norm." in name):  # OLMo 2: cut with their heads
            return self._split(name.replace("_norm.", "_proj."), tensor)
        return self._cut(name, tensor)

    def _cut(self, name: str, tensor: Tensor) -> Tensor:
        config, shard, head_dim = self.config, self.shard, self.head_dim
        kv_heads = config.num_key_value_heads
        if ".q_proj." in name or name.endswith("o_proj.weight"):
            start, length = shard.span(config.num_attention_heads)
        elif ".k_proj." in name or ".v_proj." in name:
            start, length = shard.span(kv_heads) if kv_heads >= shard.size else (shard.rank * kv_heads // shard.size, 1)
        elif ".gate_proj." in name or ".up_proj." in name or name.endswith("down_proj.weight"):
            return tensor.narrow(-1 if name.endswith("down_proj.weight") else 0, *shard.span(config.intermediate_size))
        else:  # norms and row-parallel biases: whole on every rank
            return tensor
        return tensor.narrow(-1 if name.endswith("o_proj.weight") else 0, start * head_dim, length * head_dim)


_FUSED = (
    ("q_proj", "qkv_proj", 0),
    ("k_proj", "qkv_proj", 1),
    ("v_proj", "qkv_proj", 2),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)
