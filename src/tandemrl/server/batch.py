"""POST /generate_batch: many samples in one request, started in one tick so the engine puts them in
one step (as the in-process path does), answered as NDJSON lines in the order they finish.

Invariants: the batch starts whole or not at all (503, nothing started, so a retry is safe); an item
this model cannot serve fails alone, in its own line; a client that hangs up aborts every item; an
item id is abortable by /abort while it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from tandemrl.server.prompts import Prompter
from tandemrl.server.service import Busy, RolloutService
from tandemrl.server.wire import BatchItem, BatchResult, GenerateBatchRequest, to_sampling_params
from tandemrl.types import SamplingParams

NDJSON = "application/x-ndjson"


def add_routes(app: FastAPI, service: RolloutService, prompter: Prompter) -> None:
    @app.post(
        "/generate_batch",
        response_class=StreamingResponse,
        summary="Sample many prompts in one engine tick; NDJSON lines (BatchResult) as they finish",
        responses={200: {"content": {NDJSON: {"schema": BatchResult.model_json_schema()}}}},
    )
    async def generate_batch(body: GenerateBatchRequest) -> StreamingResponse:
        prompter.check_request_chars(*(_texts(item) for item in body.items))  # the whole batch's text, before any is tokenized
        runnable, refused = await asyncio.to_thread(_prepare_all, prompter, body.items)  # tokenizing: off the event loop
        tasks = service.start_batch(runnable) if runnable else {}
        return StreamingResponse(_lines(service, prompter, tasks, refused), media_type=NDJSON)


def _prepare_all(prompter: Prompter, items: list[BatchItem]) -> tuple[list[tuple[str, list[int], SamplingParams]], list[BatchResult]]:
    """(the items that can run, with their ids, prompt ids and params; a 400 line for each other)."""
    runnable, refused = [], []
    for item in items:
        try:
            runnable.append((item.request_id, *_prepare(prompter, item)))
        except ValueError as error:
            refused.append(BatchResult(request_id=item.request_id, finish_reason="error", error=str(error), status=400))
    return runnable, refused


def _texts(item: BatchItem) -> tuple:
    """An item's text, for the request's character cap."""
    return item.prompt, [m.model_dump() for m in item.messages] if item.messages is not None else None, item.chat_template_kwargs


def _prepare(prompter: Prompter, item: BatchItem) -> tuple[list[int], SamplingParams]:
    messages = [m.model_dump() for m in item.messages] if item.messages is not None else None
    params = to_sampling_params(item)
    prompt_ids = prompter.encode(
        prompt_ids=item.prompt_ids, prompt=item.prompt, messages=messages, chat_template_kwargs=item.chat_template_kwargs, max_tokens=params.max_tokens
    )
    prompter.check(prompt_ids, params)
    return prompt_ids, params


async def _lines(service: RolloutService, prompter: Prompter, tasks: dict[str, asyncio.Task], refused: list[BatchResult]) -> AsyncIterator[bytes]:
    """Yields each result as its sample finishes (those finished together in one chunk). Starlette
    cancels this generator when the client hangs up; `finally` then aborts what still runs."""
    finished: asyncio.Queue[str] = asyncio.Queue()
    for request_id, task in tasks.items():
        task.add_done_callback(lambda _, i=request_id: finished.put_nowait(i))
    try:
        if refused:
            yield _encode(refused)
        num_left = len(tasks)
        while num_left:
            ready = [await finished.get()]
            while not finished.empty():
                ready.append(finished.get_nowait())
            num_left -= len(ready)
            yield _encode([_result(service, prompter, i, tasks[i]) for i in ready])
    finally:
        for task in tasks.values():
            task.cancel()
        service.forget(tasks)


def _result(service: RolloutService, prompter: Prompter, request_id: str, task: asyncio.Task) -> BatchResult:
    result = BatchResult(**service.result(request_id, task).model_dump())
    if result.error is not None:
        error = task.exception()
        result.status = 400 if isinstance(error, ValueError) else 503 if isinstance(error, Busy) else 500
    result.text = prompter.decode(result.token_ids)
    return result


def _encode(results: list[BatchResult]) -> bytes:
    return b"".join(r.model_dump_json().encode() + b"\n" for r in results)
