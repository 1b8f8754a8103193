"""OpenAI-compatible `/v1/models`, `/v1/completions` and `/v1/chat/completions` (plain and streaming),
so agent frameworks and evaluation harnesses can use a rollout server as is.

Choices also carry tandem's `token_ids` and `policy_versions`. Streaming sends text as it is sampled
when the generator streams tokens (the engine) and no logprobs are asked for; otherwise each choice's
text comes in one chunk when it is done. Streamed text never holds half a character or the start of a
stop string, and its concatenation equals the non-streamed text.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import ConfigDict, Field, model_validator

from tandemrl.server.hangup import until_done_or_disconnect
from tandemrl.server.prompts import Prompter
from tandemrl.server.service import Busy, RolloutService
from tandemrl.server.wire import ChatMessage, Strict, n_field, per_sample, sampling_field, to_sampling_params
from tandemrl.types import MAX_TOP_LOGPROBS, SAMPLING_MAX_ITEMS, Completion, SamplingParams


class StreamOptions(Strict):
    model_config = ConfigDict(extra="allow")  # OpenAI's other stream options: nothing to apply here

    include_usage: bool = Field(False, description="Send a last chunk with the usage.")


class _Common(Strict):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we have no use for

    model: str | None = None
    max_tokens: int | None = sampling_field("max_tokens", None)
    temperature: float | None = sampling_field("temperature", None)
    top_p: float | None = sampling_field("top_p", None)
    n: int = n_field()
    # the list first: a list over the limit is refused for its length, not as "stop.str: Input should be a valid string"
    stop: Annotated[list[str], Field(max_length=SAMPLING_MAX_ITEMS["stop"])] | str | None = Field(None, description="One stop string (one item), or a list.")
    seed: int | None = sampling_field("seed")
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = sampling_field("top_k", description="tandem extension: -1 = off.")
    min_p: float = sampling_field("min_p", description="tandem extension.")
    repetition_penalty: float = sampling_field("repetition_penalty", description="vLLM's extension: 1 = off.")
    stop_token_ids: list[int] = sampling_field("stop_token_ids", description="tandem extension.")
    ignore_eos: bool = sampling_field("ignore_eos", description="tandem extension.")
    # OpenAI's fields this server does not apply: accepted at their no-op value (clients send it), else refused
    frequency_penalty: float | None = Field(None, description="Only 0: no frequency penalty here (repetition_penalty is vLLM's alternative).")
    presence_penalty: float | None = Field(None, description="Only 0: no presence penalty here (repetition_penalty is vLLM's alternative).")
    logit_bias: dict[str, float] | None = Field(None, description="Only empty: no logit bias here.")

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """OpenAI's API takes null for any field left unset (n, stream, echo, logprobs: the openai client's types
        allow None): such a field takes its default here too. Example: {"n": null} -> {}."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def check_supported(self) -> None:
        """What an OpenAI client may ask that this server would otherwise ignore silently: a clear 400 instead."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name}: not applied by this server (only 0); repetition_penalty (vLLM's) penalises repeats")
        if self.logit_bias:
            raise ValueError("logit_bias: not applied by this server (only {}); stop_token_ids or a reward shape the output")


def _fail_fast(item: Any) -> Any:
    """A list type that stops at its first bad item: a union tries its list types in turn, and one that collected an
    error per item (a body's 4 M token ids read as strings, then as lists) held the event loop 1.1 s."""
    return Annotated[list[item], Field(fail_fast=True)]


class CompletionRequest(_Common):
    prompt: str | _fail_fast(str) | _fail_fast(int) | _fail_fast(list[int])
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = Field(None, description="Only empty: no insertion (fill-in-the-middle) here.")
    best_of: int | None = Field(None, description="Only 1 or n: every sampled choice is returned (no server-side pick).")

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix: no insertion (fill-in-the-middle) here; only an empty suffix")
        if self.best_of is not None and self.best_of not in (1, self.n):
            raise ValueError(f"best_of {self.best_of}: this server returns every sampled choice (pick by logprobs yourself); use n")


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM's extension: keyword arguments of the chat template, e.g. {\"enable_thinking\": false}.")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, description="Refused when given: this server renders no tool schemas and parses no tool calls.")
    tool_choice: Any = Field(None, description="Only none or auto: there are no tools to choose.")
    functions: list[dict[str, Any]] | None = Field(None, description="OpenAI's older tools: refused as tools are.")
    function_call: Any = Field(None, description="Only none or auto, as tool_choice.")
    response_format: dict[str, Any] | None = Field(None, description="Only {\"type\": \"text\"}: no constrained decoding.")

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools or self.functions:
            raise ValueError(
                f"{'tools' if self.tools else 'functions'}: this server renders no tool schemas and parses no tool calls; describe the tools in the messages "
                "and parse the reply yourself, or train with tandem's tool rollouts (--tools)"
            )
        for name in ("tool_choice", "function_call"):
            choice = getattr(self, name)
            if choice not in (None, "none", "auto"):
                raise ValueError(f"{name} {choice!r} without tools: this server renders no tool schemas; only none or auto")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError(f"response_format {self.response_format.get('type')!r}: no constrained decoding here; only type text")


def add_routes(app: FastAPI, service: RolloutService, prompter: Prompter) -> None:
    @app.get("/v1/models", summary="OpenAI: the served model")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0, "owned_by": "tandem"}]}

    @app.post("/v1/completions", summary="OpenAI: text completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(body.model, service.model_name)
        body.check_supported()
        prompter.check_request_chars(body.prompt)  # every prompt of the list together, before any is tokenized
        max_tokens = body.max_tokens or 16
        prompts = await asyncio.to_thread(_prompt_list, body.prompt, prompter, max_tokens)
        params = [_sampling(body, max_tokens) for _ in prompts]
        return await _respond(service, prompter, request, body, prompts, params, chat=False)

    @app.post("/v1/chat/completions", summary="OpenAI: chat completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        _check_model(body.model, service.model_name)
        body.check_supported()
        messages = [m.model_dump() for m in body.messages]
        prompter.check_request_chars(messages, body.chat_template_kwargs)
        asked = body.max_completion_tokens or body.max_tokens
        prompt_ids = await prompter.encode_off_loop(messages=messages, chat_template_kwargs=body.chat_template_kwargs, max_tokens=asked or 1)
        max_tokens = asked or max(1, prompter.max_model_len - len(prompt_ids))
        return await _respond(service, prompter, request, body, [prompt_ids], [_sampling(body, max_tokens)], chat=True)


class ModelNotFound(LookupError):
    """A request for a model this server does not serve (OpenAI's 404 model_not_found)."""


def _check_model(asked: str | None, served: str) -> None:
    """OpenAI (and vLLM) answer a request naming another model 404; an empty name means the served one."""
    if asked and asked != served:
        raise ModelNotFound(f"model {asked!r} is not served here; this server serves {served!r} (GET /v1/models)")


def _prompt_list(prompt: Any, prompter: Prompter, max_tokens: int) -> list[list[int]]:
    """Example: "hi" -> [ids("hi")]; [1, 2] -> [[1, 2]]; ["a", "b"] -> [ids("a"), ids("b")]."""
    if isinstance(prompt, str):
        return [prompter.encode(prompt=prompt, max_tokens=max_tokens)]
    if not prompt:
        raise ValueError("prompt is empty")
    if isinstance(prompt[0], int):
        return [prompt]
    return [prompter.encode(prompt=p, max_tokens=max_tokens) if isinstance(p, str) else p for p in prompt]


def _sampling(body: _Common, max_tokens: int) -> SamplingParams:
    """Unset OpenAI fields take SamplingParams' defaults; `stop` may be one string."""
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    top = (body.top_logprobs if body.logprobs else 0) if isinstance(body, ChatRequest) else body.logprobs  # type: ignore[attr-defined]
    return to_sampling_params(body, max_tokens=max_tokens, stop=stop, top_logprobs=top or 0)


async def _respond(service: RolloutService, prompter: Prompter, request: Request, body: Any, prompts: list[list[int]], params: list[SamplingParams], *, chat: bool) -> Any:
    for prompt_ids, p in zip(prompts, params):
        prompter.check(prompt_ids, p)
    jobs = [(prompt_ids, one) for prompt_ids, p in zip(prompts, params) for one in per_sample(p, body.n)]
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()), "model": service.model_name}
    if body.stream:
        events: asyncio.Queue = asyncio.Queue()  # (choice index, token id | its finished task)
        by_token = body.logprobs is None or body.logprobs is False  # logprobs come whole, with the text
        tasks = service.start(jobs, on_token=functools.partial(_put, events) if by_token else None)  # all choices, or a 503 before any starts
        for i, task in enumerate(tasks):
            task.add_done_callback(functools.partial(_put, events, i))
        return StreamingResponse(_stream(tasks, events, jobs, prompter, head, body, chat), media_type="text/event-stream")
    tasks = service.start(jobs)  # all choices, or a 503 before any starts
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
        tops = [[_token(prompter, i, v) for i, v in top.items()] for top in c.top_logprobs] if c.top_logprobs else [[] for _ in pieces]
        logprobs = {"content": [{**_token(prompter, i, lp), "top_logprobs": t} for i, lp, t in zip(c.token_ids, c.logprobs, tops)]}
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs if body.logprobs else None, **extra}
    offsets = [sum(len(s) for s in pieces[:k]) for k in range(len(pieces))]
    tops = [{prompter.decode([i]): v for i, v in top.items()} for top in c.top_logprobs] if c.top_logprobs else None
    logprobs = {"tokens": pieces, "token_logprobs": c.logprobs, "top_logprobs": tops, "text_offset": offsets}
    return {"index": index, "text": text, "logprobs": logprobs if body.logprobs is not None else None, **extra}


def _token(prompter: Prompter, token_id: int, logprob: float) -> dict[str, Any]:
    """OpenAI's chat logprob entry of one token. Example: -> {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}"""
    text = prompter.decode([token_id])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _put(events: asyncio.Queue, index: int, item: Any) -> None:
    events.put_nowait((index, item))


async def _stream(tasks: list[asyncio.Future], events: asyncio.Queue, jobs: list, prompter: Prompter, head: dict, body: Any, chat: bool) -> AsyncIterator[str]:
    """Server-sent events: text deltas per choice as tokens arrive, then the choice's last text with
    tandem's fields, then its finish reason; `[DONE]` after every choice ended."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    texts = [TextStream(prompter.decode, p.stop) for _, p in jobs]
    started = [False] * len(jobs)
    usage = body.stream_options is not None and body.stream_options.include_usage
    num_sampled = 0

    def chunk(i: int, text: str, **fields: Any) -> str:
        if chat:
            delta = {"content": text} if started[i] else {"role": "assistant", "content": text}
            part = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None, **fields}
        else:
            part = {"index": i, "text": text, "logprobs": None, "finish_reason": None, **fields}
        started[i] = True
        extra = {"usage": None} if usage else {}  # OpenAI: null on every chunk but the last when usage is asked for
        return f"data: {json.dumps({**head, 'object': kind, 'choices': [part], **extra})}\n\n"

    try:
        remaining = len(tasks)
        while remaining:
            i, item = await events.get()
            if not isinstance(item, asyncio.Future):  # a token
                if delta := texts[i].push(item):
                    yield chunk(i, delta)
                continue
            remaining -= 1
            if item.cancelled() or item.exception() is not None:  # a failed choice ends the stream, as it fails a plain request: said in an event
                yield f"data: {json.dumps({'error': _stream_error(item.exception() if not item.cancelled() else RuntimeError('aborted'))})}\n\n"
                yield "data: [DONE]\n\n"
                return
            c: Completion = item.result()
            choice = _choice(i, c, jobs[i][1], prompter, body, chat)
            text = choice.pop("message")["content"] if chat else choice.pop("text")
            fields = {k: v for k, v in choice.items() if k not in ("index", "finish_reason")}  # logprobs, token ids, versions
            yield chunk(i, texts[i].finish(text), **fields)
            yield chunk(i, "", finish_reason=c.finish_reason)
            num_sampled += len(c.token_ids)
        if usage:  # stream_options.include_usage: one last chunk with no choices, as OpenAI sends it
            num_prompt = sum(len(ids) for ids, _ in jobs)
            totals = {"prompt_tokens": num_prompt, "completion_tokens": num_sampled, "total_tokens": num_prompt + num_sampled}
            yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': totals})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()


def _stream_error(error: BaseException) -> dict[str, Any]:
    """OpenAI's error object, for an error that comes after a stream's 200 was sent."""
    kind = "server_busy" if isinstance(error, Busy) else "invalid_request_error" if isinstance(error, ValueError) else "server_error"
    return {"message": str(error) or repr(error), "type": kind, "param": None, "code": None}


class TextStream:
    """The text of a growing list of sampled tokens, handed out in safe deltas: never a partial UTF-8
    character (decoded as U+FFFD until its last byte arrives) and never characters that may still turn
    out to begin a stop string. Each token is decoded with the token before it as context (what the text
    of a token is may depend on its neighbour), so a step costs O(1) tokens, not O(all).

    Example, stop "\\n\\n" (one character held back), tokens decoding to "Hi", " there", "\\n", "\\n":
    pushes give "H", "i ther", "e", "" (a stop string: nothing from it on is sent); finish("Hi there") -> "".
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode = decode
        self.stop = tuple(s for s in stop if s)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # characters that may begin a stop string
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (complete characters)
        self.context = self.read = 0  # token_ids[context:read] is what self.text's end was decoded with
        self.sent = 0  # characters of self.text handed out
        self.stopped = False

    def push(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        if self.stopped:
            return ""
        before = self.decode(self.token_ids[self.context : self.read])
        after = self.decode(self.token_ids[self.context :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # an unfinished character: wait for its next byte
        self.text += after[len(before) :]
        self.context, self.read = self.read, len(self.token_ids)
        end = len(self.text) - self.hold
        hits = [k for s in self.stop if (k := self.text.find(s, max(0, self.sent - len(s)))) != -1]
        if hits:
            self.stopped, end = True, min(hits)
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : end], end
        return delta

    def finish(self, final_text: str) -> str:
        """What is left to send of the choice's final text (the text sent so far, then more)."""
        delta, self.sent = final_text[self.sent :], max(self.sent, len(final_text))
        return delta


def _trim(text: str, stop: tuple[str, ...]) -> str:
    """OpenAI leaves the stop string out. Example: _trim("ab. cd", (".",)) -> "ab"."""
    cut = min((text.find(s) for s in stop if s and s in text), default=len(text))
    return text[:cut]
