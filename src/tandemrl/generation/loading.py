"""Loading models and tokenizers by id or directory, with one-line errors that say what to fix."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but no CUDA GPU is visible; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; use one of auto, {', '.join(dtypes)}")
    return dtypes[name]


MODEL_FILES = ("config.json", "adapter_config.json", "tokenizer_config.json", "tokenizer.json")  # what loads from a directory


def _check_source(name: str) -> None:
    if not name:
        raise ValueError("no model given; pass --model with a Hugging Face id or a local directory")
    looks_local = name.startswith((".", "/", "~")) or os.sep in name and name.count("/") != 1
    path = os.path.expanduser(name)
    if looks_local and not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {name!r} does not exist; pass an existing directory or a hub id")
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in MODEL_FILES):
        raise FileNotFoundError(
            f"directory {name!r} holds no model (no config.json): pass a directory written by save_pretrained, a "
            "tandem train checkpoint-N, or a hub id"
        )  # transformers' words were "Unrecognized model", or for a tokenizer "You need to have sentencepiece"


def load_tokenizer(name: str, *, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    _check_source(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(name), trust_remote_code=trust_remote_code)
    except OSError as error:
        raise FileNotFoundError(f"cannot load a tokenizer from {name!r}: {str(error).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name: str, *, dtype: torch.dtype, device: torch.device, **init_kwargs: Any) -> Any:
    """A causal LM in `dtype` on `device`; `init_kwargs` go to from_pretrained (TRL's model_init_kwargs)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    _check_source(name)
    try:
        ignored = {k: init_kwargs.pop(k) for k in ("dtype", "torch_dtype") if k in init_kwargs}
        if ignored:
            log.warning("model_init_kwargs %s ignored: the policy's dtype is --dtype's (%s)", ignored, dtype)
        kwargs = {**init_kwargs, "dtype": dtype}  # attention: transformers' default, sdpa (eager where a model lacks it: Gemma 2)
        model = AutoModelForCausalLM.from_pretrained(os.path.expanduser(name), **kwargs)
    except OSError as error:
        raise FileNotFoundError(f"cannot load a causal LM from {name!r}: {str(error).splitlines()[0]}") from None
    except SafetensorError as error:  # a truncated or corrupt weights file
        raise ValueError(f"cannot read the weights of {name!r} ({error}); the file is truncated or corrupt: copy or download it again") from None
    return model.to(device)
