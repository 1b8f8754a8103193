"""`tandem train` against what can poison or stall a run, as real subprocesses: non-finite rewards,
hung rewards, Ctrl-C, bad input. Each ends in a clear line, never in NaN weights or a hang."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

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
