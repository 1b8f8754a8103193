"""The one place a generation backend is chosen: a config of generation/base.py in, a Generator out, each
backend imported only when chosen (so no backend imports this module, and none of them each other)."""

from __future__ import annotations

import logging
from typing import Any

from tandemrl.generation.base import EngineConfig, Generator, GeneratorConfig, HFConfig, RemoteConfig

log = logging.getLogger(__name__)


def build_generator(config: GeneratorConfig, *, model: Any = None, tokenizer: Any = None, tp: Any = None, adapter_rank: int = 0) -> Generator:
    """The one place a backend is chosen. `model`/`tokenizer`: the trainer's, in colocate mode. `tp`: the
    engine's tensor-parallel group (generation/engine/parallel.py), when it is split across ranks.
    `adapter_rank`: a colocated LoRA policy served beside the trainer's base (train/lora.py), the engine only."""
    match config:
        case EngineConfig():
            from tandemrl.generation.engine import Engine, unsupported_reason

            reason = unsupported_reason(config, model=model)
            if reason is None:
                return Engine(config, model=model, tokenizer=tokenizer, tp=tp, adapter_rank=adapter_rank)
            if config.tensor_parallel_size > 1:
                raise ValueError(f"{reason}: the engine cannot serve it, and only the engine takes --tensor_parallel_size")
            log.warning("engine: %s; falling back to the hf generator", reason)
            from tandemrl.generation.hf import HFGenerator

            hf_config = HFConfig(model=config.model, dtype=config.dtype, device=config.device)
            generator = HFGenerator(hf_config, model=model, tokenizer=tokenizer)
            generator.fallback_reason = reason
            return generator
        case HFConfig():
            from tandemrl.generation.hf import HFGenerator

            return HFGenerator(config, model=model, tokenizer=tokenizer)
        case RemoteConfig():
            from tandemrl.generation.remote import RemoteGenerator

            return RemoteGenerator(config)
    raise ValueError(f"unknown generator config {config!r}")
