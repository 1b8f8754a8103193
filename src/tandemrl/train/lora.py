"""LoRA through peft: only the adapters train; everything outside sees one plain model.

A colocated engine serves the policy one of two ways (--lora_engine). shared: the trainer's frozen base
becomes views of the engine's weights (one copy in the process), and the engine applies the adapters
beside them (generation/engine/layers/lora.py), taking only the adapters at each sync (`adapter_weights`).
merged: the engine holds its own copy and receives the merged weights under the Hugging Face names it
knows, each adapted weight merged on the fly (W + scale x B @ A into a new tensor, one layer at a time), so
the trained base is never touched. The reference policy (--beta) is the base itself: the policy with its adapters disabled
(peft's `disable_adapter`), no second copy. Checkpoints hold the adapter in peft's format and, on request,
the merged model. Under torchrun FSDP2 shards the transformers model inside the peft model, adapters
included; merged weights are then sharded tensors, made whole by whoever reads them (LocalSync, a
checkpoint). peft is imported here only (an optional dependency: `pip install tandemrl[lora]`).
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tandemrl.train.config import LoraConfig


def apply_lora(model: Any, config: LoraConfig, *, adapter_dir: str | None = None) -> Any:
    """`model` wrapped in a peft model with fresh adapters, or those saved in `adapter_dir` (resume)."""
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import PeftModel, get_peft_model
    except ImportError:
        raise ValueError("--lora_r needs peft: pip install 'tandemrl[lora]' (or pip install peft)") from None
    if adapter_dir is not None:
        return _float32_adapters(PeftModel.from_pretrained(model, adapter_dir, is_trainable=True))
    targets = list(config.lora_target_modules)
    peft_config = PeftLoraConfig(
        r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout, task_type="CAUSAL_LM",
        target_modules="all-linear" if targets == ["all-linear"] else targets, modules_to_save=list(config.lora_modules_to_save) or None,
    )  # fmt: skip
    model = get_peft_model(model, peft_config)
    inner = model.get_base_model()
    if any(hasattr(m, "base_layer") or hasattr(m, "original_module") for m in (inner.get_input_embeddings(), inner.get_output_embeddings())):
        raise ValueError(
            "--lora_target_modules / --lora_modules_to_save: leave out the embeddings and the head (the fused logprob head "
            "reads the head's weight directly, and a tied head would differ from its embedding)"
        )
    return _float32_adapters(model)


def _float32_adapters(model: Any) -> Any:
    """Over a 16-bit base: every trained tensor in float32 (peft upcasts the adapters, not the modules it
    saves), and the adapters take the layer's 16-bit input as it is (no float32 copy of every adapted
    layer's input kept for backward; autocast runs them in 16 bits: train/forward.py)."""
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
    if next(unwrap(model).parameters()).dtype != torch.float32:
        for module in model.modules():
            if hasattr(module, "lora_A"):
                module.cast_input_dtype_enabled = False
    return model


def runs_under_autocast(model: Any) -> bool:
    """A LoRA policy over a 16-bit base with float32 adapters: its forward runs under 16-bit autocast."""
    return is_lora(model) and next(unwrap(model).parameters()).dtype in (torch.bfloat16, torch.float16)


def is_lora(model: Any) -> bool:
    peft = sys.modules.get("peft")  # a model can only be a peft model once peft is imported
    return peft is not None and isinstance(model, peft.PeftModel)


def trained_whole(name: str) -> bool:
    """Whether a parameter of the peft model belongs to a module trained whole (--lora_modules_to_save).

    Example: "base_model.model.model.norm.modules_to_save.default.weight" -> True; "...q_proj.lora_A.default.weight" -> False
    """
    return ".modules_to_save." in name


def unwrap(model: Any) -> Any:
    """The transformers model (with its LoRA layers inside, for a peft model)."""
    return model.get_base_model() if is_lora(model) else model


def reference_policy(model: Any) -> contextlib.AbstractContextManager:
    """For the block, `model` computes the base policy: its adapters disabled."""
    return model.disable_adapter()


@torch.no_grad()
def merged_weights(model: Any, *, changed_only: bool = False) -> Iterator[tuple[str, Tensor]]:
    """(Hugging Face name, tensor) of the policy as one plain model; the adapters themselves are not sent.
    `changed_only`: only what training changes (adapted weights merged, modules trained whole), for a
    generator that holds the rest already.

    Example: layers.0.self_attn.q_proj.base_layer.weight W, with adapter delta D
      -> ("model.layers.0.self_attn.q_proj.weight", W + D); q_proj.base_layer.bias b -> ("...q_proj.bias", b)
    """
    inner = unwrap(model)
    for name, param in inner.named_parameters():
        if ".lora_" in name or ".original_module." in name:  # a module trained whole sends its trained copy
            continue
        name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", name)
        owner, base, leaf = name.rpartition(".base_layer.")
        if not base:
            if not changed_only or param.requires_grad:  # a module trained whole (modules_to_save) changes
                yield name, param.detach()
            continue
        layer = inner.get_submodule(owner)
        if leaf == "weight":
            deltas = [layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A]
            # in the base's dtype: the engine's, and half the transient bytes of float32 over a 16-bit base
            yield f"{owner}.weight", (param.detach() + sum(deltas)).to(param.dtype) if deltas else param.detach()
        elif not changed_only:
            yield f"{owner}.{leaf}", param.detach()


def frozen_base(model: Any) -> list[tuple[str, Tensor]]:
    """(Hugging Face name, parameter) of the frozen base: every weight but the adapters and the modules trained
    whole (--lora_engine shared hands these to the engine, which keeps them in its own tensors).

    Example: ...q_proj.base_layer.weight -> ("model.layers.0.self_attn.q_proj.weight", the parameter)
    """
    return [
        (name.replace(".base_layer.", "."), param) for name, param in unwrap(model).named_parameters()
        if not param.requires_grad and ".lora_" not in name and ".original_module." not in name and ".modules_to_save." not in name
    ]  # fmt: skip


@torch.no_grad()
def adapter_weights(model: Any, *, unshared: set[str] = frozenset()) -> Iterator[tuple[str, Tensor]]:  # type: ignore[assignment]
    """What an engine serving beside the shared base takes (--lora_engine shared): each adapted layer's
    lora_A and lora_B (B times the adapter's scaling) under the layer's Hugging Face name, and the modules
    trained whole; plus the frozen weights named in `unshared` (those the engine keeps a copy of its own).

    Example: q_proj with A [r, E], B [Q, r], scaling s -> ("...q_proj.lora_A.weight", A), ("...q_proj.lora_B.weight", s B)
    """
    inner = unwrap(model)
    for name, module in inner.named_modules():
        if not isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict):  # a peft LoRA layer has them
            continue
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        if not adapters:
            continue
        if len(adapters) > 1:
            raise ValueError(f"{name}: {len(adapters)} active adapters; the engine applies one")
        (adapter,) = adapters
        yield f"{name}.lora_A.weight", module.lora_A[adapter].weight.detach()
        yield f"{name}.lora_B.weight", module.lora_B[adapter].weight.detach() * module.scaling[adapter]
    for name, param in inner.named_parameters():
        if trained_whole(name):
            yield re.sub(r"\.modules_to_save\.[^.]+\.", ".", name), param.detach()
    for name, param in frozen_base(model):
        if name in unshared:
            yield name, param.detach()


class BaseView:
    """What the engine reads of a peft model it serves beside the shared base: the frozen base (unmerged)
    and the modules trained whole, under plain names; the adapters come with the first weight update."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = unwrap(model).config

    def state_dict(self) -> dict[str, Tensor]:
        whole = {re.sub(r"\.modules_to_save\.[^.]+\.", ".", n): p.detach() for n, p in unwrap(self.model).named_parameters() if trained_whole(n)}
        return {**{name: param.detach() for name, param in frozen_base(self.model)}, **whole}


class MergedView:
    """What the engine reads of a transformers model (`config`, `state_dict()`), for a peft model: the
    merged weights under plain names."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = unwrap(model).config

    def state_dict(self) -> dict[str, Tensor]:
        return dict(merged_weights(self.model))


def save_merged(model: Any, path: Path | None, gather: Callable[[Tensor], Tensor] | None = None) -> None:
    """The merged policy as a plain Hugging Face model (loadable by transformers as is) in `path`.
    Sharded (under torchrun): every rank calls it with `gather` (makes a shard whole, a collective);
    only the rank given a `path` writes."""
    weights = {name: gather(tensor).cpu() if gather else tensor for name, tensor in merged_weights(model)}
    if path is not None:
        unwrap(model).save_pretrained(path, state_dict=weights, safe_serialization=True)
