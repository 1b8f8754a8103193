"""`tandem train`'s inputs checked as a user meets them (real subprocesses): a missing model or data file
is one line before anything loads, an offline hub is detected in seconds, a failing reward function
is reported at the user's own line."""

from __future__ import annotations

import os
import subprocess
import sys
import time

TINY = ["--num_prompts_per_step", "2", "--num_generations", "2", "--max_completion_length", "4"]


def tandem(*args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "tandemrl", *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_no_model_names_the_built_in_one():
    assert "or --model tandem:tiny" in error_line(tandem("train", "--dataset", "data.jsonl"))


def test_a_directory_that_holds_no_model_is_one_line_saying_so(tmp_path):
    """An empty (or a run's) directory as --model was transformers' "Unrecognized model in ..." in tandem train
    and "You need to have sentencepiece or tiktoken installed" in tandem rollout."""
    (tmp_path / "empty").mkdir()
    for command in (["train"], ["rollout", "--port", "0"]):
        line = error_line(tandem(*command, "--model", str(tmp_path / "empty")))
        assert f"directory {str(tmp_path / 'empty')!r} holds no model (no config.json)" in line, line


def test_a_missing_data_file_is_reported_before_the_model_loads(tiny_model_dir):
    started = time.monotonic()
    line = error_line(tandem("train", "--model", tiny_model_dir, "--dataset", "missing.jsonl", "--reward_funcs", "length"))
    assert "dataset 'missing.jsonl' does not exist" in line
    assert time.monotonic() - started < 10


def test_an_unreachable_hub_is_offline_mode_in_seconds_with_what_to_do(tmp_path):
    env = {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    started = time.monotonic()
    result = tandem("train", "--task", "gsm8k", env=env)
    line = error_line(result)
    assert "not in the local Hugging Face cache and the hub is offline" in line and "Qwen/Qwen2.5-0.5B-Instruct" in line
    assert "(hf download Qwen/Qwen2.5-0.5B-Instruct)" in line  # huggingface_hub 1.x has no huggingface-cli
    assert "hub (http://127.0.0.1:9) is unreachable: offline mode" in result.stderr
    assert time.monotonic() - started < 15


def test_a_raising_reward_function_is_reported_at_the_users_line(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def picky(prompts, completions, **kw):\n    return [1 / 0 for _ in completions]\n")
    result = tandem("train", "--max_steps", "1", "--reward_funcs", "my_rewards.py:picky", "--output_dir", "run", *TINY, cwd=str(tmp_path))
    line = error_line(result)
    assert "reward function 'picky' raised ZeroDivisionError at my_rewards.py:2: division by zero" in line, line


def test_rollout_notices_an_unreachable_hub_in_seconds(tmp_path):
    env = {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    started = time.monotonic()
    result = tandem("rollout", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--port", "0", env=env)
    assert "not in the local Hugging Face cache and the hub is offline" in error_line(result)
    assert time.monotonic() - started < 15


def test_rollout_reports_a_busy_port_before_loading_the_model(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        started = time.monotonic()
        line = error_line(tandem("rollout", "--model", str(tmp_path / "not-loaded-yet"), "--port", str(port)))
    assert f"cannot bind 127.0.0.1:{port}" in line and time.monotonic() - started < 15
