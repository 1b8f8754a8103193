"""`torchrun --nproc_per_node 2 -m tandemrl train` (gloo) when one rank fails: killed (SIGKILL) or stopped
(SIGSTOP, a hang no reward deadline covers) mid-run. The run ends within a stated time, no rank left
behind, with one line from rank 0 saying how to continue, and --resume's checkpoint loads."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # importlib import mode: the sibling module by path
from test_train_cli import reward_file  # noqa: E402
from test_train_torchrun import TINY  # noqa: E402

# Each rank writes its pid; rank 1 sends itself `sig` in its third reward call (step 2 of 3: it scores two
# groups a step), so checkpoint-1 is the newest complete one.
FAULT = """import os, pathlib, signal
calls = []
pathlib.Path({pids!r}, os.environ["RANK"]).write_text(str(os.getpid()))
def reward(prompts, completions, **kw):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 3:
        os.kill(os.getpid(), signal.{sig})
    return [len(c) / 10 for c in completions]
"""


def torchrun_with_a_fault(tmp_path: Path, sig: str, *flags: str) -> tuple[subprocess.CompletedProcess, float, list[int]]:
    """The result, its seconds and the ranks' pids; a rank still alive after torchrun exits is killed (and fails the test)."""
    pids = tmp_path / "pids"
    pids.mkdir()
    rewards = reward_file(tmp_path, FAULT.format(pids=str(pids), sig=sig))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "tandemrl", "train"]
    args = ["--output_dir", str(tmp_path / "run"), "--max_steps", "3", "--save_steps", "1", "--reward_funcs", rewards, *TINY, *flags]
    started = time.monotonic()
    try:
        result = subprocess.run([*torchrun, *args], capture_output=True, text=True, timeout=120, env=env)
    finally:
        ranks = [int(p.read_text()) for p in pids.iterdir()]
        left = [pid for pid in ranks if alive(pid)]
        for pid in left:
            os.kill(pid, 9)
    assert not left, f"ranks left running: {left}"
    return result, time.monotonic() - started, ranks


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def rank_lines(result: subprocess.CompletedProcess) -> list[str]:
    """tandem's own lines (torchrun's report follows them); never a rank's traceback."""
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr, result.stderr[-3000:]
    return [line for line in result.stderr.splitlines() if line.startswith("tandem train:")]


def assert_resumable_from_checkpoint_1(run_dir: Path) -> None:
    from tandemrl.train.checkpoint import resumable_checkpoint

    checkpoint, state = resumable_checkpoint(run_dir)
    assert checkpoint.name == "checkpoint-1" and state["step"] == 1
    assert sorted(p.name for p in (checkpoint / "optimizer").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.slow
def test_a_rank_killed_mid_run_ends_the_run_with_one_line_saying_how_to_continue(tmp_path):
    result, seconds, _ = torchrun_with_a_fault(tmp_path, "SIGKILL")
    assert result.returncode != 0 and seconds < 90, result.stderr[-3000:]
    (line,) = rank_lines(result)
    assert line.endswith(f"continue from checkpoint-1 with: torchrun --nproc_per_node 2 -m tandemrl train --output_dir {tmp_path / 'run'} --resume"), line
    assert "rank: 1" in result.stderr and "SIGKILL" in result.stderr  # torchrun's report names the rank
    assert_resumable_from_checkpoint_1(tmp_path / "run")


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_past_ddp_timeout_with_one_line(tmp_path):
    """SIGSTOP: the process lives, its sockets stay open, no connection error ever comes; every collective
    waited gloo's 30 minutes (--ddp_timeout, TRL's key, was ignored)."""
    result, seconds, _ = torchrun_with_a_fault(tmp_path, "SIGSTOP", "--ddp_timeout", "3")
    assert result.returncode != 0 and seconds < 90, result.stderr[-3000:]
    (line,) = rank_lines(result)
    assert line.startswith("tandem train: error: rank 0 lost the other ranks: Timed out waiting 3000ms"), line
    assert "stopped answering for --ddp_timeout 3 s" in line and line.endswith(f"--output_dir {tmp_path / 'run'} --resume"), line
    assert_resumable_from_checkpoint_1(tmp_path / "run")
