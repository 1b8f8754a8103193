"""The calculator tool task end to end: `tandem train` plays multi-turn rollouts with a real tool, in
colocate mode and through a real `tandem rollout` process. A random tiny policy never writes a
<tool_call> by chance, so a parser plugin (itself a feature under test) reads a call in every turn that
ends with <|im_end|> (about one in three of these 128-token turns; the seeded run is deterministic)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from rollout_helpers import start_server

PARSER = '''
from tandemrl.rollout.chat import ToolCall

class EveryTurnCalls:
    def parse(self, text):
        return [ToolCall(name="calculator", arguments={"expression": "6 * 7"})]
'''
STEPS = ["--max_steps", "2", "--num_prompts_per_step", "2", "--num_generations", "4", "--max_completion_length", "128",
         "--no-drop_zero_variance_groups"]


@pytest.fixture(scope="module")
def long_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny policy with room for the tool schemas in its prompts (its tokenizer spends a token a byte)."""
    from tandemrl.tasks.tiny import save_tiny

    return save_tiny(str(tmp_path_factory.mktemp("tiny-long")), max_position_embeddings=2048)


def train(tmp_path, model_dir: str, *extra: str) -> list[dict]:
    (tmp_path / "parser.py").write_text(PARSER)
    args = [
        sys.executable, "-m", "tandemrl", "train", "--task", "calculator", "--model", model_dir, "--output_dir", str(tmp_path / "run"),
        "--tool_call_parser", f"{tmp_path / 'parser.py'}:EveryTurnCalls", "--max_turns", "2", "--max_prompt_length", "900",
        "--max_total_tokens", "1000", *STEPS, *extra,
    ]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]


def check(rows: list[dict]) -> None:
    assert [r["policy_version"] for r in rows] == [1, 2]
    assert all(r["rollout/failed_groups"] == 0 and 1 <= r["turns/mean"] <= 2 for r in rows)
    assert all(r["tools/failure_frequency"] == 0 for r in rows)  # every call reached the calculator
    assert sum(r["tools/call_frequency"] for r in rows) > 0  # a turn that ends by length calls nothing
    assert sum(r["rewards/tool_use/mean"] for r in rows) > 0  # rewards saw the tool answers


def test_tool_task_trains_in_colocate_mode(tmp_path, long_tiny_dir):
    check(train(tmp_path, long_tiny_dir))


def test_tool_task_trains_through_a_rollout_server(tmp_path, long_tiny_dir):
    server = start_server(long_tiny_dir, "--max_model_len", "1024", backend="engine")
    try:
        rows = train(tmp_path, long_tiny_dir, "--rollout_mode", "server", "--rollout_server_urls", server.url,
                     "--weight_sync_port", "0", "--weight_sync_timeout_s", "60")
        check(rows)
        assert server.get("/ready").json()["policy_version"] == 2
    finally:
        server.stop()


def test_lookup_task_calls_its_stateful_tool_from_the_recipe_alone(tmp_path):
    """`--task lookup` with its recipe (tiny model, mark parser, stop marks): turns end at a mark, the tool
    answers with the row's hidden code, and a rollout that called it shows up in the rewards. (Learning
    it takes minutes: README's recipe command; this checks the mechanics.)"""
    args = [sys.executable, "-m", "tandemrl", "train", "--task", "lookup", "--output_dir", str(tmp_path / "run"), "--max_steps", "1",
            "--num_prompts_per_step", "4", "--num_generations", "8"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tools/failure_frequency"] == 0 and 1 <= r["turns/mean"] <= 2 for r in rows)
    assert sum(r["tools/call_frequency"] for r in rows) > 0 and sum(r["rewards/tool_use/mean"] for r in rows) > 0
    logged = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert logged and all(set(r) >= {"secret_reward", "digit_reward", "tool_use"} for r in logged)
