"""How tokens are produced: the Generator protocol and one typed config per backend (generation/factory.py
builds a backend from its config).

A Generator turns prompt token ids into a Completion. It knows nothing about rewards, envs or
training. Every backend keeps one invariant: a completion's tokens carry the policy version of the
weights that produced them, and no token is produced from half-updated weights.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from tandemrl.types import Completion, SamplingParams

if TYPE_CHECKING:
    from torch import Tensor

API_KEY_ENV = "TANDEM_API_KEY"


def resolve_api_key(given: str | None) -> str | None:
    """The one fallback of every --api_key (tandem train's, tandem rollout's): the flag, else env TANDEM_API_KEY.

    Example: resolve_api_key(None) with TANDEM_API_KEY=k -> "k"; resolve_api_key("") -> None
    """
    return given or os.environ.get(API_KEY_ENV) or None


@runtime_checkable
class Generator(Protocol):
    """Turns prompt token ids into a Completion; versioned weights, sleep and wake."""

    @property
    def version(self) -> int: ...  # policy version of the live weights

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion: ...

    async def sleep(self, level: int) -> None: ...

    async def wake(self) -> None: ...

    async def close(self) -> None: ...


@runtime_checkable
class LocalGenerator(Generator, Protocol):
    """A Generator whose weights live in this process (engine, hf): new weights arrive by Hugging Face
    name through `update_weights`, from LocalSync or a rollout server's staging. A remote Generator's
    weights live on its servers and reach them through weights/distributed.py."""

    async def update_weights(self, weights: Iterable[tuple[str, Tensor]], *, version: int) -> None: ...


@dataclass(kw_only=True)
class HFConfig:
    """The `hf` backend: transformers `generate`, any causal LM; slow, obviously correct."""

    model: str = ""
    """Model id or local directory (ignored when the trainer hands its model in colocate mode)."""
    dtype: str = "auto"
    """Weights dtype: auto, float32, bfloat16 or float16."""
    device: str = "auto"
    """Device: auto (cuda if present), cpu or cuda."""
    max_batch_size: int = 256
    """Most requests batched into one generate call."""
    generation_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra GenerationConfig settings (e.g. no_repeat_ngram_size), applied to every request."""


DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(kw_only=True)
class EngineSettings:
    """The engine's settings: the same flags in `tandem train` (the colocated engine) and `tandem rollout`."""

    gpu_memory_utilization: float = 0.0
    """Fraction of the whole GPU's memory the engine may use for its weights and KV cache; what is in use
    when it starts (in tandem train: the trainer's weights) counts against it. tandem rollout: 0 = 0.9.
    tandem train (colocate): 0 = the memory plan sizes the KV cache (--print_plan shows it); a value keeps
    the meaning above (the plan then checks the rest fits). The KV cache never takes more than max_num_seqs
    sequences of max_model_len tokens can use."""
    kv_cache_tokens: int = 0
    """KV cache size in tokens; 0 = on CPU 65536, on GPU from --gpu_memory_utilization (tandem rollout) or
    the memory plan (tandem train); at most max_num_seqs x max_model_len either way."""
    max_model_len: int = 0
    """Longest prompt + completion a request may have; 0 = --max_prompt_length + --max_completion_length in
    tandem train, 4096 in tandem rollout; never past the model's positions."""
    block_size: int = 16
    """Tokens per KV cache block."""
    max_num_seqs: int = 512
    """Most sequences decoded together (tandem train: at most one step's, --num_prompts_per_step x --num_generations)."""
    max_num_batched_tokens: int = 16384
    """Most tokens prefilled in one engine step."""
    prefill_wait_steps: int = 0
    """While sequences decode, new requests wait up to this many decode steps to be prefilled together
    (tool rollouts' next turns arrive a few at a time); 0 = prefilled at the next step."""
    overlap_prefills: bool = True
    """Launch a prefill step before the last prefill's tokens are read, when more requests wait than one step
    admits (tool rollouts' next turns), as decode steps are on CUDA, so its host work runs while the last one
    computes (figures: bench/RESULTS.md, bench/multiturn.py)."""
    enforce_eager: bool = False
    """Disable CUDA graphs (debugging)."""
    decode_graphs: Literal["auto", "plain", "filtered"] = "auto"
    """The sampler captured in the decode steps' CUDA graphs: plain, or filtered (top-k/top-p/min-p, which then
    runs inside the graph instead of after a plain draw; batches without filters still work, a little more
    slowly). auto: filtered where the run's sampling filters (tandem train's --top_p/--top_k/--min_p), else
    plain (tandem rollout: choose filtered when most requests filter). Figures: bench/RESULTS.md."""
    tensor_parallel_size: int = 1
    """GPUs the engine splits its model over (heads, MLP and vocab; tandem rollout uses GPUs 0..N-1, one
    process each, and serves from the first)."""
    routing_replay: bool = False
    """Mixture-of-experts models: record each sampled token's experts in every sparse layer and return them
    with the tokens, so the trainer routes each trained token to the experts that sampled it (routing replay;
    the router still trains through those experts' probabilities)."""

    def __post_init__(self) -> None:
        least = {"tensor_parallel_size": 1, "block_size": 1, "max_num_seqs": 1, "max_num_batched_tokens": 1,
                 "prefill_wait_steps": 0, "max_model_len": 0, "kv_cache_tokens": 0}  # fmt: skip
        for name, bound in least.items():
            if getattr(self, name) < bound:
                raise ValueError(f"--{name} must be >= {bound}, got {getattr(self, name)}")
        if not 0 <= self.gpu_memory_utilization <= 1:  # NaN too
            raise ValueError(f"--gpu_memory_utilization is a fraction of the GPU's memory, from 0 (the default) to 1, got {self.gpu_memory_utilization}")

    def memory_fraction(self, *, colocated: bool) -> float:
        """The one default of --gpu_memory_utilization: less when the trainer shares the GPU."""
        return self.gpu_memory_utilization or (0.4 if colocated else 0.9)

    def model_len(self, *, max_positions: int | None, wanted: int = DEFAULT_MAX_MODEL_LEN) -> int:
        """The one derivation of max_model_len: --max_model_len, else `wanted`, never past the model's
        positions. Example: max_model_len 0, wanted 640, max_positions 512 -> 512."""
        length = self.max_model_len or wanted
        return min(length, max_positions) if max_positions else length


@dataclass(kw_only=True)
class EngineConfig(EngineSettings):
    """Our engine: paged KV cache, continuous batching, prefix sharing, CUDA-graph decode. A model
    source (ignored when the trainer hands its model in colocate mode) plus the engine's settings."""

    model: str = ""
    """Model id or local directory to serve (tandem rollout also takes tandem:tiny, the built-in tiny model)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16 or float16."""
    device: str = "auto"
    """Device: auto (cuda if present), cpu or cuda."""
    seed: int = 0
    """Seed of the engine's sampler for requests without their own seed."""


@dataclass(kw_only=True)
class RemoteConfig:
    """A client of one or more `tandem rollout` servers; itself a Generator."""

    urls: tuple[str, ...] = ()
    """Server base URLs, e.g. http://127.0.0.1:8000 (several = data-parallel rollout)."""
    api_key: str | None = None
    """Bearer token of the servers, sent as is (the env fallback is resolve_api_key's, applied by the caller)."""
    rollout_server_timeout: float = 240.0
    """Seconds to wait for the servers to become ready before one clear error."""
    request_timeout_s: float = 600.0
    """Seconds one generate request may take before it fails, from when it is first sent (a wait for room in
    the servers' queues, on requests that each have this deadline, is not counted)."""
    max_retries: int = 4
    """Retries of a request whose connection failed (backoff 0.25 s, doubling), within request_timeout_s."""
    rollout_server_silence_s: float = 30.0
    """Seconds a server may answer nothing, not even /health, while a call to it is in flight: then its
    calls go to another server, or fail with one clear error (a stopped or hung server)."""


GeneratorConfig = HFConfig | EngineConfig | RemoteConfig


def describe_generator(generator: Generator) -> str:
    """What generates, as the banner and `tandem rollout`'s first line say it: "engine", "transformers
    generate", "fallback: transformers generate (why the engine cannot)" or "rollout servers"."""
    reason = getattr(generator, "fallback_reason", None)
    if reason:
        return f"fallback: transformers generate ({reason})"
    names = {"Engine": "engine", "HFGenerator": "transformers generate", "RemoteGenerator": "rollout servers"}
    return names.get(type(generator).__name__, type(generator).__name__)
