"""`tandem train` against what can poison or stall a run, as real subprocesses: non-finite rewards,
hung rewards, Ctrl-C, bad input. Each ends in a clear line, never in NaN weights or a hang."""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tandemrl.train.checkpoint import latest_checkpoint

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


# Groups are scored one call each, as each completes (issue 13): the first of every 4 calls (one group a
# step with TINY's 4 prompts) returns NaN for its first completion.
POISON_ONE_GROUP = (
    "calls = []\ndef reward(prompts, completions, **kw):\n    calls.append(1)\n"
    "    return [float('nan') if len(calls) % 4 == 1 else 0.0] + [len(c) / 10 for c in completions[1:]]\n"
)


def test_with_skip_the_group_of_an_infinite_reward_is_dropped_and_counted(tmp_path):
    rewards = reward_file(tmp_path, POISON_ONE_GROUP)
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


# +-3e38 is finite in float32, so the rewards pass and the advantages (--scale_rewards none) do too; the gradient overflows
OVERFLOW_GRADIENT = "def reward(prompts, completions, **kw):\n    return [3e38, -3e38] + [0.0] * (len(completions) - 2)\n"


def test_a_resumed_run_counts_on_the_streak_of_skipped_steps(tmp_path):
    """The streak --max_skipped_steps stops at was not in the checkpoint: a run resumed after skipped steps
    started it again at 0, so a run skipping every step went on as long as it was resumed often enough."""
    rewards = reward_file(tmp_path, OVERFLOW_GRADIENT)
    run = tmp_path / "run"
    flags = ["--reward_funcs", rewards, "--scale_rewards", "none", "--max_skipped_steps", "2", "--output_dir", str(run), *SMALL]
    first = tandem("train", *flags, "--max_steps", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "(1 in a row)" in first.stderr and metrics(run)[0]["train/skipped_steps"] == 1.0
    resumed = tandem("train", *flags, "--max_steps", "2", "--resume")
    assert resumed.returncode == 2, resumed.stderr[-3000:]
    (line,) = error_lines(resumed)
    assert "2 optimizer steps in a row had a non-finite loss or gradient norm" in line, line


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


HUNG_FIRST = """import pathlib, time
calls = []
def reward(prompts, completions, **kw):
    calls.append(1)
    if len(calls) == 1:
        pathlib.Path({marker!r}).touch()
        time.sleep(3600)
    return [len(c) / 10 for c in completions]
"""


def test_a_hung_reward_times_out_its_group_and_the_run_goes_on(tmp_path):
    rewards = reward_file(tmp_path, HUNG_FIRST.format(marker=str(tmp_path / "called")))
    run = tmp_path / "run"
    started = time.monotonic()
    result = tandem("train", "--reward_funcs", rewards, "--reward_timeout_s", "1", "--output_dir", str(run), "--max_steps", "2", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert time.monotonic() - started < 120  # the abandoned call holds neither the steps nor the exit
    assert [m["rollout/reward_timeouts"] for m in metrics(run)] == [1.0, 0.0]  # each group is scored by its own call
    assert "reward function 'reward' did not return within 1 s" in result.stderr


def test_a_run_whose_every_group_is_dropped_ends_with_one_line_not_exit_0(tmp_path):
    """Every reward call times out: the run trained nothing, and said nothing of it, exit 0 (issue 36)."""
    rewards = reward_file(tmp_path, HUNG.format(marker=str(tmp_path / "called")))
    result = tandem("train", "--reward_funcs", rewards, "--reward_timeout_s", "1", "--output_dir", str(tmp_path / "run"), "--max_steps", "2", *TINY)
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = error_lines(result)[-1:]
    assert line.startswith("tandem train: error: step 1: every group was dropped, nothing to train (4 reward calls timed out"), line


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
    assert f"no checkpoint yet in {tmp_path / 'run'}: run the same command with --output_dir" in stderr  # what to do next
    assert stderr.count("interrupted") == 1, stderr  # one line, the one saying what to do next
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


def _bad_input(case: str, tmp_path: Path, tiny_model_dir: str) -> list[str]:
    """The arguments of one kind of bad input; each must end in one line and exit 2, before training."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "hello"}\n' * 4)
    base = ["--model", tiny_model_dir, "--dataset", str(data), "--reward_funcs", "length", "--output_dir", str(tmp_path / "run"), "--max_steps", "1", *TINY]
    config = tmp_path / "run.yaml"
    match case:
        case "truncated_weights":
            broken = shutil.copytree(tiny_model_dir, tmp_path / "model")
            weights = broken / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
            return [*base, "--model", str(broken)]
        case "reward_syntax_error":
            return [*base, "--reward_funcs", reward_file(tmp_path, "def reward(prompts, completions, **kw):\n    return [\n")]
        case "reward_raises_on_import":
            return [*base, "--reward_funcs", reward_file(tmp_path, "import math\n\nSCALE = 1 / 0\n")]
        case "malformed_yaml" | "unsafe_yaml_tag" | "yaml_wrong_type":
            text = {"malformed_yaml": "learning_rate: [1\n", "unsafe_yaml_tag": "model: !!python/object/apply:os.system [echo]\n",
                    "yaml_wrong_type": "learning_rate: fast\n"}[case]
            config.write_text(text)
            return ["--config", str(config), *base]
        case "output_dir_is_a_file":
            (tmp_path / "file").write_text("x")
            return [*base, "--output_dir", str(tmp_path / "file")]
        case "zero_max_steps":
            return [*base, "--max_steps", "0"]
        case "negative_save_steps":
            return [*base, "--save_steps", "-1"]
        case "empty_prompt":
            data.write_text('{"prompt": "hello"}\n{"prompt": ""}\n')
            return base
        case "lone_surrogate":  # half a UTF-16 pair: the tokenizer raised TypeError, a traceback (issue 36)
            data.write_text('{"prompt": "hello"}\n{"prompt": "hi \\ud800"}\n')
            return base
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("truncated_weights", "truncated or corrupt"), ("reward_syntax_error", "myrewards.py:2: SyntaxError"),
        ("reward_raises_on_import", "myrewards.py:3: importing it raised ZeroDivisionError"), ("malformed_yaml", "is not plain YAML"),
        ("unsafe_yaml_tag", "is not plain YAML"), ("yaml_wrong_type", "setting learning_rate: 'fast' is not a number"),
        ("output_dir_is_a_file", "is a file"), ("zero_max_steps", "--max_steps must be >= 1"),
        ("negative_save_steps", "--save_steps must be 0 (only at the end), whole steps or a ratio"), ("empty_prompt", "prompt of row 1 of dataset"),
        ("lone_surrogate", "prompt holds a lone surrogate '\\ud800' at character 3"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, tiny_model_dir, case, expected):
    result = tandem("train", *_bad_input(case, tmp_path, tiny_model_dir))
    assert result.returncode == 2, result.stderr[-3000:]
    (line,) = error_lines(result)
    assert expected in line, line


def test_runs_started_together_get_their_own_directories_and_a_failed_run_leaves_latest_alone(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = [sys.executable, "-m", "tandemrl", "train", "--max_steps", "1", *TINY]
    procs = [subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    assert all(p.wait(300) == 0 for p in procs), [p.stderr.read()[-2000:] for p in procs]
    runs = sorted(p for p in (tmp_path / "runs").iterdir() if p.name != "latest")
    assert len(runs) == 2 and all(len(metrics(r)) == 1 for r in runs)
    latest = (tmp_path / "runs" / "latest").resolve()
    rewards = reward_file(tmp_path, "def reward(prompts, completions, **kw):\n    raise RuntimeError('broken')\n")
    failed = subprocess.run([*args, "--reward_funcs", rewards], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert failed.returncode == 2 and (tmp_path / "runs" / "latest").resolve() == latest
    again = tandem("train", "--output_dir", str(runs[0]), "--max_steps", "1", *TINY)
    assert again.returncode == 2 and "already holds a run; pass --resume" in again.stderr


@pytest.mark.slow  # ~15-30 s: four tandem processes
def test_a_directory_a_live_run_writes_is_refused_to_a_second_run_which_moves_none_of_its_files(tmp_path, start_train):
    """A second `tandem train --output_dir` of a run that had no checkpoint yet trained into the same
    directory (its metrics, checkpoints and config.yaml among the first run's), or moved the live run's
    files aside; it is one line now, exit 2, and the first run goes on."""
    run_dir = tmp_path / "run"
    first = start_train("--output_dir", str(run_dir), "--max_steps", "100000", "--save_steps", "0", *TINY)
    wait_for(run_dir / "metrics.jsonl", first)
    second = tandem("train", "--output_dir", str(run_dir), "--max_steps", "1", *TINY)
    assert second.returncode == 2 and f"--output_dir {run_dir} is in use by a tandem train still running" in second.stderr, second.stderr[-2000:]
    resumed = tandem("train", "--output_dir", str(run_dir), "--resume", "--max_steps", "1", *TINY)
    assert resumed.returncode == 2 and "is in use by a tandem train still running" in resumed.stderr, resumed.stderr[-2000:]
    assert first.poll() is None and not list(run_dir.glob("attempt-*")) and latest_checkpoint(run_dir) is None
    first.send_signal(signal.SIGINT)
    assert first.wait(60) == 130


SMALL = ["--num_prompts_per_step", "2", "--num_generations", "2", "--max_completion_length", "4"]


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    """A run of 2 steps with checkpoint-1 and checkpoint-2, made once; each test works on its own copy."""
    run = tmp_path_factory.mktemp("two") / "run"
    result = tandem("train", "--output_dir", str(run), "--max_steps", "2", "--save_steps", "1", "--save_total_limit", "0", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def test_resume_passes_over_a_truncated_trainer_state_to_the_older_checkpoint(tmp_path, two_checkpoints):
    """--resume with the newest trainer_state.pt cut short was a traceback (issue 36)."""
    run = shutil.copytree(two_checkpoints, tmp_path / "run")
    state = run / "checkpoint-2" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    result = tandem("train", "--output_dir", str(run), "--resume", "--max_steps", "3", *SMALL)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert "trainer state (trainer_state.pt) of checkpoint-2 (" in line and line.endswith("resuming from checkpoint-1, the newest that reads")
    assert f"resuming from {run / 'checkpoint-1'} (step 1" in result.stderr
    assert [m["step"] for m in metrics(run)] == [1, 2, 3] and all_finite(run / "checkpoint-3")  # step 2 trained again


def test_resume_with_flags_that_change_the_computation_is_refused_naming_each(tmp_path, two_checkpoints):
    """--resume took any flag given, so a run continued with another learning rate or batch shape than its
    checkpoint's without a word; such flags are refused in one line, old -> new, unless asked for."""
    run = shutil.copytree(two_checkpoints, tmp_path / "run")
    changed = ["--learning_rate", "0.002", "--num_generations", "4", "--reward_funcs", "format"]
    refused = tandem("train", "--output_dir", str(run), "--resume", "--max_steps", "3", *SMALL, *changed)
    assert refused.returncode == 2, refused.stderr[-3000:]
    (line,) = error_lines(refused)
    assert line.startswith("tandem train: error: --resume: --num_generations 2 -> 4, --reward_funcs [] -> [format], --learning_rate 0.001 -> 0.002 "
                           "since checkpoint-2 change what the run computes;"), line  # fmt: skip
    assert "add --resume_allow_changed_flags" in line and [m["step"] for m in metrics(run)] == [1, 2]
    allowed = tandem("train", "--output_dir", str(run), "--resume", "--max_steps", "3", *SMALL, *changed, "--resume_allow_changed_flags")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    (warning,) = [line for line in allowed.stderr.splitlines() if "WARNING tandemrl.cli.build" in line]
    assert warning.endswith("--resume_allow_changed_flags: checkpoint-2 continues with --num_generations 2 -> 4, "
                            "--reward_funcs [] -> [format], --learning_rate 0.001 -> 0.002"), warning  # fmt: skip
    assert [m["step"] for m in metrics(run)] == [1, 2, 3]
    assert "resume_allow_changed_flags: false" in (run / "config.yaml").read_text()  # asked for once, not for the next resume


def test_resume_may_change_the_length_logging_and_saving_with_an_info_line(tmp_path, two_checkpoints):
    run = shutil.copytree(two_checkpoints, tmp_path / "run")
    result = tandem("train", "--output_dir", str(run), "--resume", "--max_steps", "3", "--logging_steps", "1", "--save_steps", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "WARNING" not in result.stderr and [m["step"] for m in metrics(run)] == [1, 2, 3]
    assert "--resume: --max_steps 2 -> 3, --save_steps 1 -> 3, --logging_steps 10 -> 1 since checkpoint-2" in result.stderr


def test_resume_of_a_checkpoint_that_records_no_flags_warns_they_went_unchecked(tmp_path, two_checkpoints):
    """A checkpoint written before checkpoints kept the run's flags resumes, with a warning."""
    import torch

    run = shutil.copytree(two_checkpoints, tmp_path / "run")
    path = run / "checkpoint-2" / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    torch.save({k: v for k, v in state.items() if k != "flags"}, path)
    result = tandem("train", "--output_dir", str(run), "--resume", "--max_steps", "3", "--learning_rate", "0.002")
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert line.endswith("--resume: checkpoint-2 records no flags (written before tandem kept them there), so this run's flags could not be checked against it")
    assert [m["step"] for m in metrics(run)] == [1, 2, 3]


def test_a_plain_resume_continues_its_checkpoints_flags_after_a_changed_run_died_before_its_next(tmp_path, two_checkpoints):
    """--resume_allow_changed_flags rewrote config.yaml as the run started; when that run died before its next
    checkpoint, a plain --resume took config.yaml's new values, compared them with the checkpoint's old ones and
    was refused naming flags nobody typed. A resume now continues the flags of the checkpoint it resumes from, exactly."""
    from safetensors.torch import load_file

    run, reference = shutil.copytree(two_checkpoints, tmp_path / "run"), shutil.copytree(two_checkpoints, tmp_path / "reference")
    changed = ["--learning_rate", "0.002", "--num_generations", "4"]
    allowed = tandem("train", "--output_dir", str(run), "--resume", "--max_steps", "3", *changed, "--resume_allow_changed_flags")
    assert allowed.returncode == 0, allowed.stderr[-3000:]
    assert "learning_rate: 0.002" in (run / "config.yaml").read_text()
    shutil.rmtree(run / "checkpoint-3")  # the run with the new flags died before its next checkpoint
    refused = tandem("train", "--output_dir", str(run), "--resume", "--max_steps", "3", "--num_generations", "4")
    assert refused.returncode == 2, refused.stderr[-3000:]
    (line,) = error_lines(refused)
    assert line.startswith("tandem train: error: --resume: --num_generations 2 -> 4 since checkpoint-2 change what the run computes;"), line
    plain = tandem("train", "--output_dir", str(run), "--resume", "--max_steps", "3")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "WARNING" not in plain.stderr and "--resume: --max_steps 2 -> 3 since checkpoint-2" in plain.stderr
    assert "learning_rate: 0.001" in (run / "config.yaml").read_text()
    same = tandem("train", "--output_dir", str(reference), "--resume", "--max_steps", "3")  # a normal run resumed
    assert same.returncode == 0, same.stderr[-3000:]
    assert "WARNING" not in same.stderr and "--resume: --max_steps 2 -> 3 since checkpoint-2" in same.stderr
    a, b = load_file(run / "checkpoint-3" / "model.safetensors"), load_file(reference / "checkpoint-3" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    computed = ("step", "reward", "loss", "learning_rate", "completions/mean_length")
    assert [[m[k] for k in computed] for m in metrics(run)] == [[m[k] for k in computed] for m in metrics(reference)]
    assert [m["step"] for m in metrics(run)] == [1, 2, 3]


def _no_larger_files(limit: int):
    def apply() -> None:  # in the child: a write past `limit` bytes fails with EFBIG, as on a full disk
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_checkpoint_the_disk_refuses_is_one_line_and_the_previous_one_stays(tmp_path, two_checkpoints):
    """A checkpoint written past `ulimit -f` (safetensors' or torch.save's write fails, as on a full disk) was a
    traceback (issue 36). The model file (~380 kB) passes 500 kB and the trainer state (~800 kB) does not: torch.save's
    zip writer says only "unexpected pos", so the limit is found by looking (tests/unit/train: the OS error's text)."""
    from tandemrl.train.checkpoint import latest_checkpoint

    run = shutil.copytree(two_checkpoints, tmp_path / "run")
    before = {p.name: p.read_bytes() for p in (run / "checkpoint-2").iterdir()}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, "-m", "tandemrl", "train", "--output_dir", str(run), "--resume", "--max_steps", "3", *SMALL],
        capture_output=True, text=True, timeout=300, env=env, preexec_fn=_no_larger_files(500_000),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = error_lines(result)
    assert line.startswith(f"tandem train: error: cannot write checkpoint-3 in {run}: a file reached the file size limit of 500000 bytes"), line
    assert line.endswith(f"continue from checkpoint-2 with: tandem train --output_dir {run} --resume"), line
    assert latest_checkpoint(run) == run / "checkpoint-2" and not (run / "checkpoint-3").exists()
    assert not list(run.glob(".tmp-*")) and {p.name: p.read_bytes() for p in (run / "checkpoint-2").iterdir()} == before
