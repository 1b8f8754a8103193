"""Our rollout engine: paged KV cache, continuous batching, prefix sharing, CUDA-graph decode.

`Engine` is a Generator; `unsupported_reason` says why a model cannot run on it (the factory then
falls back to the hf Generator).
"""

from __future__ import annotations

from typing import Any


def unsupported_reason(config: Any, *, model: Any = None) -> str | None:
    """Why the engine cannot serve `config.model` (or the in-memory `model`), or None when it can."""
    from tandemrl.generation.engine.models import load_hf_config
    from tandemrl.generation.engine.models.family import unsupported_reason as reason_for

    return reason_for(model.config if model is not None else load_hf_config(config.model))


def __getattr__(name: str) -> Any:
    if name == "Engine":  # lazy: importing the package stays cheap
        from tandemrl.generation.engine.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine", "unsupported_reason"]
