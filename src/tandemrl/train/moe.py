"""Mixture-of-experts policies in the trainer, through transformers' own MoE blocks: routing replay and the
router's auxiliary load-balancing loss, both by forward hooks on each router (the class transformers
records `router_logits` from), so packed attention, the fused head, compile and FSDP stay as they are.

Legend: N packed tokens, M sparse layers, X experts, k experts per token.

Routing replay (Ma et al. 2025, "Stabilizing MoE RL by aligning training and inference routers"): a token
with recorded routes goes to the experts that sampled it; their weights are still the router's own
softmax probabilities of those experts (renormalised as the model does), so the router trains through
them. Tokens without routes (prompts, tool outputs) route as the model routes them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from tandemrl.types import route_itemsize


@dataclass(kw_only=True)
class RouteLayout:
    """How Completion.routes is laid out for this model: [T, num_layers, top_k] of `dtype`."""

    num_layers: int
    top_k: int
    dtype: np.dtype


@dataclass
class RouterHooks:
    """The hooks' shared state: the routes of the forward about to run (None: the model routes alone)
    and the router logits it produced (written by the hooks, read by `aux_loss`)."""

    routers: list[nn.Module]
    routes: Tensor | None = None  # [N, M, k] long, -1 where a token has none
    logits: list[Tensor] = field(default_factory=list)  # [N, X] per sparse layer, this forward's


def routers_of(model: Any) -> list[nn.Module]:
    """The router modules of a transformers MoE model, in layer order ([] for a dense model)."""
    recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    return [m for m in model.modules() if isinstance(m, target)] if isinstance(target, type) else []


def route_layout(model: Any) -> RouteLayout | None:
    """The layout of the routes a generator records for `model`, or None when it has no experts."""
    routers = routers_of(model)
    if not routers:
        return None
    itemsize = route_itemsize(routers[0].num_experts)
    return RouteLayout(num_layers=len(routers), top_k=routers[0].top_k, dtype=np.dtype(np.uint8 if itemsize == 1 else "<i2"))


def hooks(model: Any) -> RouterHooks | None:
    """`model`'s router hooks, installed on first use (None for a dense model). The routes set before a
    forward stay set until the next one: gradient checkpointing recomputes the forward during backward."""
    installed = getattr(model, "_tandem_router_hooks", None)
    if installed is not None:
        return installed or None  # False: a dense model, looked at once
    routers = routers_of(model)
    if not routers:
        model._tandem_router_hooks = False
        return None
    state = RouterHooks(routers=routers)
    for layer, router in enumerate(routers):
        # the state hangs on the router, not in a closure: a deepcopy of the model (the reference, a compute
        # twin) then reads its own copy of it
        router._tandem_router = (state, layer)
        router.register_forward_hook(_router_hook)
    model._tandem_router_hooks = state
    return state


def _router_hook(router: nn.Module, _args: Any, output: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor] | None:
    state, layer = router._tandem_router
    logits, scores, ids = output  # [N, X], [N, k], [N, k]
    state.logits.append(logits)
    if state.routes is None:
        return None
    recorded = state.routes[:, layer]  # [N, k]
    assert recorded.shape[0] == logits.shape[0], "routes set for another batch: call prepare_forward before each forward"
    ids = torch.where(recorded[:, :1] >= 0, recorded, ids)
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(scores.dtype), ids


def prepare_forward(model: Any, routes: Tensor | None) -> RouterHooks | None:
    """Before each forward of `model`: its routes (replayed where recorded) and a fresh list of logits."""
    state = hooks(model)
    if state is not None:
        state.routes = routes
        state.logits = []
    return state


def aux_loss(model: Any, state: RouterHooks) -> Tensor:
    """transformers' load-balancing loss of the last forward (Switch Transformer's, eqs. 4-6), as the
    model's family computes it (its modeling module's `load_balancing_loss_func`)."""
    module = next(sys.modules[c.__module__] for c in type(model).__mro__ if hasattr(sys.modules[c.__module__], "load_balancing_loss_func"))
    return module.load_balancing_loss_func(tuple(state.logits), state.routers[0].num_experts, state.routers[0].top_k)


def packed_routes(traces: list, starts: np.ndarray, num_tokens: int, layout: RouteLayout) -> np.ndarray:
    """[N, M, k] the recorded experts each packed position is routed to, -1 where none: a trace's sampled
    token j was sampled by the forward of position j - 1, so its routes go there (as its logprob does).

    Example: one trace of 4 tokens whose tokens 2..3 carry routes [[1, 0]] and [[2, 3]] (M 1, k 2)
      -> [[-1, -1], [1, 0], [2, 3], [-1, -1]] (one layer each)
    """
    width = layout.num_layers * layout.top_k
    table = np.full((num_tokens, width), -1, dtype=np.int64)
    for start, trace in zip(starts, traces):
        for first, data in trace.routes:
            rows = np.frombuffer(data, dtype=layout.dtype).reshape(-1, width)
            at = start + first - 1
            skip = max(0, start - at)  # a trace's first token has no position before it
            table[at + skip : at + len(rows)] = rows[skip:]
    return table.reshape(num_tokens, layout.num_layers, layout.top_k)
