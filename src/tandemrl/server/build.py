"""Builds a rollout server from its config: the Generator backend, the tokenizer, the checks on
prompts, the weight receiver, and the app. The one place the server's backend is chosen."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from tandemrl.generation.base import EngineConfig, HFConfig, describe_generator

from tandemrl.generation.factory import build_generator
from tandemrl.generation.loading import load_tokenizer, resolve_device
from tandemrl.server.app import build_app
from tandemrl.server.config import RolloutServerConfig
from tandemrl.server.prompts import Prompter
from tandemrl.server.service import RolloutService
from tandemrl.weights import ipc
from tandemrl.weights.group import WeightReceiver


def build_server(
    config: RolloutServerConfig,
    engine: EngineConfig,
    *,
    heartbeat_s: float = 0.0,
    model: Any = None,
    tokenizer: Any = None,
    on_rank_death: Callable[[int, int | None], None] | None = None,
) -> Any:
    """`engine`: the served model and the engine's settings (its dtype and device serve hf too). `model` and
    `tokenizer`, when given, are served instead of loading `engine.model` (a model built in code). With
    --tensor_parallel_size N this process is rank 0 and starts ranks 1..N-1; `on_rank_death(rank, exit code)`
    is called if one of them dies."""
    from transformers import AutoConfig

    import torch

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(engine.model)
    text_config = (model.config if model is not None else AutoConfig.from_pretrained(engine.model)).get_text_config()
    max_model_len = engine.model_len(max_positions=getattr(text_config, "max_position_embeddings", None))
    device = resolve_device(engine.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    match config.backend:
        case "hf":
            generator = build_generator(HFConfig(model=engine.model, dtype=engine.dtype, device=str(device)), model=model, tokenizer=tokenizer)
        case "engine":
            sized = dataclasses.replace(
                engine, device=str(device), max_model_len=max_model_len, gpu_memory_utilization=engine.memory_fraction(colocated=False)
            )
            tp = None
            if sized.tensor_parallel_size > 1 and config.max_lora_rank:
                raise ValueError("--max_lora_rank runs on one GPU: drop it or --tensor_parallel_size")
            if sized.tensor_parallel_size > 1:
                from tandemrl.generation.engine.workers import launch

                assert on_rank_death is not None
                tp, _ = launch(sized, model=model, tokenizer=tokenizer, on_death=on_rank_death)
            generator = build_generator(sized, model=model, tokenizer=tokenizer, tp=tp, adapter_rank=config.max_lora_rank)
    service = RolloutService(
        generator,
        model_name=config.served_model_name or engine.model,
        max_model_len=max_model_len,
        max_pending_requests=config.max_pending_requests,
        result_ttl_s=config.result_ttl_s,
        drain_timeout_s=config.drain_timeout_s,
        receiver=WeightReceiver(device),
        device_uuid=ipc.device_uuid(device),
    )
    prompter = Prompter(tokenizer, vocab_size=text_config.vocab_size, max_model_len=max_model_len, max_prompt_chars=config.max_prompt_chars)
    app = build_app(service, prompter, api_key=config.api_key, heartbeat_s=heartbeat_s, max_request_bytes=config.max_request_bytes)
    app.state.generator = describe_generator(generator)  # what `tandem rollout`'s first line says serves
    return app
