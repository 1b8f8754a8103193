"""The rollout server's leaf config: one `tandem rollout` flag per field.

Invariant: a server bound to a non-loopback address has an API key, unless `--insecure` says otherwise.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class RolloutServerConfig:
    """How `tandem rollout` serves a model: backend, address, limits and the key."""

    model: str = ""
    """Model id or local directory to serve, or tandem:tiny (the built-in tiny model, nothing downloaded)."""
    backend: Literal["engine", "hf"] = "engine"
    """Generator behind the server: engine (ours) or hf (transformers generate, any architecture)."""
    host: str = "127.0.0.1"
    """Address to bind; a non-loopback one needs --api_key (or env TANDEM_API_KEY) or --insecure."""
    port: int = 8000
    """Port to bind (0 = any free port; the chosen one is printed)."""
    api_key: str | None = None
    """Bearer token every route requires (default: env TANDEM_API_KEY; none = open, loopback only)."""
    insecure: bool = False
    """Allow a non-loopback bind without an API key."""
    tensor_parallel_size: int = 1
    """GPUs the engine shards the model over."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use (weights + KV cache)."""
    max_model_len: int = 4096
    """Longest prompt + completion a request may have (capped by the model's positions)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype: auto, float32, bfloat16 or float16."""
    device: str = "auto"
    """Device: auto (cuda if present), cpu or cuda."""
    served_model_name: str = ""
    """Model name reported by /v1/models and OpenAI responses (default: --model)."""
    max_pending_requests: int = 4096
    """Requests queued or running at once; more get 503 (retry later)."""
    result_ttl_s: float = 600.0
    """Seconds an uncollected async result is kept."""
    max_request_bytes: int = 32 * 2**20
    """Largest request body accepted; a larger one is answered 413 before it is read whole."""
    max_prompt_chars: int = 1_000_000
    """Longest prompt text (or rendered chat) accepted, in characters; a longer one is a 400."""

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get("TANDEM_API_KEY") or None
        if not self.api_key and not self.insecure and not is_loopback(self.host):
            raise ValueError(
                f"refusing to bind {self.host} without an API key; pass --api_key (or set TANDEM_API_KEY), "
                "or --insecure to serve it open"
            )
        if self.backend == "hf" and self.tensor_parallel_size != 1:
            raise ValueError("--backend hf runs on one device; use --backend engine for --tensor_parallel_size > 1")


def is_loopback(host: str) -> bool:
    """Example: is_loopback("localhost") -> True; is_loopback("0.0.0.0") -> False."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
