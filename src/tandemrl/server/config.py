"""The rollout server's leaf config: one `tandem rollout` flag per field (the served model and the
engine's settings are EngineConfig's, the same leaf `tandem train` sizes its colocated engine with).

Invariant: a server bound to a non-loopback address has an API key, unless `--insecure` says otherwise.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal

from tandemrl.generation.base import resolve_api_key


@dataclass(kw_only=True)
class RolloutServerConfig:
    """How `tandem rollout` serves: backend, address, limits and the key."""

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
    served_model_name: str = ""
    """Model name reported by /v1/models and OpenAI responses (default: --model)."""
    max_pending_requests: int = 4096
    """Requests queued or running at once; more get 503 (retry later). /ready reports it, and tandem's client
    sends each server at most this many, the rest as they end."""
    result_ttl_s: float = 600.0
    """Seconds an uncollected async result is kept."""
    drain_timeout_s: float = 300.0
    """Longest wait of /sleep and of a drain-mode weight update for the running requests to end; past it
    the server admits again, stays awake at its version, and answers 504 naming how many still ran."""
    max_request_bytes: int = 32 * 2**20
    """Largest request body accepted; a larger one is answered 413 before it is read whole (parsing one holds
    every other request ~20 ms per MB: raise it knowing that)."""
    max_lora_rank: int = 0
    """Apply LoRA adapters of up to this rank beside the served base (the engine backend, one GPU): a trainer
    with --lora_r at most this then pushes only the adapters and the modules trained whole after its first
    update (which carries the base too); 0 = off (pushes carry the merged weights). /sleep level 2 is then
    refused: those pushes would not refill the base."""
    max_prompt_chars: int = 1_000_000
    """Most prompt text one request may carry, in characters: all its prompts, chat messages and template
    variables together (and each rendered chat); more is a 400, before any prompt is tokenized."""

    def __post_init__(self) -> None:
        if self.max_pending_requests < 1:
            raise ValueError(f"--max_pending_requests must be >= 1 (no request would ever be admitted), got {self.max_pending_requests}")
        if not self.drain_timeout_s > 0:
            raise ValueError(f"--drain_timeout_s must be > 0, got {self.drain_timeout_s}")
        if self.max_lora_rank < 0:
            raise ValueError(f"--max_lora_rank must be >= 0, got {self.max_lora_rank}")
        if self.max_lora_rank and self.backend != "engine":
            raise ValueError("--max_lora_rank needs --backend engine (transformers generate applies no adapters beside its base)")
        self.api_key = resolve_api_key(self.api_key)
        if not self.api_key and not self.insecure and not is_loopback(self.host):
            raise ValueError(
                f"refusing to bind {self.host} without an API key; pass --api_key (or set TANDEM_API_KEY), "
                "or --insecure to serve it open"
            )


def is_loopback(host: str) -> bool:
    """Example: is_loopback("localhost") -> True; is_loopback("0.0.0.0") -> False."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
