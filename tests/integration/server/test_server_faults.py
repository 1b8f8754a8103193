"""Faults with real processes: kill -9 the server mid-request and mid-sync, restart it, kill the
trainer mid-sync. Nothing hangs; errors are clear; a server keeps its version and keeps serving."""

from __future__ import annotations

import concurrent.futures
import datetime
import re
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest
from rollout_helpers import (
    GREEDY,
    kill_server_mid_sync_then_check_trainer,
    kill_trainer_mid_sync_then_check_server,
    local_greedy,
    start_server,
    push,
    sync,
    trainer_model,
)

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RolloutClient
from tandemrl.generation.remote.batch import ServerError


def test_kill_server_mid_request_raises_within_timeout_then_restart_reconnects_and_full_sync_restores_version(tiny_model_dir, tiny_tokenizer):
    server = start_server(tiny_model_dir)
    client = RolloutClient(RemoteConfig(urls=(server.url,), rollout_server_timeout=60, request_timeout_s=20, max_retries=3))
    try:
        model = trainer_model(tiny_model_dir, 5)
        push(client, model.named_parameters(), version=7, config=sync())
        server.post("/sleep", {"level": 1})  # requests now wait at the gate: the kill lands mid-request
        future = client.submit([5, 6, 7], GREEDY)
        time.sleep(0.5)
        start = time.monotonic()
        server.kill()
        with pytest.raises(ConnectionError, match="cannot reach rollout server"):
            future.result(timeout=30)
        assert time.monotonic() - start < 20
        with pytest.raises(RuntimeError, match="weight sync of version 8 to http.* failed"):
            push(client, model.named_parameters(), version=8, config=sync())

        server = start_server(tiny_model_dir, port=urlparse(server.url).port)
        assert client.readiness()[0]["policy_version"] == 0  # a fresh server: base weights
        push(client, model.named_parameters(), version=7, config=sync())  # re-forms the group
        assert client.readiness()[0]["policy_version"] == 7
        prompt_ids = tiny_tokenizer.encode("hello")
        assert client.generate(prompt_ids, GREEDY).token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)

        readiness_calls = []
        real = client.servers_ready
        client.servers_ready = lambda: readiness_calls.append(1) or real()
        push(client, model.named_parameters(), version=8, config=sync())  # a live group: no readiness round trip
        assert readiness_calls == []
        server.kill()  # restarted between two updates, no failed update in between: the next one forms the group again
        server = start_server(tiny_model_dir, port=urlparse(server.url).port)
        push(client, model.named_parameters(), version=9, config=sync())
        assert client.readiness()[0]["policy_version"] == 9 and readiness_calls == [1]
        assert client.generate(prompt_ids, GREEDY).token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)
    finally:
        client.close()
        server.stop()


def test_kill_server_mid_sync_is_a_clear_error_on_the_trainer_within_the_deadline(tiny_model_dir):
    server = start_server(tiny_model_dir)
    try:
        kill_server_mid_sync_then_check_trainer(server, tiny_model_dir)
    finally:
        server.stop()


def test_kill_trainer_mid_sync_server_logs_it_keeps_its_version_and_serves(tiny_model_dir, tiny_tokenizer):
    server = start_server(tiny_model_dir)
    try:
        kill_trainer_mid_sync_then_check_server(server, tiny_tokenizer, tiny_model_dir)  # deadline: weight_sync_timeout_s, 30 s
    finally:
        server.stop()


@pytest.fixture(scope="module")
def small_server(tiny_model_dir):
    s = start_server(tiny_model_dir, "--max_pending_requests", "4", "--result_ttl_s", "1", "--max_prompt_chars", "1000", backend="engine")
    yield s
    s.stop()


def test_async_requests_are_admitted_by_the_pending_limit_and_uncollected_results_expire_on_a_timer(small_server):
    body = {"prompt": "async", "max_tokens": 100, "ignore_eos": True, "is_async": True}
    assert small_server.post("/generate", {**body, "n": 5}).status_code == 503  # more than the limit at once
    ids = small_server.post("/generate", {**body, "n": 4}).json()["request_ids"]
    assert small_server.post("/generate", {**body, "n": 1}).status_code == 503  # the four still count
    results = small_server.post("/collect", {"request_ids": ids, "timeout_s": 120}).json()["results"]
    assert [r["finish_reason"] for r in results] == ["length"] * 4
    ids = small_server.post("/generate", {**body, "max_tokens": 2}).json()["request_ids"]
    time.sleep(4)  # past the TTL, with no later submit to sweep it
    held = [line.split()[1] for line in small_server.get("/metrics").text.splitlines() if line.startswith("tandem_async_results_held ")]
    assert [float(v) for v in held] == [0.0]
    assert small_server.post("/collect", {"request_ids": ids, "timeout_s": 0}).status_code == 404


def test_a_client_that_hangs_up_on_a_blocking_request_leaves_no_traceback(small_server):
    hung_up = 0
    for timeout_s in (0.05, 0.1, 0.2):  # hang up mid-generation (one of them, however fast the engine is)
        try:
            httpx.post(small_server.url + "/generate", json={"prompt": "long", "max_tokens": 120, "ignore_eos": True, "n": 4}, timeout=timeout_s)
        except httpx.TimeoutException:
            hung_up += 1
    assert hung_up
    time.sleep(2)
    assert small_server.post("/generate", {"prompt": "after", "max_tokens": 2}).status_code == 200
    assert "Traceback" not in small_server.log_text() and "InvalidStateError" not in small_server.log_text()


def test_the_prompt_character_cap_holds_per_request_before_any_prompt_is_tokenized(small_server):
    """30 prompts of ~1M characters each, each under the cap and all under the body limit, cost 123 s of
    tokenizing before their 400. The cap (here 1,000) counts every prompt of a request together, before
    any is rendered or tokenized: a 400 at once, naming the flag and the fix, on every text route."""
    many = ["x" * 900] * 30  # each under the cap; 27,000 characters in all
    chat = [{"role": "user", "content": [{"type": "text", "text": p}]} for p in many]
    refused = [
        ("/v1/completions", {"prompt": many, "max_tokens": 1}),
        ("/generate_batch", {"items": [{"prompt": p, "request_id": str(i), "max_tokens": 1} for i, p in enumerate(many)]}),
        ("/generate_batch", {"items": [{"messages": chat[:1], "request_id": str(i), "max_tokens": 1} for i in range(30)]}),
        ("/v1/chat/completions", {"messages": chat, "max_tokens": 1}),
        ("/generate", {"messages": chat, "max_tokens": 1}),
    ]
    small_server.get("/ready")  # a fresh server's first answer is slow
    for path, body in refused:
        started = time.monotonic()
        answer = httpx.post(small_server.url + path, json=body, timeout=60)
        assert answer.status_code == 400, (path, answer.status_code, answer.text[:300])
        counted = re.search(r"has (\d+) characters in all; this server takes at most 1000 per request \(--max_prompt_chars\)", answer.json()["detail"])
        assert counted and 27000 <= int(counted.group(1)) < 28000 and time.monotonic() - started < 3, (path, answer.text[:300])  # roles counted too
    answer = httpx.post(small_server.url + "/v1/completions", json={"prompt": ["hello"] * 2, "max_tokens": 1}, timeout=60)
    assert answer.status_code == 200, answer.text[:300]  # a list under the cap in all: served


def _silent_listener() -> tuple[socket.socket, list[socket.socket]]:
    """A peer that accepts every connection and never says a word."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: [accepted.append(listener.accept()[0]) for _ in iter(int, 1)], daemon=True).start()
    return listener, accepted


@pytest.mark.parametrize("peer", ["silent_socket", "store_without_a_group"])
def test_weights_init_keeps_its_deadline_against_a_silent_peer_and_blocks_nothing(small_server, peer):
    """Each rendezvous step: the connection (a peer that accepts and never speaks) and the group (a store
    that answers, and a trainer that never forms the group). 504 within the deadline, routes free after."""
    import torch.distributed as dist

    if peer == "silent_socket":
        listener, _ = _silent_listener()
        port, keep = listener.getsockname()[1], listener
    else:
        keep = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
        port = keep.port
    spec = {"master_addr": "127.0.0.1", "master_port": port, "rank": 1, "world_size": 2, "transport": "gloo", "group_id": peer, "timeout_s": 2}
    started = time.monotonic()
    answer = httpx.post(small_server.url + "/weights/init", json=spec, timeout=60)
    assert answer.status_code == 504 and time.monotonic() - started < 2 + 10, (answer.status_code, answer.text)
    for path in ("/sleep", "/wake"):  # the update lock is free again
        assert small_server.post(path, {}).status_code == 200
    assert small_server.get("/ready").json()["weight_group"] is None
    assert small_server.post("/generate", {"prompt": "after", "max_tokens": 2}).status_code == 200
    del keep


def test_concurrent_weights_inits_are_409_at_once_and_sleep_wake_ready_never_wait_for_a_rendezvous(small_server):
    """5 concurrent inits of a 5 s timeout took 50 s in all (each waited for the one before) and /wake 12 s
    behind one: an init in flight now answers the others 409 at once, and /sleep, /wake and /ready answer
    at once while its rendezvous waits on a silent peer; after its 504 the server serves."""
    listener, _ = _silent_listener()
    spec = {"master_addr": "127.0.0.1", "master_port": listener.getsockname()[1], "rank": 1, "world_size": 2, "transport": "gloo", "timeout_s": 1}

    def init(group_id: str) -> tuple[int, float, str]:
        started = time.monotonic()
        answer = httpx.post(small_server.url + "/weights/init", json={**spec, "group_id": group_id}, timeout=60)
        return answer.status_code, time.monotonic() - started, answer.text

    def timed(call) -> float:
        started = time.monotonic()
        assert call().status_code == 200
        return time.monotonic() - started

    small_server.get("/ready")  # a fresh server's first answer is slow
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        first = pool.submit(init, "first")
        time.sleep(0.5)  # in its rendezvous
        others = [pool.submit(init, f"other{i}") for i in range(4)]
        waits = [timed(lambda: small_server.post(path, {})) for path in ("/sleep", "/wake")] + [timed(lambda: small_server.get("/ready"))]
        assert not first.done()
        answers = [o.result() for o in others]
        assert [a[0] for a in answers] == [409] * 4 and all("an init is in progress" in a[2] for a in answers), answers
        assert max(a[1] for a in answers) < 2 and max(waits) < 2, (answers, waits)  # ~0.1 s; they took 7 s and more
        status, seconds, text = first.result()
    assert status == 504 and seconds < 1 + 10, (status, seconds, text)
    assert small_server.get("/ready").json()["weight_group"] is None
    assert small_server.post("/generate", {"prompt": "after", "max_tokens": 2}).status_code == 200


def test_a_trainer_that_hangs_up_mid_update_while_its_collectives_stay_silent_is_given_up_at_once(small_server, tiny_model_dir):
    """As NCCL with a dead trainer: no collective fails, none completes. The trainer's announce connection
    closing ends the update within a second (not the group's 30 s timeout); the version stays, the group
    is left, and the server serves."""
    import json

    import torch

    from tandemrl.weights.buckets import plan_windows
    from tandemrl.weights.group import WeightSender

    sender = WeightSender(sync())  # 30 s of no progress before either side gives up on its own
    try:
        version = small_server.get("/ready").json()["policy_version"]
        (spec,) = sender.plan(num_servers=1, transport="gloo", master_addr="127.0.0.1")
        join = threading.Thread(target=lambda: small_server.post("/weights/init", spec))
        join.start()
        sender.connect(torch.device("cpu"))
        join.join(60)
        body = json.dumps({"version": version + 1, "mode": "drain", "group_id": sender.group_id}).encode()
        host, port = urlparse(small_server.url).hostname, urlparse(small_server.url).port
        with socket.create_connection((host, port)) as announce:  # the trainer's request, held open as httpx would
            announce.sendall(b"POST /weights/update HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            named = trainer_model(tiny_model_dir, 3).named_parameters()
            window, _ = next(plan_windows(named, 2**16, 2**30))
            sender._group.hello()
            sender._group.send_meta(window.encode())  # the metadata, then silence: the server waits in the payload
            deadline = time.monotonic() + 10
            while not small_server.get("/ready", timeout=1).json()["update_in_progress"] and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
        hung_up = time.monotonic()  # the trainer's process died: its socket closed; its gloo group (here) lives on
        while small_server.get("/ready", timeout=1).json()["update_in_progress"] and time.monotonic() < hung_up + 10:
            time.sleep(0.05)
        assert time.monotonic() - hung_up < 2
        ready = small_server.get("/ready", timeout=1).json()
        assert ready["policy_version"] == version and ready["weight_group"] is None, ready
        assert f"weight sync to version {version + 1} failed (the trainer hung up" in small_server.log_text()
        assert small_server.post("/generate", {"prompt": "after", "max_tokens": 2}).status_code == 200
    finally:
        sender.close()


def test_wake_after_sleep_level_2_without_a_push_is_not_ready_and_refuses_requests_until_weights_arrive(tiny_model_dir, tiny_tokenizer):
    """Level 2 drops the engine's weights (no copy kept): after /wake, with no weight update yet, /ready says
    not ready (503) and a request is a prompt 503 naming the fix, never a wait for weights nobody sends.
    A push makes the server ready and serving again."""
    server = start_server(tiny_model_dir, backend="engine")
    client = RolloutClient(RemoteConfig(urls=(server.url,), rollout_server_timeout=60, request_timeout_s=30))
    try:
        body = {"prompt_ids": tiny_tokenizer.encode("hello"), "temperature": 0, "max_tokens": 8, "ignore_eos": True}
        assert server.post("/sleep", {"level": 2}).status_code == 200
        asleep = server.get("/ready", timeout=5)
        assert asleep.status_code == 503 and asleep.json()["awaiting_weights"] and asleep.json()["asleep"]
        assert server.post("/wake", {}).json() == {"asleep": False}
        ready = server.get("/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["ready"] is False and ready.json()["awaiting_weights"], ready.text
        started = time.monotonic()
        refused = httpx.post(server.url + "/generate", json=body, timeout=10)
        assert refused.status_code == 503 and "weight update" in refused.json()["detail"], refused.text
        batch = httpx.post(server.url + "/generate_batch", json={"items": [{**body, "request_id": "a"}]}, timeout=10)
        assert batch.status_code == 503 and "weight update" in batch.json()["detail"], batch.text
        assert time.monotonic() - started < 5
        model = trainer_model(tiny_model_dir, 5)
        push(client, model.named_parameters(), version=1, config=sync())
        ready = server.get("/ready", timeout=5)
        assert ready.status_code == 200 and ready.json()["ready"] and not ready.json()["awaiting_weights"]
        prompt_ids = tiny_tokenizer.encode("hello")
        assert client.generate(prompt_ids, GREEDY).token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)
    finally:
        client.close()
        server.stop()


def test_an_openai_request_with_more_choices_than_free_slots_is_a_503_before_anything_starts(small_server):
    """Streamed, it was a 200 cut without an error event or [DONE]; plain, it first started its
    generations, holding every slot, before its 503. Both are a 503 now, nothing started."""
    body = {"prompt": "many", "max_tokens": 100, "ignore_eos": True, "n": 5}  # the server takes 4 pending
    before = small_server.metrics()
    started = time.monotonic()
    streamed = httpx.post(small_server.url + "/v1/completions", json={**body, "stream": True}, timeout=30)
    assert streamed.status_code == 503 and streamed.json()["error"]["type"] == "server_busy", streamed.text
    plain = httpx.post(small_server.url + "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert plain.status_code == 503 and "do not fit" in plain.json()["error"]["message"], plain.text
    assert time.monotonic() - started < 5
    after = small_server.metrics()
    assert after["tandem_generated_tokens_total"] == before["tandem_generated_tokens_total"]  # no generation ran
    ok = httpx.post(small_server.url + "/v1/completions", json={**body, "n": 4, "max_tokens": 2, "stream": True}, timeout=60)
    assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]")


def test_a_blocking_generate_with_more_samples_than_free_slots_is_a_503_before_any_starts(small_server):
    """Native /generate with n over the free slots first ran the n that fitted to their end, holding every
    slot (and then counted them against itself: '4 requests pending; 1 more do not fit'), before its 503;
    the async form and the OpenAI routes refused at once. Now a 503 at once, nothing generated."""
    before = small_server.metrics()
    started = time.monotonic()
    refused = small_server.post("/generate", {"prompt": "many", "max_tokens": 100, "ignore_eos": True, "n": 5})  # the server takes 4
    assert refused.status_code == 503 and "5 more do not fit, now or ever" in refused.json()["detail"], refused.text
    assert "--max_pending_requests" in refused.json()["detail"]  # which flag: it was 'retry later' only
    assert refused.json()["max_pending_requests"] == 4 == small_server.get("/ready").json()["max_pending_requests"]  # for a client to split by
    assert time.monotonic() - started < 5
    after = small_server.metrics()
    assert after["tandem_generated_tokens_total"] == before["tandem_generated_tokens_total"]  # no generation ran
    assert small_server.post("/generate", {"prompt": "many", "max_tokens": 2, "n": 4}).status_code == 200


def test_sleep_and_a_drain_update_give_up_at_drain_timeout_s_with_a_504_and_the_server_serves_on_awake_at_its_version(tiny_model_dir):
    """/sleep and a drain-mode update waited for every running request with no deadline of their own (a request
    that never ended held them, and the trainer's push, for good; no flag on main): each now answers 504 after
    --drain_timeout_s naming how many still ran, and the server serves on, awake, at its version."""
    server = start_server(tiny_model_dir, "--drain_timeout_s", "0.3", "--max_model_len", "512")
    client = RolloutClient(RemoteConfig(urls=(server.url,), rollout_server_timeout=60, request_timeout_s=60))
    busy = {"prompt": "go", "n": 48, "is_async": True, "max_tokens": 500, "ignore_eos": True, "temperature": 0}

    def start_busy() -> list[str]:  # hf on CPU: one batch of ~2 s, run after the batches before it
        ids = server.post("/generate", busy).json()["request_ids"]
        while server.get("/ready").json()["num_running"] == 0:
            time.sleep(0.01)
        return ids

    try:
        model = trainer_model(tiny_model_dir, 4)
        push(client, model.named_parameters(), version=1, config=sync("drain"))  # the group formed: the next push is one round trip
        ids = start_busy()
        started = time.monotonic()
        with pytest.raises(ServerError, match=r"answered 504: not asleep: \d+ request\(s\) still running after 0.3 s \(--drain_timeout_s\)") as refused:
            client.post_all("/sleep", {"level": 1})
        assert time.monotonic() - started < 3 and "\n" not in str(refused.value)
        assert not server.get("/ready").json()["asleep"]
        ids += start_busy()
        with pytest.raises(RuntimeError, match=r"weight sync of version 2 .* answered 504: .* still running after 0.3 s \(--drain_timeout_s\).*; kept version 1$"):
            push(client, model.named_parameters(), version=2, config=sync("drain"))
        results = server.post("/collect", {"request_ids": ids, "timeout_s": 60}).json()
        assert results["pending"] == [] and {r["finish_reason"] for r in results["results"]} == {"length"}  # nothing lost
        assert all(set(r["policy_versions"]) == {1} for r in results["results"])
        push(client, model.named_parameters(), version=2, config=sync("drain"))  # nothing runs now: both go through
        assert server.post("/sleep", {"level": 1}).json() == {"asleep": True} and server.post("/wake", {}).json() == {"asleep": False}
        assert client.readiness()[0]["policy_version"] == 2
    finally:
        client.close()
        server.stop()


@pytest.fixture(scope="module")
def tight_server(tiny_model_dir):
    s = start_server(tiny_model_dir, "--max_pending_requests", "4")
    yield s
    s.stop()


@pytest.mark.parametrize("path, extra", [
    ("/generate", {"prompt": "go"}),
    ("/v1/completions", {"prompt": "go"}),
    ("/v1/completions", {"prompt": "go", "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}]}),
], ids=["generate", "completions", "completions-stream", "chat"])  # fmt: skip
def test_a_request_answered_503_for_a_full_queue_ran_none_of_its_samples(tight_server, path, extra):
    """The routes checked that n samples fit, then started them as tasks that each took its slot later: two
    requests could pass the check together, and one got a 503 after some of its samples ran (32 concurrent
    requests of n=3 under --max_pending_requests 4 ran 13 samples for four 200s on main). The check and the
    slots are one step now: every sample run belongs to a request answered 200."""
    body = {**extra, "n": 3, "max_tokens": 20, "ignore_eos": True}
    before = _num_finished(tight_server)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: httpx.post(tight_server.url + path, json=body, timeout=60), range(32)))
    codes = [a.status_code for a in answers]
    assert set(codes) == {200, 503} and all("do not fit" in a.json()["detail"] for a in answers if a.status_code == 503), codes
    assert all("server_busy" not in a.text for a in answers if a.status_code == 200)  # a stream's 200 whose sample was refused
    time.sleep(0.5)  # the last aborted sample is counted
    assert _num_finished(tight_server) - before == 3 * codes.count(200), codes


def _num_finished(server) -> float:
    return sum(v for k, v in server.metrics().items() if k.startswith("tandem_requests_total{"))
