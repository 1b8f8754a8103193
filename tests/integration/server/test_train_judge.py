"""`tandem train --reward_model`: a generative judge scores every completion, in an in-process engine
or on a real `tandem rollout` server; a random tiny judge's unparsable replies are logged None rewards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from rollout_helpers import start_server

STEPS = ["--max_steps", "2", "--num_prompts_per_step", "2", "--num_generations", "4", "--max_completion_length", "6"]


def train(tmp_path, *extra: str) -> tuple[list[dict], str]:
    args = [sys.executable, "-m", "tandemrl", "train", "--output_dir", str(tmp_path / "run"), *STEPS, "--reward_model_max_tokens", "4", *extra]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()], result.stderr


def check(rows: list[dict], stderr: str) -> None:
    assert [r["policy_version"] for r in rows] == [1, 2]  # the synthetic reward still drives training
    assert all(r["rollout/failed_groups"] == 0 for r in rows)
    scored = [r["rewards/reward_model/mean"] for r in rows if "rewards/reward_model/mean" in r]
    assert all(0 <= s <= 1 for s in scored)
    assert len(scored) == len(rows) or "reward model reply has no score" in stderr


def test_judge_in_process(tmp_path, tiny_model_dir):
    check(*train(tmp_path, "--reward_model", tiny_model_dir))


def test_judge_on_a_rollout_server(tmp_path, tiny_model_dir):
    """Its queue (2) is smaller than a step's 8 completions: --reward_model_max_concurrency 2 sends them 2 at a time."""
    server = start_server(tiny_model_dir, "--max_model_len", "512", "--max_pending_requests", "2", backend="engine")
    try:
        rows, stderr = train(tmp_path, "--reward_model", tiny_model_dir, "--reward_model_url", server.url, "--reward_model_max_concurrency", "2")
        check(rows, stderr)
        assert "reward model failed" not in stderr and "busy" not in stderr
        generated = next(line for line in server.get("/metrics").text.splitlines() if line.startswith("tandem_generated_tokens_total"))
        assert float(generated.split()[1]) > 0  # the judge's replies came from the server
    finally:
        server.stop()


def test_a_judge_server_whose_queue_is_smaller_than_a_step_scores_every_completion(tiny_model_dir, tiny_tokenizer, caplog):
    """A `tandem rollout` judge taking 2 requests at once, 8 completions: at most 2 in flight, every one judged
    (the server finishes 8 requests, no reward model failure). On main all 8 went at once: the server answered
    503 to the whole batch, the client gave up after its retries and every reward was a logged None."""
    import asyncio
    import logging

    from tandemrl.generation.base import RemoteConfig
    from tandemrl.generation.remote import RemoteGenerator
    from tandemrl.rewards.base import RewardFunc, score
    from tandemrl.rewards.judge import JudgeConfig, build_judge

    server = start_server(tiny_model_dir, "--max_model_len", "512", "--max_pending_requests", "2")
    generator = RemoteGenerator(RemoteConfig(urls=(server.url,)))
    config = JudgeConfig(reward_model=tiny_model_dir, reward_model_url=server.url, reward_model_max_tokens=4, reward_model_max_concurrency=2)
    judge = build_judge(config, generator=generator, tokenizer=tiny_tokenizer)
    try:
        with caplog.at_level(logging.WARNING):
            asyncio.run(score([RewardFunc(name="reward_model", fn=judge)], None, ["p"] * 8, [f"c{i}" for i in range(8)], {}, timeout_s=60))
        finished = sum(v for k, v in server.metrics().items() if k.startswith("tandem_requests_total"))
    finally:
        asyncio.run(generator.close())
        server.stop()
    assert "reward model failed" not in caplog.text and "busy" not in caplog.text, caplog.text[-2000:]
    assert finished == 8


def test_the_judge_servers_requests_are_aborted_at_the_reward_deadline(tiny_model_dir, tiny_tokenizer):
    """Replies of 340 tokens (~1.4 s on a CPU) and a reward deadline of 0.3 s: the reward call ends with the
    deadline, and its 4 requests end on the server as aborted, not left running to their end. A first call
    (1 token) warms the client up: a cold one spent the deadline on its readiness check and chat template
    (0.65 s on a busy machine), so no request reached the server and none was aborted."""
    import asyncio
    import time

    import pytest

    from tandemrl.generation.base import RemoteConfig
    from tandemrl.generation.remote import RemoteGenerator
    from tandemrl.rewards.base import RewardFunc, RewardTimeoutError, score
    from tandemrl.rewards.judge import JudgeConfig, build_judge

    server = start_server(tiny_model_dir, "--max_model_len", "512")
    generator = RemoteGenerator(RemoteConfig(urls=(server.url,)))
    judges = [build_judge(JudgeConfig(reward_model=tiny_model_dir, reward_model_max_tokens=n), generator=generator, tokenizer=tiny_tokenizer) for n in (1, 340)]
    try:
        asyncio.run(score([RewardFunc(name="reward_model", fn=judges[0])], None, ["p"] * 4, ["c"] * 4, {}, timeout_s=60))
        with pytest.raises(RewardTimeoutError):
            asyncio.run(score([RewardFunc(name="reward_model", fn=judges[1])], None, ["p"] * 4, ["c"] * 4, {}, timeout_s=0.3))
        deadline = time.monotonic() + 5
        while (metrics := server.metrics())["tandem_requests_running"] and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        asyncio.run(generator.close())
        server.stop()
    assert metrics['tandem_requests_total{finish_reason="abort"}'] == 4 and metrics["tandem_requests_running"] == 0
