"""The rollout server's wire format: pydantic models of requests and results, with their ranges in
the OpenAPI schema. Invariant: a request that passes these models and `to_sampling_params` is legal
for every Generator; anything else is a 4xx naming the field.
"""

from __future__ import annotations

import collections
import dataclasses
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandemrl.types import MAX_BATCH_ITEMS, MAX_SEED, MAX_TOP_LOGPROBS, SAMPLING_BOUNDS, SAMPLING_MAX_ITEMS, SamplingParams

_DEFAULTS = SamplingParams()
MAX_N = 256  # samples of one prompt in one request (native and OpenAI routes)


class Strict(BaseModel):
    """A request body: each field takes only its own JSON type, as OpenAI's API does; pydantic's lax mode
    took "5" or true for an int, "0.5" for a float, 1 or "true" for a bool. An int is a number (a float
    field takes 1) and, as JSON Schema's integer, a number with no fraction is an int (5.0 is 5).

    Example: {"max_tokens": "5"} -> "max_tokens: Input should be a valid integer"; {"max_tokens": 5.0} -> 5
    """

    model_config = ConfigDict(strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers_are_ints(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: _integral(v) if k in fields and _holds_int(fields[k].annotation) else v for k, v in data.items()}


def _holds_int(annotation: Any) -> bool:
    """Example: int | None -> True; list[list[int]] -> True; float -> False; bool -> False."""
    return annotation is int or any(_holds_int(a) for a in typing.get_args(annotation))


def _integral(value: Any) -> Any:
    """Example: 5.0 -> 5; [1.0, 2.5] -> [1, 2.5] (2.5 then refused as no integer); "5" -> "5" (refused). A list
    is rebuilt only when it holds a float or a list: its types are read at C speed (a Python walk of a body's
    4 M token ids held the event loop 2.3 s)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list) and not {float, list}.isdisjoint(map(type, value)):
        return [_integral(v) for v in value]
    return value


RequestId = Annotated[str, Field(min_length=1, max_length=64)]  # uuid4().hex here; a client's own in a batch


def n_field() -> Any:
    """The `n` of a request (native and OpenAI routes): samples of one prompt, 1 to MAX_N."""
    return Field(1, ge=1, le=MAX_N, description="Samples of this prompt; one request id each.")


def sampling_field(name: str, default: Any = ..., **schema: Any) -> Any:
    """A pydantic Field stating SamplingParams' range of `name` (its default unless given), so the
    OpenAPI schema shows it and an out-of-range value is a 422 naming the field."""
    default = getattr(_DEFAULTS, name) if default is ... else default
    limits: dict[str, Any] = {**SAMPLING_BOUNDS.get(name, {})}
    if name in SAMPLING_MAX_ITEMS:
        limits["max_length"] = SAMPLING_MAX_ITEMS[name]
    if isinstance(default, tuple):
        return Field(default_factory=list, **limits, **schema)
    return Field(default, **limits, **schema)


class Sampling(Strict):
    """The engine's sampling parameters (SamplingParams), with their legal ranges."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = sampling_field("max_tokens", description="Most tokens to sample.")
    temperature: float = sampling_field("temperature", description="0 = greedy.")
    top_p: float = sampling_field("top_p")
    top_k: int = sampling_field("top_k", description="-1 = off; 0 is invalid.")
    min_p: float = sampling_field("min_p")
    repetition_penalty: float = sampling_field("repetition_penalty", description="1 = off; > 1 penalises tokens of the prompt and completion.")
    stop_token_ids: list[int] = sampling_field("stop_token_ids")
    stop: list[str] = sampling_field("stop")
    ignore_eos: bool = sampling_field("ignore_eos")
    seed: int | None = sampling_field("seed")
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS, description="Most likely tokens to report at each sampled position.")


def to_sampling_params(s: Any, **overrides: Any) -> SamplingParams:
    """SamplingParams from a model with SamplingParams' fields (None = SamplingParams' default);
    raises ValueError (-> 400) on illegal values."""
    fields = {f.name: v for f in dataclasses.fields(SamplingParams) if (v := getattr(s, f.name, None)) is not None}
    fields.update(overrides)
    for name in ("stop_token_ids", "stop"):
        fields[name] = tuple(fields.get(name, ()))
    return SamplingParams(**fields)


def per_sample(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of each of `n` samples: a seeded request's sample i draws with seed + i, so the n
    samples differ and the whole request is reproducible (as vLLM's seeded n > 1).

    Example: per_sample(SamplingParams(seed=7), 2) -> [seed 7, seed 8]; unseeded -> n times the same
    """
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + i) % (MAX_SEED + 1)) for i in range(n)]


class ChatMessage(Strict):
    model_config = ConfigDict(extra="allow")

    role: str = Field(max_length=64)
    content: str | list[dict[str, Any]] | None = None


class Prompted(Sampling):
    """One prompt (token ids, text, or chat messages) and its sampling parameters."""

    prompt_ids: list[int] | None = Field(None, description="Prompt token ids (used as is).")
    prompt: str | None = Field(None, description="Prompt text (tokenized by the server).")
    messages: list[ChatMessage] | None = Field(None, description="Chat messages (the chat template is applied).")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="With messages: keyword arguments of the chat template, e.g. {\"enable_thinking\": false}.")

    @model_validator(mode="after")
    def _one_prompt(self) -> Prompted:
        given = [k for k in ("prompt_ids", "prompt", "messages") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of prompt_ids, prompt or messages (got {given or 'none'})")
        return self


class GenerateRequest(Prompted):
    """One prompt, `n` samples. `is_async`: answer ids at once."""

    n: int = n_field()
    is_async: bool = Field(False, description="True: answer request ids at once; collect the results later.")


class BatchItem(Prompted):
    """One sample of a batch, under the client's id (what /abort takes)."""

    request_id: RequestId = Field(description="The client's id; an item whose id already runs here supersedes it.")


class GenerateBatchRequest(Strict):
    """Many samples started in one tick, so the engine batches them as if submitted in-process.

    A batch that breaks the schema is one 422 naming the item (`loc: [body, items, 3, top_p]`); an item
    the schema accepts but this model cannot serve (vocabulary, length) fails alone, in its own line.
    """

    model_config = ConfigDict(extra="forbid")

    items: list[BatchItem] = Field(min_length=1, max_length=MAX_BATCH_ITEMS)

    @model_validator(mode="after")
    def _ids_differ(self) -> GenerateBatchRequest:
        """Two items of one id: the second aborted the first, whose line was never sent."""
        twice = [(i, n) for i, n in collections.Counter(item.request_id for item in self.items).items() if n > 1]
        if twice:
            raise ValueError(f"request_id {twice[0][0]!r} is given to {twice[0][1]} items; each item of a batch needs an id of its own")
        return self


class Result(BaseModel):
    """One sample's outcome. `finish_reason` is abort when aborted; `error` set when it failed."""

    request_id: str
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    policy_versions: list[int] = Field(default_factory=list)
    top_logprobs: list[dict[int, float]] | None = None
    routes: str | None = Field(None, description="base64 of Completion.routes: each token's experts per sparse layer (tandem rollout --routing_replay).")
    logit_floors: list[float] | None = Field(None, description="Completion.logit_floors: per token, the tempered-logit floor of what top-k/top-p/min-p kept (null: nothing excluded, -inf in Completion).")
    finish_reason: Literal["stop", "length", "abort", "error"] = "abort"
    text: str = ""
    error: str | None = None


class BatchResult(Result):
    """One line of /generate_batch's answer: 200 a finished sample (abort included), 400 an item this
    model cannot serve, 500 a generation that failed."""

    status: int = 200


class GenerateResponse(BaseModel):
    request_ids: list[str]
    results: list[Result] | None = Field(None, description="Set when is_async is false.")


class CollectRequest(Strict):
    model_config = ConfigDict(extra="forbid")

    request_ids: list[RequestId] = Field(min_length=1, max_length=4096)
    timeout_s: float = Field(30.0, ge=0, le=600, description="Long-poll: wait up to this long for all of them.")


class CollectResponse(BaseModel):
    results: list[Result] = Field(description="Finished requests (removed from the server once collected).")
    pending: list[str] = Field(description="Requests still running.")


class AbortRequest(Strict):
    model_config = ConfigDict(extra="forbid")

    request_ids: list[RequestId] = Field(min_length=1, max_length=4096)


class SleepRequest(Strict):
    model_config = ConfigDict(extra="forbid")

    level: int = Field(1, ge=1, le=2, description="1 frees the KV cache, 2 also the weights.")


class Readiness(BaseModel):
    ready: bool = Field(description="False (answered 503) while the server has no weights to serve: see awaiting_weights.")
    awaiting_weights: bool = Field(False, description="After /sleep level 2 until a weight update refills the dropped weights.")
    model: str
    policy_version: int
    num_running: int
    num_queued: int
    update_in_progress: bool
    asleep: bool
    max_model_len: int
    max_pending_requests: int = Field(description="Requests this server takes at once (--max_pending_requests): a client sends at most these, the rest as they end.")
    device_uuid: str | None = Field(None, description="GPU identity, for CUDA IPC weight sync on a shared GPU.")
    weight_group: str | None = Field(None, description="Id of the weight-sync group this server is in.")
    max_lora_rank: int = Field(0, description="LoRA adapters of up to this rank are applied beside the base (--max_lora_rank): pushes may carry only them.")


class WeightGroupRequest(Strict):
    """Join the trainer's weight-sync group (sent by the trainer's client)."""

    model_config = ConfigDict(extra="forbid")

    master_addr: str = Field(max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank: int = Field(ge=1)
    world_size: int = Field(ge=2)
    transport: Literal["gloo", "nccl", "ipc"]
    group_id: str = Field(max_length=64)
    timeout_s: float = Field(gt=0, le=3600)
    channel_port: int = Field(default=0, ge=0, le=65535)
    """CUDA IPC with staged updates: the trainer's port (at master_addr) for this server's staged-update
    channel, where staged updates are announced and answered (weights/channel.py); 0: none."""


class WeightUpdateRequest(Strict):
    """Receive one full set of weights over the group, then make `version` live."""

    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=0)
    mode: Literal["drain", "pause"] = "drain"
    group_id: str = Field(max_length=64)


class WeightUpdateResponse(BaseModel):
    policy_version: int
    num_tensors: int
    num_bytes: int
    seconds: float
