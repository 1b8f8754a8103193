"""The client's batching against a scripted server (httpx.MockTransport): the calls of one tick leave
as one request per server; a retry resends only the unresolved items, under their ids; a bad call
fails alone; a garbled answer fails its calls instead of leaving them waiting."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RemoteGenerator, RolloutClient, ServerError
from tandemrl.types import SamplingParams

PARAMS = SamplingParams(max_tokens=2)
URLS = ("http://a", "http://b")


def line(item: dict, **over) -> bytes:
    result = {"request_id": item["request_id"], "token_ids": [item["prompt_ids"][0]] * 2, "logprobs": [0.0] * 2,
              "policy_versions": [0] * 2, "finish_reason": "length", "status": 200, **over}
    return json.dumps(result).encode() + b"\n"


class Cut(httpx.AsyncByteStream):
    """Streams `head`, then the connection breaks."""

    def __init__(self, head: bytes):
        self.head = head

    async def __aiter__(self):
        yield self.head
        raise httpx.ReadError("connection reset")


def generator(handle, urls=URLS) -> tuple[RemoteGenerator, list[tuple[str, list[dict]]]]:
    """A RemoteGenerator whose servers answer /ready and pass each /generate_batch to `handle`."""
    posts: list[tuple[str, list[dict]]] = []

    def route(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ready":
            return httpx.Response(200, json={"ready": True})
        items = json.loads(request.content)["items"]
        posts.append((request.url.host, items))
        return handle(len(posts), items)

    gen = RemoteGenerator(RemoteConfig(urls=urls, max_retries=2))
    gen.client.close()
    gen.client = RolloutClient(gen.config, transport=httpx.MockTransport(route))
    return gen, posts


def run(gen: RemoteGenerator, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list:
    async def main():
        return await asyncio.gather(*(gen.generate(p, params) for p in prompts), return_exceptions=True)

    try:
        return asyncio.run(main())
    finally:
        asyncio.run(gen.close())


def test_calls_of_one_tick_leave_as_one_request_per_server_split_evenly():
    gen, posts = generator(lambda _, items: httpx.Response(200, content=b"".join(map(line, items))))
    completions = run(gen, [[i] for i in range(10)])
    assert [c.token_ids for c in completions] == [[i, i] for i in range(10)]
    assert sorted((host, len(items)) for host, items in posts) == [("a", 5), ("b", 5)]


def test_a_retry_resends_only_the_unresolved_items_under_their_ids():
    def handle(num_post: int, items: list[dict]) -> httpx.Response:
        if num_post == 1:  # the first item's answer arrives, then the connection breaks
            return httpx.Response(200, stream=Cut(line(items[0])))
        return httpx.Response(200, content=b"".join(map(line, items)))

    gen, posts = generator(handle, urls=URLS[:1])
    completions = run(gen, [[1], [2], [3]])
    assert [c.token_ids for c in completions] == [[1, 1], [2, 2], [3, 3]]
    (_, first), (_, retried) = posts
    assert [i["request_id"] for i in retried] == [i["request_id"] for i in first[1:]]


def test_a_bad_call_fails_alone():
    refuse = lambda item: line(item, status=400, error="token ids outside the vocabulary", finish_reason="error")  # noqa: E731
    gen, posts = generator(lambda _, items: httpx.Response(200, content=b"".join(refuse(i) if i["prompt_ids"] == [9] else line(i) for i in items)))
    ok, bad_on_server = run(gen, [[1], [9]])
    assert ok.token_ids == [1, 1] and isinstance(bad_on_server, ServerError) and bad_on_server.status == 400


def test_a_garbled_answer_fails_its_calls_instead_of_hanging(caplog):
    """The calls fail saying why; the error is not left in the send's task (asyncio's "Task exception was never
    retrieved" traceback, the only place it was said on main)."""
    import gc

    gen, _ = generator(lambda _, items: httpx.Response(200, content=b'{"request_id": "x", "tok\n'))
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        (error,) = run(gen, [[1]])
        gc.collect()
    assert isinstance(error, RuntimeError) and "could not be read (JSONDecodeError: Unterminated string" in str(error), error
    assert "never retrieved" not in caplog.text


def test_a_busy_server_is_retried_then_one_clear_error():
    gen, posts = generator(lambda _, items: httpx.Response(503, json={"detail": "4096 requests pending"}), urls=URLS[:1])
    (error,) = run(gen, [[1]])
    assert isinstance(error, ConnectionError) and "busy" in str(error) and len(posts) == 3  # max_retries=2


class Queue:
    """A server's queue of `size`: a /generate_batch that does not fit whole is answered 503 (nothing started); the
    items of one that fits are pending until their lines are sent. tandem rollout states its size on /ready and
    in such a 503 (`on_ready`, `on_503`); an older one in neither."""

    def __init__(self, size: int, *, on_ready: bool = True, on_503: bool = True):
        self.size, self.on_ready, self.on_503, self.pending, self.peak = size, on_ready, on_503, 0, 0

    def ready(self) -> httpx.Response:
        return httpx.Response(200, json={"ready": True, **({"max_pending_requests": self.size} if self.on_ready else {})})

    def answer(self, items: list[dict]) -> httpx.Response:
        if self.pending + len(items) > self.size:
            return httpx.Response(503, json={"detail": f"{len(items)} more do not fit", **({"max_pending_requests": self.size} if self.on_503 else {})})
        self.pending += len(items)
        self.peak = max(self.peak, self.pending)
        return httpx.Response(200, stream=Run(self, items))


class Run(httpx.AsyncByteStream):
    def __init__(self, queue: Queue, items: list[dict]):
        self.queue, self.items = queue, items

    async def __aiter__(self):
        await asyncio.sleep(0.01)  # the items run a while
        self.queue.pending -= len(self.items)  # their slots are free before their lines go out
        yield b"".join(map(line, self.items))


def queued(queues: dict[str, Queue]) -> tuple[RemoteGenerator, list[tuple[str, list[dict]]]]:
    """A RemoteGenerator over servers named by `queues`' keys, each with its Queue."""
    posts: list[tuple[str, list[dict]]] = []

    def route(request: httpx.Request) -> httpx.Response:
        queue = queues[request.url.host]
        if request.url.path != "/generate_batch":  # /ready, and the /health of the client's liveness probe
            return queue.ready()
        posts.append((request.url.host, json.loads(request.content)["items"]))
        return queue.answer(posts[-1][1])

    gen = RemoteGenerator(RemoteConfig(urls=tuple(f"http://{host}" for host in queues), max_retries=2))
    gen.client.close()
    gen.client = RolloutClient(gen.config, transport=httpx.MockTransport(route))
    return gen, posts


def test_each_server_is_sent_what_its_queue_takes_and_the_rest_as_calls_end():
    """16 calls of one tick against queues of 3 and 5: on main each server got its 8 in one request, answered 503
    (nothing started) on every retry, and every call failed. Now no request is refused and each queue is full."""
    queues = {"a": Queue(3), "b": Queue(5)}
    gen, posts = queued(queues)
    completions = run(gen, [[i] for i in range(16)])
    assert [c.token_ids for c in completions] == [[i, i] for i in range(16)], completions
    assert sum(len(items) for _, items in posts) == 16 and (queues["a"].peak, queues["b"].peak) == (3, 5), posts


def test_a_503_stating_the_queue_size_sends_the_calls_again_in_requests_that_fit():
    """A server whose /ready did not say its size (e.g. it restarted with a smaller queue): its 503 says it, and
    the calls go again in requests that fit, instead of whole until the retries run out (as on main)."""
    gen, posts = queued({"a": Queue(3, on_ready=False)})
    completions = run(gen, [[i] for i in range(8)])
    assert [c.token_ids for c in completions] == [[i, i] for i in range(8)], completions
    assert [len(items) for _, items in posts] == [8, 3, 3, 2], posts


def test_a_server_that_states_no_queue_size_is_sent_the_whole_tick_as_before():
    gen, posts = queued({"a": Queue(3, on_ready=False, on_503=False)})
    errors = run(gen, [[i] for i in range(4)])
    assert all(isinstance(e, ConnectionError) and "4 more do not fit" in str(e) and "gave up after 3 tries" in str(e) for e in errors), errors
    assert [len(items) for _, items in posts] == [4, 4, 4]


@pytest.mark.parametrize("text", ["a\u2028b", "c\x85d"])
def test_results_split_on_newlines_only(text):
    gen, _ = generator(lambda _, items: httpx.Response(200, content=b"".join(line(i, text=text) for i in items)))
    assert [c.token_ids for c in run(gen, [[1], [2]])] == [[1, 1], [2, 2]]


def test_the_calls_on_a_server_gone_silent_move_to_another_within_the_silence_deadline():
    """Server a stops answering anything (SIGSTOP: its /health too); its calls move to b once
    rollout_server_silence_s pass, and finish there. With no other server they fail at once instead."""
    import time

    posts: list[str] = []

    async def route(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a" and request.url.path != "/ready":
            await asyncio.Event().wait()  # silence
        if request.url.path in ("/ready", "/health"):
            return httpx.Response(200, json={"ready": True})
        items = json.loads(request.content)["items"]
        posts.append(request.url.host)
        return httpx.Response(200, content=b"".join(map(line, items)))

    for urls in (URLS, URLS[:1]):
        gen = RemoteGenerator(RemoteConfig(urls=urls, rollout_server_silence_s=0.3))
        gen.client.close()
        gen.client = RolloutClient(gen.config, transport=httpx.MockTransport(route))
        started = time.monotonic()
        results = run(gen, [[i] for i in range(4)])
        assert time.monotonic() - started < 2.0
        if len(urls) == 2:
            assert [c.token_ids for c in results] == [[i, i] for i in range(4)] and posts == ["b", "b"]
        else:
            assert all(isinstance(e, TimeoutError) and "http://a answered nothing for 0.3 s" in str(e) for e in results)


def test_a_floor_of_a_token_that_excluded_nothing_crosses_the_wire_as_no_floor():
    """A filtering row that excludes nothing (min-p over a flat distribution, top-k past the vocabulary)
    reports the floor -inf. The server's NDJSON (pydantic) writes it as null; the client must read that
    back as -inf, not None: packed as NaN, the trainer kept only the target there (logprob 0, ratio far from 1)."""
    import torch

    from tandemrl.algo.logprobs import truncated
    from tandemrl.server.batch import _encode
    from tandemrl.server.wire import BatchResult
    from tandemrl.train.batching import pack
    from tandemrl.types import TokenTrace

    def handle(_, items):
        results = [BatchResult(request_id=i["request_id"], token_ids=[3, 4], logprobs=[-1.0, -2.0], policy_versions=[0, 0],
                               logit_floors=[float("-inf"), 0.5], finish_reason="length") for i in items]  # fmt: skip
        return httpx.Response(200, content=_encode(results))

    gen, _ = generator(handle, urls=URLS[:1])
    (completion,) = run(gen, [[1]])
    assert completion.logit_floors == [float("-inf"), 0.5]
    trace = TokenTrace()
    trace.append_context([1])
    trace.append_sampled(completion)
    floors = pack([trace], [0.0]).logit_floors
    assert floors[:2].tolist() == [float("-inf"), 0.5]
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 0.2]])
    assert truncated(logits, floors[:1], torch.tensor([3]), 1.0).equal(logits)  # nothing excluded, as sampled
