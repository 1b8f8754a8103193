"""`tandem train` against what can poison or stall a run, as real subprocesses: non-finite rewards,
hung rewards, Ctrl-C, bad input. Each ends in a clear line, never in NaN weights or a hang."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(__file__))  # importlib import mode: the sibling module by path
from test_train_cli import TINY, metrics, reward_file, tandem  # noqa: E402


def error_lines(result: subprocess.CompletedProcess) -> list[str]:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if "error" in line.lower()]


def all_finite(checkpoint: Path) -> bool:
    return all(t.isfinite().all() for t in load_file(checkpoint / "model.safetensors").values())


# one completion of every batch gets the poisonous value, the others an ordinary reward
POISON = "def reward(prompts, completions, **kw):\n    return [{value}] + [len(c) / 10 for c in completions[1:]]\n"


def test_an_infinite_reward_stops_the_run_naming_the_function(tmp_path):
    rewards = reward_file(tmp_path, POISON.format(value="float('inf')"))
    result = tandem("train", "--reward_funcs", rewards, "--output_dir", str(tmp_path / "run"), "--max_steps", "2", *TINY)
    assert result.returncode == 2
    (line,) = error_lines(result)
    assert "reward function 'reward' returned inf at position 0" in line and "--reward_nonfinite skip" in line
    assert not list((tmp_path / "run").glob("checkpoint-*"))


def test_with_skip_the_group_of_an_infinite_reward_is_dropped_and_counted(tmp_path):
    rewards = reward_file(tmp_path, POISON.format(value="float('nan')"))
    run = tmp_path / "run"
    result = tandem("train", "--reward_funcs", rewards, "--reward_nonfinite", "skip", "--output_dir", str(run), "--max_steps", "2", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = metrics(run)
    assert [m["rollout/nonfinite_reward_groups"] for m in rows] == [1.0, 1.0]
    assert all(m["rollout/failed_groups"] == 1.0 for m in rows)
    assert all_finite(run / "checkpoint-2")


def test_a_finite_reward_that_overflows_the_advantages_never_reaches_the_weights(tmp_path):
    """1e308 passes the reward check, and may make the advantages NaN: a step whose loss is not finite is
    skipped, never applied, and every checkpoint is finite."""
    rewards = reward_file(tmp_path, POISON.format(value="1e308"))
    run = tmp_path / "run"
    result = tandem("train", "--reward_funcs", rewards, "--output_dir", str(run), "--max_steps", "2", "--save_steps", "1", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert all(m.get("train/skipped_steps") == 1.0 or math.isfinite(m["loss"]) for m in metrics(run))  # NaN is logged as null
    assert all_finite(run / "checkpoint-1") and all_finite(run / "checkpoint-2")


HUNG = """import pathlib, time
def reward(prompts, completions, **kw):
    pathlib.Path({marker!r}).touch()
    time.sleep(3600)
"""


@pytest.fixture
def start_train():
    """Starts `tandem train` processes; kills whichever still runs when the test ends."""
    procs: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "tandemrl", "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        return procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the reward function was never called"
        time.sleep(0.1)


def test_a_hung_reward_times_out_its_groups_and_the_run_goes_on(tmp_path):
    rewards = reward_file(tmp_path, HUNG.format(marker=str(tmp_path / "called")))
    run = tmp_path / "run"
    started = time.monotonic()
    result = tandem("train", "--reward_funcs", rewards, "--reward_timeout_s", "1", "--output_dir", str(run), "--max_steps", "2", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - started < 120  # the abandoned calls hold neither the steps nor the exit
    assert [m["rollout/reward_timeouts"] for m in metrics(run)] == [1.0, 1.0]
    assert "reward function 'reward' did not return within 1 s" in result.stderr


def test_ctrl_c_ends_a_run_stuck_in_a_reward_and_the_heartbeat_names_the_phase(tmp_path, start_train):
    marker = tmp_path / "called"
    rewards = reward_file(tmp_path, HUNG.format(marker=str(marker)))
    proc = start_train("--reward_funcs", rewards, "--output_dir", str(tmp_path / "run"), "--max_steps", "2", "--heartbeat_s", "1", *TINY)
    wait_for(marker, proc)
    time.sleep(2.5)  # past the heartbeat: the stuck step gets its line
    proc.send_signal(signal.SIGINT)
    started = time.monotonic()
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130 and time.monotonic() - started < 15, stderr[-3000:]
    assert "in reward for" in stdout and "interrupted" in stderr
    assert "Traceback" not in stderr
    assert not list((tmp_path / "run").glob("checkpoint-*")) and not list((tmp_path / "run").glob(".tmp-*"))


STUBBORN = """import pathlib, time
async def reward(prompts, completions, **kw):  # blocks the event loop and swallows Ctrl-C
    pathlib.Path({marker!r}).touch()
    while True:
        try:
            time.sleep(3600)
        except BaseException:
            pass
"""


def test_a_reward_that_swallows_ctrl_c_still_ends_within_the_grace_and_a_second_ctrl_c_at_once(tmp_path, start_train):
    for signals in (1, 2):
        marker = tmp_path / f"called{signals}"
        rewards = reward_file(tmp_path, STUBBORN.format(marker=str(marker)))
        proc = start_train("--reward_funcs", rewards, "--output_dir", str(tmp_path / f"run{signals}"), "--max_steps", "2", *TINY)
        wait_for(marker, proc)
        started = time.monotonic()
        for _ in range(signals):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.2)
        stdout, stderr = proc.communicate(timeout=60)
        elapsed = time.monotonic() - started
        assert proc.returncode == 130 and "interrupted" in stderr, stderr[-3000:]
        assert elapsed < (15 if signals == 1 else 2), elapsed
