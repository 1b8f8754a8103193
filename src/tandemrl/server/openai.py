"""OpenAI-compatible `/v1/models`, `/v1/completions` and `/v1/chat/completions` (plain and streaming),
so agent frameworks and evaluation harnesses can use a rollout server as is.

Choices also carry tandem's `token_ids` and `policy_versions`. Streaming sends each choice's text in
one chunk when it is done: a Generator returns whole completions, it has no token stream.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tandemrl.server.prompts import Prompter
from tandemrl.server.service import RolloutService
from tandemrl.generation.remote_client import MAX_SEED, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE
from tandemrl.server.wire import GREEDY_EPS, ChatMessage, per_sample
from tandemrl.types import Completion, SamplingParams


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we have no use for

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1, le=256)
    stop: str | list[str] | None = Field(None, max_length=MAX_STOP_STRINGS)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    top_k: int = Field(-1, ge=-1, description="tandem extension: -1 = off.")
    min_p: float = Field(0.0, ge=0, le=1, description="tandem extension.")
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS, description="tandem extension.")
    ignore_eos: bool = Field(False, description="tandem extension.")


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def add_routes(app: FastAPI, service: RolloutService, prompter: Prompter) -> None:
    @app.get("/v1/models", summary="OpenAI: the served model")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0, "owned_by": "tandem"}]}

    @app.post("/v1/completions", summary="OpenAI: text completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        if body.echo:
            raise ValueError("echo is not supported")
        prompts = _prompt_list(body.prompt, prompter)
        params = [_sampling(body, body.max_tokens or 16) for _ in prompts]
        return await _respond(service, prompter, request, body, prompts, params, chat=False)

    @app.post("/v1/chat/completions", summary="OpenAI: chat completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        prompt_ids = prompter.encode(messages=[m.model_dump() for m in body.messages])
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, prompter.max_model_len - len(prompt_ids))
        return await _respond(service, prompter, request, body, [prompt_ids], [_sampling(body, max_tokens)], chat=True)


def _prompt_list(prompt: Any, prompter: Prompter) -> list[list[int]]:
    """Example: "hi" -> [ids("hi")]; [1, 2] -> [[1, 2]]; ["a", "b"] -> [ids("a"), ids("b")]."""
    if isinstance(prompt, str):
        return [prompter.encode(prompt=prompt)]
    if not prompt:
        raise ValueError("prompt is empty")
    if isinstance(prompt[0], int):
        return [prompt]
    return [prompter.encode(prompt=p) if isinstance(p, str) else p for p in prompt]


def _sampling(body: _Common, max_tokens: int) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    temperature = 1.0 if body.temperature is None else body.temperature
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if temperature < GREEDY_EPS else temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        stop_token_ids=tuple(body.stop_token_ids),
        stop=tuple(stop),
        ignore_eos=body.ignore_eos,
        seed=body.seed,
    )


async def _respond(service: RolloutService, prompter: Prompter, request: Request, body: Any, prompts: list[list[int]], params: list[SamplingParams], *, chat: bool) -> Any:
    from tandemrl.server.app import until_done_or_disconnect

    for prompt_ids, p in zip(prompts, params):
        prompter.check(prompt_ids, p)
    jobs = [(prompt_ids, one) for prompt_ids, p in zip(prompts, params) for one in per_sample(p, body.n)]
    tasks = [asyncio.ensure_future(service.generate(prompt_ids, p)) for prompt_ids, p in jobs]
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()), "model": service.model_name}
    if body.stream:
        return StreamingResponse(_stream(tasks, jobs, prompter, head, body, chat), media_type="text/event-stream")
    try:
        completions = await until_done_or_disconnect(request, asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
    if completions is None:  # the client hung up
        return None
    choices = [_choice(i, c, p, prompter, body, chat) for i, (c, (_, p)) in enumerate(zip(completions, jobs))]
    num_prompt = sum(len(ids) for ids, _ in jobs)
    num_sampled = sum(len(c.token_ids) for c in completions)
    usage = {"prompt_tokens": num_prompt, "completion_tokens": num_sampled, "total_tokens": num_prompt + num_sampled}
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices, "usage": usage}


def _choice(index: int, c: Completion, params: SamplingParams, prompter: Prompter, body: Any, chat: bool) -> dict[str, Any]:
    text = _trim(prompter.decode(c.token_ids), params.stop)
    pieces = [prompter.decode([i]) for i in c.token_ids] if body.logprobs else []
    extra = {"finish_reason": c.finish_reason, "token_ids": c.token_ids, "policy_versions": c.policy_versions}
    if chat:
        logprobs = {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []} for s, lp in zip(pieces, c.logprobs)]}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs if body.logprobs else None, **extra}
    offsets = [sum(len(s) for s in pieces[:k]) for k in range(len(pieces))]
    logprobs = {"tokens": pieces, "token_logprobs": c.logprobs, "top_logprobs": None, "text_offset": offsets}
    return {"index": index, "text": text, "logprobs": logprobs if body.logprobs is not None else None, **extra}


async def _stream(tasks: list[asyncio.Future], jobs: list, prompter: Prompter, head: dict, body: Any, chat: bool) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    async def indexed(i: int, task: asyncio.Future) -> tuple[int, Completion]:
        return i, await task

    try:
        for done in asyncio.as_completed([indexed(i, t) for i, t in enumerate(tasks)]):
            i, c = await done
            choice = _choice(i, c, jobs[i][1], prompter, body, chat)
            if chat:
                message = choice.pop("message")
                first = {**choice, "delta": message, "finish_reason": None}
                last = {"index": i, "delta": {}, "finish_reason": c.finish_reason}
            else:
                first = {**choice, "finish_reason": None}
                last = {"index": i, "text": "", "logprobs": None, "finish_reason": c.finish_reason}
            for part in (first, last):
                yield f"data: {json.dumps({**head, 'object': kind, 'choices': [part]})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()


def _trim(text: str, stop: tuple[str, ...]) -> str:
    """OpenAI leaves the stop string out. Example: _trim("ab. cd", (".",)) -> "ab"."""
    cut = min((text.find(s) for s in stop if s and s in text), default=len(text))
    return text[:cut]
