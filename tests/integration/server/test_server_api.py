"""The native API of a real `tandem rollout` process: async submit + collect, blocking generate,
abort by id, bad input as 4xx that disturbs nobody, readiness, metrics, sleep/wake."""

from __future__ import annotations

import json
import time

import httpx
import pytest

GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}


def test_async_submit_returns_ids_at_once_and_collect_returns_results(server):
    answer = server.post("/generate", {"prompt": "hello", "n": 3, "is_async": True, **GREEDY})
    assert answer.status_code == 200 and answer.json()["results"] is None
    ids = answer.json()["request_ids"]
    assert len(set(ids)) == 3
    collected = server.post("/collect", {"request_ids": ids, "timeout_s": 60}).json()
    assert collected["pending"] == [] and sorted(r["request_id"] for r in collected["results"]) == sorted(ids)
    for r in collected["results"]:
        assert len(r["token_ids"]) == len(r["logprobs"]) == len(r["policy_versions"]) == 6
        assert r["finish_reason"] == "length" and r["policy_versions"] == [0] * 6
    again = server.post("/collect", {"request_ids": ids[:1], "timeout_s": 0})
    assert again.status_code == 404 and "unknown request ids" in again.json()["detail"]


def test_blocking_generate_accepts_ids_text_and_messages(server, tiny_tokenizer):
    by_text = server.post("/generate", {"prompt": "abc def", **GREEDY}).json()["results"][0]
    ids = tiny_tokenizer.encode("abc def")
    by_ids = server.post("/generate", {"prompt_ids": ids, **GREEDY}).json()["results"][0]
    assert by_text["token_ids"] == by_ids["token_ids"] and by_text["text"] == tiny_tokenizer.decode(by_ids["token_ids"], skip_special_tokens=True)
    chat = server.post("/generate", {"messages": [{"role": "user", "content": "hi"}], **GREEDY})
    assert chat.status_code == 200 and len(chat.json()["results"][0]["token_ids"]) == 6


def test_abort_by_id_finishes_the_request_with_abort(server):
    """Held at a sleeping server's gate, no request can finish before its abort arrives (running ones could:
    4 samples of 120 tokens all ended 'length' when the client sent the abort 0.4 s late on a busy machine)."""
    assert server.post("/sleep", {"level": 1}).status_code == 200
    try:
        ids = server.post("/generate", {"prompt": "x", "n": 4, "is_async": True, **GREEDY}).json()["request_ids"]
        assert server.post("/abort", {"request_ids": ids[:2]}).status_code == 200
    finally:
        server.post("/wake", {})
    results = server.post("/collect", {"request_ids": ids, "timeout_s": 60}).json()["results"]
    assert {r["request_id"]: r["finish_reason"] for r in results} == dict(zip(ids, ["abort", "abort", "length", "length"]))
    assert server.post("/abort", {"request_ids": ["nope"]}).status_code == 404


def test_an_abort_says_which_requests_had_already_finished_and_their_results_stand(server):
    """The answer listed every known id as aborted, those that had finished (and ended 'length') too."""
    done = server.post("/generate", {"prompt": "y", "is_async": True, **GREEDY}).json()["request_ids"]
    _until_nothing_runs(server)
    assert server.post("/abort", {"request_ids": done}).json() == {"aborted": [], "finished": done, "unknown": []}
    assert server.post("/collect", {"request_ids": done, "timeout_s": 60}).json()["results"][0]["finish_reason"] == "length"
    ids = server.post("/generate", {"prompt": "x", "n": 4, "is_async": True, "max_tokens": 120, "ignore_eos": True}).json()["request_ids"]
    answer = server.post("/abort", {"request_ids": ids}).json()  # running, or finished if this abort came late: each as answered
    results = server.post("/collect", {"request_ids": ids, "timeout_s": 60}).json()["results"]
    said = {**dict.fromkeys(answer["aborted"], "abort"), **dict.fromkeys(answer["finished"], "length")}
    assert {r["request_id"]: r["finish_reason"] for r in results} == said and sorted(said) == sorted(ids)


def _until_nothing_runs(server, deadline_s: float = 10) -> None:
    deadline = time.monotonic() + deadline_s
    while server.metrics()["tandem_requests_running"] > 0:
        assert time.monotonic() < deadline, f"requests still running after {deadline_s} s"
        time.sleep(0.1)


def test_bad_requests_are_4xx_with_a_message_and_disturb_no_other_request(server):
    good = server.post("/generate", {"prompt": "steady", "is_async": True, **GREEDY}).json()["request_ids"]
    bad = [
        ({"prompt_ids": [1, 10**6]}, 400, "outside the vocabulary"),
        ({"prompt_ids": [-1]}, 400, "outside the vocabulary"),
        ({"prompt": "hi", "max_tokens": 500}, 400, "max_model_len"),
        ({"prompt": "hi", "n": 0}, 422, "n"),
        ({"prompt": "hi", "temperature": -1}, 422, "temperature"),
        ({"prompt": "hi", "top_p": 0}, 422, "top_p"),
        ({"prompt": "hi", "top_p": 1.5}, 422, "top_p"),
        ({"prompt": "hi", "top_k": 0}, 400, "top_k"),
        ({"prompt": "hi", "prompt_ids": [1]}, 422, "exactly one"),
        ({"prompt": ""}, 400, "empty"),
        ({"prompt": "hi", "bogus": 1}, 422, "bogus"),
    ]
    for body, status, word in bad:
        answer = server.post("/generate", body)
        assert answer.status_code == status, (body, answer.text)
        assert word in answer.text, (body, answer.text)
    assert server.post("/generate", []).status_code == 422
    assert server.post("/collect", {"request_ids": ["unknown"], "timeout_s": 0}).status_code == 404
    results = server.post("/collect", {"request_ids": good, "timeout_s": 60}).json()["results"]
    assert results[0]["finish_reason"] == "length" and len(results[0]["token_ids"]) == 6
    assert server.get("/health").json() == {"status": "ok"}


def test_readiness_and_prometheus_metrics_report_version_and_queue(server):
    ready = server.get("/ready").json()
    assert ready["ready"] and ready["policy_version"] == 0 and ready["num_running"] == 0 and ready["update_in_progress"] is False
    server.post("/generate", {"prompt": "m", **GREEDY})
    metrics = server.metrics()
    assert metrics['tandem_requests_total{finish_reason="length"}'] >= 1 and metrics["tandem_policy_version"] == 0
    assert metrics["tandem_generated_tokens_total"] >= 6


def test_sleep_holds_requests_until_wake(server):
    assert server.post("/sleep", {"level": 1}).json() == {"asleep": True}
    ids = server.post("/generate", {"prompt": "zz", "is_async": True, **GREEDY}).json()["request_ids"]
    held = server.post("/collect", {"request_ids": ids, "timeout_s": 1}).json()
    assert held["pending"] == ids and server.get("/ready").json()["asleep"]
    assert server.post("/wake", {}).json() == {"asleep": False}
    done = server.post("/collect", {"request_ids": ids, "timeout_s": 60}).json()
    assert done["pending"] == [] and len(done["results"][0]["token_ids"]) == 6


def test_seeded_n_samples_differ_and_repeat(server, backend):
    if backend == "hf":
        pytest.skip("hf seeds a whole batch together; per-sample seeds are the engine's contract")
    body = {"prompt": "abc", "n": 4, "seed": 11, "temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
    first = [r["token_ids"] for r in server.post("/generate", body).json()["results"]]
    again = [r["token_ids"] for r in server.post("/generate", body).json()["results"]]
    assert first == again and len({tuple(t) for t in first}) == 4
    one = server.post("/generate", {**body, "n": 1, "seed": 12}).json()["results"][0]["token_ids"]
    assert one == first[1]  # sample i of a seeded request draws with seed + i


def _batch_lines(server, items: list[dict]) -> list[dict]:
    answer = server.post("/generate_batch", {"items": items})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("application/x-ndjson"), answer.text
    return [json.loads(line) for line in answer.content.split(b"\n") if line]


def test_batch_answers_every_item_and_a_bad_item_fails_alone(server):
    items = [{"request_id": f"b{i}", "prompt": "batch", **GREEDY} for i in range(4)]
    items.append({"request_id": "bad", "prompt_ids": [1, 10**6], **GREEDY})
    lines = {r["request_id"]: r for r in _batch_lines(server, items)}
    assert set(lines) == {"b0", "b1", "b2", "b3", "bad"}
    assert lines["bad"]["status"] == 400 and "outside the vocabulary" in lines["bad"]["error"]
    assert len({tuple(lines[f"b{i}"]["token_ids"]) for i in range(4)}) == 1 and lines["b0"]["finish_reason"] == "length"
    schema_error = server.post("/generate_batch", {"items": [items[0], {**items[1], "top_p": 0}]})
    assert schema_error.status_code == 422 and '"items",1,"top_p"' in schema_error.text.replace(" ", "")


def test_batch_item_is_abortable_by_id_and_a_hang_up_aborts_the_batch(server):
    import threading

    long = {"prompt": "x", "max_tokens": 120, "ignore_eos": True}
    aborter = threading.Timer(0.5, lambda: server.post("/abort", {"request_ids": ["gone", "never-issued"]}))
    aborter.start()
    lines = {r["request_id"]: r for r in _batch_lines(server, [{"request_id": "gone", **long}, {"request_id": "kept", "prompt": "k", **GREEDY}])}
    aborter.join()
    assert lines["gone"]["finish_reason"] in ("abort", "length") and lines["kept"]["finish_reason"] == "length"
    with httpx.stream("POST", server.url + "/generate_batch", json={"items": [{"request_id": "hung", **long}]}, timeout=30):
        pass  # hangs up before any line
    _until_nothing_runs(server)
    assert server.post("/abort", {"request_ids": ["hung"]}).status_code == 404  # forgotten once aborted


def test_odd_input_is_refused_naming_what_is_wrong(server):
    """Each was answered but not refused as it should be: a batch giving one id twice dropped one of the two
    items from its answer (one line for two items; the first was aborted by the second); an id of a megabyte
    came back whole, in the 404's message; a NaN (Python's JSON reads it) made the 422 unwritable, so a 400
    'Out of range float values are not JSON compliant' named no field."""
    twice = server.post("/generate_batch", {"items": [{"request_id": "a", "prompt": "x", **GREEDY}, {"request_id": "a", "prompt": "y", **GREEDY}]})
    assert twice.status_code == 422 and "request_id 'a' is given to 2 items" in twice.text, twice.text
    for route in ("/collect", "/abort"):
        long = server.post(route, {"request_ids": ["x" * 1_000_000]})
        assert long.status_code == 422 and len(long.content) < 1000 and "at most 64 characters" in long.text, (route, long.text[:300])
    for field in ("temperature", "top_p", "min_p"):
        raw = httpx.post(server.url + "/generate", content=f'{{"prompt": "x", "{field}": NaN}}', headers={"content-type": "application/json"}, timeout=30)
        assert raw.status_code == 422 and raw.json()["detail"][0]["loc"] == ["body", field], raw.text
    for body in ('{"prompt": "x", "prompt_ids": [1], "chat_template_kwargs": {"t": NaN}}', json.dumps({"prompt": "x" * 100_000, "prompt_ids": [1]})):
        raw = httpx.post(server.url + "/generate", content=body, headers={"content-type": "application/json"}, timeout=30)
        assert raw.status_code == 422 and "exactly one" in raw.text and len(raw.content) < 1000, raw.text[:300]  # a whole-body error: the body is its input
