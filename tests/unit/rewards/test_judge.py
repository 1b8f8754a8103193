"""The generative reward model: template, score parsing, failures as logged None, plugins, a tiny model."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tandemrl.rewards.judge import GenerativeJudge, JudgeConfig, build_judge, parse_score
from tandemrl.types import Completion, SamplingParams


class Replies:
    """A generator that answers every prompt with `text` (or raises), recording the prompts it saw."""

    def __init__(self, tokenizer, text: str | None):
        self.tokenizer, self.text, self.prompts = tokenizer, text, []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        self.prompts.append(self.tokenizer.decode(prompt_ids))
        if self.text is None:
            raise ConnectionError("judge server is down")
        ids = self.tokenizer(self.text, add_special_tokens=False)["input_ids"]
        return Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", policy_versions=[0] * len(ids))


def test_parse_score_scales_the_last_score():
    assert parse_score("ok. Score: 7") == 0.7
    assert parse_score("score=3, no, Score: 12") == 1.0
    assert parse_score("I cannot rate this") is None


def test_judge_sees_the_whole_conversation_and_scores_it(tiny_tokenizer):
    generator = Replies(tiny_tokenizer, "Score: 8")
    judge = GenerativeJudge(generator=generator, tokenizer=tiny_tokenizer)
    conversation = [{"role": "assistant", "content": "<tool_call>x</tool_call>"}, {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]
    scores = asyncio.run(judge(["what is 6*7?", "hi"], [conversation, "hello"]))
    assert scores == [0.8, 0.8]
    assert "what is 6*7?" in generator.prompts[0] and "tool: 42" in generator.prompts[0]


@pytest.mark.parametrize("reply, reason", [(None, "ConnectionError"), ("no number here", "has no score")])
def test_judge_failures_are_a_logged_none(tiny_tokenizer, caplog, reply, reason):
    judge = GenerativeJudge(generator=Replies(tiny_tokenizer, reply), tokenizer=tiny_tokenizer)
    with caplog.at_level(logging.WARNING, logger="tandemrl.rewards.judge"):
        assert asyncio.run(judge(["p"], ["c"])) == [None]
    assert reason in caplog.text


def test_plugin_class_is_built_with_the_generator_and_tokenizer(tmp_path, tiny_tokenizer):
    (tmp_path / "myjudge.py").write_text(
        "from tandemrl.rewards.judge import GenerativeJudge\n"
        "class Strict(GenerativeJudge):\n"
        "    def parse(self, reply):\n"
        "        return 1.0 if 'yes' in reply else 0.0\n"
    )
    config = JudgeConfig(reward_model_plugin=f"{tmp_path / 'myjudge.py'}:Strict")
    judge = build_judge(config, generator=Replies(tiny_tokenizer, "yes"), tokenizer=tiny_tokenizer)
    assert asyncio.run(judge(["p"], ["c"])) == [1.0]


def test_the_judge_has_at_most_max_concurrency_requests_in_flight(tiny_tokenizer):
    """A plugin's too: the bound is the generator's that build_judge hands over."""

    class Peak(Replies):
        in_flight = peak = 0

        async def generate(self, prompt_ids, params):
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            await asyncio.sleep(0.01)
            self.in_flight -= 1
            return await super().generate(prompt_ids, params)

    generator = Peak(tiny_tokenizer, "Score: 5")
    judge = build_judge(JudgeConfig(reward_model="m", reward_model_max_concurrency=3), generator=generator, tokenizer=tiny_tokenizer)
    assert asyncio.run(judge(["p"] * 10, ["c"] * 10)) == [0.5] * 10
    assert generator.peak == 3
    with pytest.raises(ValueError, match="--reward_model_max_concurrency must be >= 1, got 0"):
        JudgeConfig(reward_model_max_concurrency=0)


def test_template_file_needs_both_fields(tmp_path):
    (tmp_path / "t.txt").write_text("rate {completion}")
    with pytest.raises(ValueError, match="write {prompt} and {completion}"):
        build_judge(JudgeConfig(reward_model="m", reward_model_template=str(tmp_path / "t.txt")), generator=None, tokenizer=None)


def test_a_tiny_model_judges_in_process_without_crashing(tiny_model_dir, tiny_tokenizer):
    """A random tiny judge rarely writes a score: every value is a score in [0, 1] or a logged None."""
    from tandemrl.generation.base import EngineConfig
    from tandemrl.generation.factory import build_generator

    generator = build_generator(EngineConfig(model=tiny_model_dir, device="cpu", max_model_len=256), tokenizer=tiny_tokenizer)
    try:
        judge = build_judge(JudgeConfig(reward_model=tiny_model_dir, reward_model_max_tokens=8), generator=generator, tokenizer=tiny_tokenizer)
        scores = asyncio.run(judge(["2+2?", [{"role": "user", "content": "hi"}]], ["4", [{"role": "assistant", "content": "hello"}]]))
    finally:
        asyncio.run(generator.close())
    assert len(scores) == 2 and all(s is None or 0 <= s <= 1 for s in scores)


class JudgeServer:
    """A real HTTP server speaking `tandem rollout`'s /generate_batch, answering each item by the word in its
    completion (`good`: "Score: 7", `words`: no number, `ids`: token ids no tokenizer decodes, `fails`: the item's
    own 500), or the whole request as `mode` says: `500`, `close` (the connection cut), `garbage` (not JSON),
    `hang` (no answer while /health answers)."""

    def __init__(self, tokenizer, mode: str = "items"):
        import http.server
        import json
        import threading

        self.mode, self.released = mode, threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200, b"{}")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path != "/generate_batch":
                    return self._send(200, b"{}")
                if server.mode == "close":
                    self.close_connection = True
                    return self.connection.shutdown(2)
                if server.mode == "hang":
                    server.released.wait(30)
                    return self._send(503, b"{}")
                if server.mode in ("500", "garbage"):
                    return self._send(500 if server.mode == "500" else 200, b'{"detail": "judge broke"}' if server.mode == "500" else b"<html>\n")
                lines = [json.dumps(self._answer(item, tokenizer.decode(item["prompt_ids"]))).encode() + b"\n" for item in body["items"]]
                self._send(200, b"".join(lines))

            def _answer(self, item, prompt):
                word = next(w for w in ("good", "words", "ids", "fails") if f"[Response]\n{w}" in prompt)
                if word == "fails":
                    return {"request_id": item["request_id"], "status": 500, "error": "this one broke"}
                ids = [-1, 2**40] if word == "ids" else tokenizer("Score: 7" if word == "good" else "no number", add_special_tokens=False)["input_ids"]
                return {"request_id": item["request_id"], "token_ids": ids, "logprobs": [0.0] * len(ids), "finish_reason": "stop", "policy_versions": [0] * len(ids)}

            def _send(self, status, data):
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def stop(self):
        self.released.set()
        self.http.shutdown()
        self.http.server_close()


def asyncio_errors(caplog) -> list[str]:
    """What asyncio logged (a task's error nobody retrieved, a task destroyed pending), once the tasks are collected."""
    import gc

    gc.collect()
    return [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def judge_over(url: str, tokenizer, **remote) -> GenerativeJudge:
    from tandemrl.generation.base import RemoteConfig
    from tandemrl.generation.remote import RemoteGenerator

    return GenerativeJudge(generator=RemoteGenerator(RemoteConfig(urls=(url,), **remote)), tokenizer=tokenizer)


def test_a_judge_server_answering_garbage_per_item_gives_those_items_none_and_scores_the_others(tiny_tokenizer, caplog):
    """Through the real client over HTTP: a reply without a number, token ids no tokenizer decodes and an
    item's own 500 are each that completion's logged None; the good ones beside them are scored."""
    from tandemrl.rewards.base import RewardFunc, score

    server = JudgeServer(tiny_tokenizer)
    judge = judge_over(server.url, tiny_tokenizer)
    try:
        with caplog.at_level(logging.WARNING, logger="tandemrl.rewards.judge"):
            totals, _ = asyncio.run(score([RewardFunc(name="reward_model", fn=judge)], None, ["p"] * 4, ["good", "words", "ids", "fails"], {}, timeout_s=20))
    finally:
        asyncio.run(judge.generator.close())
        server.stop()
    assert totals == [0.7, None, None, None]
    assert "has no score" in caplog.text and "OverflowError" in caplog.text and "this one broke" in caplog.text


@pytest.mark.parametrize("mode", ["500", "close", "garbage"])
def test_a_judge_server_failing_the_whole_request_gives_logged_nones_within_seconds(tiny_tokenizer, caplog, mode):
    """...and every error is retrieved: on main a garbled answer's JSONDecodeError stayed in the client's task
    (asyncio's "Task exception was never retrieved" traceback in the run's log)."""
    import time

    server = JudgeServer(tiny_tokenizer, mode)
    judge = judge_over(server.url, tiny_tokenizer, max_retries=1)
    start = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="tandemrl.rewards.judge"):
            assert asyncio.run(judge(["p", "q"], ["good", "good"])) == [None, None]
    finally:
        asyncio.run(judge.generator.close())
        server.stop()
    assert time.monotonic() - start < 10
    assert "reward model failed" in caplog.text
    assert asyncio_errors(caplog) == []


def test_a_hung_judge_is_cut_at_the_reward_deadline_not_waited_on(tiny_tokenizer, caplog):
    """A judge server that takes the request and never answers (its /health still does) is given up at
    --reward_timeout_s: the group's call ends with the documented RewardTimeoutError (its groups are dropped)."""
    import time

    from tandemrl.rewards.base import RewardFunc, RewardTimeoutError, score

    server = JudgeServer(tiny_tokenizer, "hang")
    judge = judge_over(server.url, tiny_tokenizer)
    start = time.monotonic()
    try:
        with pytest.raises(RewardTimeoutError, match="'reward_model' did not return within 1 s"):
            asyncio.run(score([RewardFunc(name="reward_model", fn=judge)], None, ["p"], ["good"], {}, timeout_s=1.0))
    finally:
        asyncio.run(judge.generator.close())
        server.stop()
    assert time.monotonic() - start < 5
    assert asyncio_errors(caplog) == []
