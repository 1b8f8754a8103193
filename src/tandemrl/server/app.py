"""The rollout server's HTTP skin (FastAPI): native generate/collect/abort, batches, OpenAI routes, health,
readiness, Prometheus metrics, sleep/wake and weight-sync routes, over a RolloutService.

Invariants: with an API key every route (docs and weight routes included) needs `Authorization:
Bearer KEY`; a bad request is a 4xx that touches no other request; a client that hangs up aborts its
generation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandemrl.server import batch, openai
from tandemrl.server.hangup import disconnected, until_done_or_disconnect
from tandemrl.server.metrics import CONTENT_TYPE
from tandemrl.server.prompts import Prompter
from tandemrl.server.gate import Undrained
from tandemrl.server.service import Busy, JoinInProgress, RolloutService
from tandemrl.server.wire import (
    AbortRequest,
    CollectRequest,
    CollectResponse,
    GenerateRequest,
    GenerateResponse,
    Readiness,
    SleepRequest,
    WeightGroupRequest,
    WeightUpdateRequest,
    WeightUpdateResponse,
    per_sample,
    to_sampling_params,
)


def build_app(
    service: RolloutService, prompter: Prompter, *, api_key: str | None = None, heartbeat_s: float = 0.0, max_request_bytes: int = 32 * 2**20
) -> FastAPI:
    """`heartbeat_s` > 0 logs a line with the queue depth that often (for runs under nohup)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        beat = asyncio.create_task(service.heartbeat(heartbeat_s)) if heartbeat_s > 0 else None
        expiry = asyncio.create_task(service.expire_results())
        yield
        expiry.cancel()
        if beat is not None:
            beat.cancel()
        await service.generator.close()

    app = FastAPI(
        title="tandem rollout", version="1", lifespan=lifespan, description="Rollout server of tandem: generation over HTTP, versioned weight sync."
    )
    app.state.service, app.state.prompter = service, prompter
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)  # inside the key check (added after it: outermost)
    _add_guards(app, api_key)
    _add_status_routes(app, service)
    _add_native_routes(app, service, prompter)
    _add_admin_routes(app, service)
    batch.add_routes(app, service, prompter)
    openai.add_routes(app, service, prompter)
    return app


def _add_status_routes(app: FastAPI, service: RolloutService) -> None:
    """Liveness, readiness and Prometheus metrics."""

    @app.get("/health", summary="Liveness")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/ready", response_model=Readiness, responses={503: {"model": Readiness, "description": "No weights to serve (awaiting_weights)"}},
        summary="Readiness: model, version, queue depth, update in progress; 503 while awaiting weights",
    )  # fmt: skip
    async def ready() -> Any:
        readiness = service.readiness()
        return readiness if readiness["ready"] else JSONResponse(readiness, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics (text format, HELP and TYPE)")
    async def metrics() -> Response:
        return Response(service.metrics.text(), media_type=CONTENT_TYPE)


def _add_native_routes(app: FastAPI, service: RolloutService, prompter: Prompter) -> None:
    """tandem's own API: generate (blocking or async), collect by id, abort by id."""

    @app.post("/generate", response_model=GenerateResponse, summary="Sample n completions of one prompt")
    async def generate(body: GenerateRequest, request: Request) -> GenerateResponse | Response:
        messages = [m.model_dump() for m in body.messages] if body.messages is not None else None
        prompter.check_request_chars(body.prompt, messages, body.chat_template_kwargs)
        params = to_sampling_params(body)
        prompt_ids = await prompter.encode_off_loop(
            prompt_ids=body.prompt_ids, prompt=body.prompt, messages=messages, chat_template_kwargs=body.chat_template_kwargs, max_tokens=params.max_tokens
        )
        prompter.check(prompt_ids, params)
        if body.is_async:
            return GenerateResponse(request_ids=service.submit(prompt_ids, params, body.n))
        tasks = service.start([(prompt_ids, p) for p in per_sample(params, body.n)])  # all n, or a 503 before any starts
        if await until_done_or_disconnect(request, asyncio.gather(*tasks, return_exceptions=True)) is None:
            return Response(status_code=499)  # the client hung up (nginx's code): its tasks are cancelled, nobody reads them
        results = [service.result(uuid.uuid4().hex, task) for task in tasks]
        errors = [t.exception() for t in tasks if not t.cancelled() and t.exception() is not None]
        for error in errors:
            if isinstance(error, (Busy, ValueError)):  # a full queue (503) or a request the generator refused (400)
                raise error
        failed = [r.error for r in results if r.error is not None]
        if failed:
            raise HTTPException(500, f"generation failed: {failed[0]}")
        for r in results:
            r.text = prompter.decode(r.token_ids)
        return GenerateResponse(request_ids=[r.request_id for r in results], results=results)

    @app.post("/collect", response_model=CollectResponse, summary="Long-poll results of async requests by id")
    async def collect(body: CollectRequest) -> CollectResponse:
        _check_known(service, body.request_ids)
        results, pending = await service.collect(body.request_ids, body.timeout_s)
        for r in results:
            r.text = prompter.decode(r.token_ids)
        return CollectResponse(results=results, pending=pending)

    @app.post("/abort", summary="Abort requests by id: they finish with reason abort; those already finished keep their results, answered as finished. 404 when none is known")
    async def abort(body: AbortRequest) -> dict[str, list[str]]:
        unknown = service.known(body.request_ids)
        known = [i for i in body.request_ids if i not in unknown]
        if not known:
            _check_known(service, body.request_ids)  # raises 404
        finished = service.abort(known)  # the others may have just been collected: not an error when some are known
        done = set(finished)
        return {"aborted": [i for i in known if i not in done], "finished": finished, "unknown": unknown}


def _add_admin_routes(app: FastAPI, service: RolloutService) -> None:
    """Sleep/wake and the weight-sync routes the trainer drives."""

    @app.post("/sleep", summary="Finish running requests, then free the KV cache (1) and weights (2); 504 (still awake) if they run past --drain_timeout_s")
    async def sleep(body: SleepRequest) -> dict[str, bool]:
        try:
            await service.sleep(body.level)
        except Undrained as error:
            raise HTTPException(504, str(error)) from None
        return {"asleep": True}

    @app.post("/wake", summary="Re-allocate what sleep freed and admit requests again (after level 2: 503 until a weight update)")
    async def wake() -> dict[str, bool]:
        await service.wake()
        return {"asleep": False}

    @app.post("/weights/init", summary="Join the trainer's weight-sync group (sent by the trainer); 409 while another init is in flight")
    async def weights_init(body: WeightGroupRequest) -> dict[str, str]:
        try:
            await service.join_weight_group(body.model_dump())
        except JoinInProgress as error:
            raise HTTPException(409, str(error)) from None
        except (RuntimeError, OSError) as error:  # torch.distributed raises these for a failed rendezvous
            raise HTTPException(504, f"could not join weight-sync group {body.group_id}: {error}") from None
        return {"weight_group": body.group_id}

    @app.post("/weights/update", response_model=WeightUpdateResponse, summary="Receive a whole weight update, then make its version live")
    async def weights_update(body: WeightUpdateRequest, request: Request) -> WeightUpdateResponse:
        current = service.receiver.group_id if service.receiver else None
        if body.group_id != current:
            raise HTTPException(409, f"not in weight-sync group {body.group_id} (in {current}); POST /weights/init first")
        try:  # the trainer hanging up (its process killed) ends the receive at once, even one stuck in NCCL
            num_tensors, num_bytes, seconds = await service.update_weights(
                version=body.version, mode=body.mode, hangup=disconnected(request)
            )
        except ValueError as error:  # received whole, refused before any of it was copied: inf or NaN, a name or shape not this model's
            raise HTTPException(422, f"weight update to version {body.version} refused: {error}; kept version {service.generator.version}") from None
        except (RuntimeError, OSError) as error:
            raise HTTPException(504, f"weight sync to version {body.version} failed: {error}; kept version {service.generator.version}") from None
        return WeightUpdateResponse(policy_version=service.generator.version, num_tensors=num_tensors, num_bytes=num_bytes, seconds=seconds)


def _check_known(service: RolloutService, request_ids: list[str]) -> None:
    unknown = service.known(request_ids)
    if unknown:
        raise HTTPException(404, f"unknown request ids (never issued, already collected or expired): {unknown[:5]}")


def _add_guards(app: FastAPI, api_key: str | None) -> None:
    """Bearer-token check on every route; user errors become 400, a full queue 503."""
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.exception_handler(ValueError)
    async def bad_request(request: Request, error: ValueError) -> JSONResponse:
        return JSONResponse(_error_body(str(error), "invalid_request_error"), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        if not request.url.path.startswith("/v1/"):
            return JSONResponse({"detail": _short_inputs(error.errors())}, status_code=422)  # FastAPI's 422 detail
        first = error.errors()[0]
        if first.get("type") == "json_invalid":  # its loc is ("body", <character position>): no parameter to name
            where = first["loc"][1] if len(first["loc"]) > 1 else "?"
            message = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])} at character {where})"
            return JSONResponse(_error_body(message, "invalid_request_error"), status_code=400)
        param = ".".join(str(part) for part in first["loc"][1:]) or None  # ("body", "messages", 0) -> "messages.0"
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        if first.get("type") in ("int_type", "float_type", "bool_type", "string_type"):  # a value of another JSON type: say which
            message += f", not {_json_type(first.get('input'))}"
        return JSONResponse(_error_body(message, "invalid_request_error", param=param), status_code=400)

    @app.exception_handler(openai.ModelNotFound)
    async def no_such_model(request: Request, error: openai.ModelNotFound) -> JSONResponse:
        body = _error_body(str(error), "invalid_request_error", param="model")
        body["error"]["code"] = "model_not_found"
        return JSONResponse(body, status_code=404)

    @app.exception_handler(Busy)
    async def busy(request: Request, error: Busy) -> JSONResponse:
        body = _error_body(str(error), "server_busy")
        if error.max_pending_requests is not None:  # a full queue: its size, for a client to split its batches by
            body["max_pending_requests"] = error.max_pending_requests
        return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        """FastAPI's own 4xx (a body json.loads refuses beside a JSONDecodeError, an unknown route): saying
        why, and on the OpenAI routes in OpenAI's error object."""
        if error.detail == "There was an error parsing the body" and error.__cause__ is not None:
            error = StarletteHTTPException(400, f"the request body is not JSON this server reads ({_body_fault(error.__cause__)})")
        if not request.url.path.startswith("/v1/"):
            return await http_exception_handler(request, error)
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return JSONResponse(_error_body(str(error.detail), kind), status_code=error.status_code, headers=error.headers)


def _body_fault(error: BaseException) -> str:
    """Example: RecursionError -> 'nested too deeply'; an int of 5000 digits -> 'Exceeds the limit (4300 digits) ...'."""
    if isinstance(error, RecursionError):
        return "nested too deeply"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8: byte {error.object[error.start]:#x} at {error.start}"
    text = " ".join(str(error).split(";")[0].split())  # an int's digit limit: less its advice on raising the limit
    return f"{type(error).__name__}: {text}" if not isinstance(error, ValueError) else text


def _short_inputs(errors: Any, most: int = 200) -> list[dict[str, Any]]:
    """FastAPI's 422 detail, each error's `input` kept only when its JSON is short and finite: an id of a
    megabyte (or a whole body, a model-level error's input) was sent back whole, and a NaN (Python's JSON
    reads one) made the detail unwritable, a 400 naming no field."""
    detail = jsonable_encoder(errors)
    for entry in detail:
        try:
            keep = len(json.dumps(entry.get("input"), allow_nan=False)) <= most
        except ValueError:
            keep = False
        if not keep:
            entry.pop("input", None)
    return detail


def _json_type(value: Any) -> str:
    """Example: "5" -> 'a string'; True -> 'a boolean'; 5.5 -> 'a non-integer number'."""
    kinds = ((bool, "a boolean"), (str, "a string"), (int, "an integer"), (float, "a non-integer number"), (list, "an array"), (dict, "an object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "null")


def _error_body(message: str, kind: str, *, param: str | None = None) -> dict[str, Any]:
    """FastAPI's `detail`, and OpenAI's `error` object so that OpenAI clients show the message."""
    return {"detail": message, "error": {"message": message, "type": kind, "param": param, "code": None}}


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` is answered 413, by its Content-Length at once,
    or as soon as the bytes read pass the limit (a chunked body), never read whole into memory."""

    def __init__(self, app: Any, *, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        num_read = 0

        async def limited() -> dict:
            nonlocal num_read
            message = await receive()
            num_read += len(message.get("body", b""))
            if num_read > self.max_bytes:
                raise _TooLarge
            return message

        async def unless_too_large(message: dict) -> None:
            if num_read <= self.max_bytes:  # else the route's answer (FastAPI makes the raise a 400) is replaced
                await send(message)

        try:
            await self.app(scope, limited, unless_too_large)
        except _TooLarge:
            pass
        if num_read > self.max_bytes:  # raised while the route read its body: nothing has been sent yet
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        message = f"the request body is over {self.max_bytes} bytes (--max_request_bytes)"
        await JSONResponse(_error_body(message, "invalid_request_error"), status_code=413)(scope, receive, send)


class _TooLarge(Exception):
    pass


class BearerAuth:
    """ASGI middleware: every HTTP request needs `Authorization: Bearer KEY`, else 401."""

    def __init__(self, app: Any, *, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = JSONResponse({"detail": "missing or wrong API key; send Authorization: Bearer KEY (tandem train: --api_key or TANDEM_API_KEY)"}, status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
