"""Building the engine's model from a Hugging Face directory (safetensors) or an in-memory
transformers model; every load goes through the same name mapping as `update_weights`."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from tandemrl.generation.engine.models.llama import _FUSED, LlamaForCausalLM
from tandemrl.generation.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from tandemrl.generation.engine.parallel import TensorParallel

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {"qwen3_moe": Qwen3MoeForCausalLM, "olmoe": Qwen3MoeForCausalLM, "mixtral": Qwen3MoeForCausalLM}  # else LlamaForCausalLM


def resolve_model_dir(name: str) -> str:
    """A local directory as is; a hub id through the local Hugging Face cache (or a download)."""
    if os.path.isdir(os.path.expanduser(name)):
        return os.path.expanduser(name)
    from huggingface_hub import snapshot_download

    return snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"])


def load_hf_config(name: str) -> Any:
    from transformers import AutoConfig

    if not name:
        raise ValueError("no model given; pass --model with a Hugging Face id or a local directory")
    try:
        return AutoConfig.from_pretrained(os.path.expanduser(name))
    except OSError as error:
        raise FileNotFoundError(f"cannot load a model config from {name!r}: {str(error).splitlines()[0]}") from None


def weights_of(source: Any) -> Iterator[tuple[str, Tensor]]:
    """Hugging Face-named tensors of a transformers model, or of the safetensors files of a directory."""
    if not isinstance(source, str):
        yield from source.state_dict().items()
        return
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(resolve_model_dir(source), "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {source!r}; save the model with save_pretrained")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def build_model(
    hf_config: Any, weights: Iterator[tuple[str, Tensor]], *, dtype: torch.dtype, device: torch.device, max_positions: int,
    tp: TensorParallel | None = None, adapter_rank: int = 0,
) -> LlamaForCausalLM:
    """Allocates the model (this rank's shard, with `tp`) uninitialised on `device`, then fills every
    parameter from `weights` (full Hugging Face tensors); with `adapter_rank`, zero LoRA adapters of that
    rank beside every projection (layers/lora.py), before any CUDA graph is captured over them."""
    with torch.device("meta"):
        model = MODEL_CLASSES.get(hf_config.model_type, LlamaForCausalLM)(hf_config, max_positions, tp).to(dtype)
    model = model.to_empty(device=device).eval()
    model.rope_cos_sin = model.rope_table().to(device)
    written = model.load_weights(weights)
    missing = hf_names(model) - written
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")
    if adapter_rank:
        model.attach_adapters(adapter_rank)
    return model


def eos_ids(tokenizer: Any, hf_config: Any) -> frozenset[int]:
    """The ids that end a sequence: the tokenizer's end-of-sequence token, else the config's (one or a list)."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return frozenset([tokenizer.eos_token_id])
    eos = getattr(hf_config, "eos_token_id", None)
    return frozenset([eos] if isinstance(eos, int) else eos or [])


def hf_names(model: LlamaForCausalLM, *, only: set[str] | None = None) -> set[str]:
    """The Hugging Face names a full load writes (a fused weight counts as its parts); of the parameters
    named in `only`, when given."""
    names = set()
    for name, _ in model.named_parameters():
        if only is not None and name not in only:
            continue
        fused = [(part, f) for part, f, _ in _FUSED if f".{f}." in name and not model.family.fused_checkpoint]
        names |= {name.replace(f".{f}.", f".{part}.") for part, f in fused} if fused else {name}
    return names
