"""A TRL user's first hour, through real `tandem train` subprocesses: TRL's yaml as TRL's docs write it runs
unchanged, a run that failed before its first checkpoint restarts in place, and --resume never dead-ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TINY = ["--num_generations", "4", "--max_completion_length", "6"]


def tandem(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "tandemrl", *args], capture_output=True, text=True, timeout=timeout, env=env)


def steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def data_file(tmp_path: Path) -> str:
    rows = [{"prompt": [{"role": "user", "content": f"say {i}"}], "solution": str(i)} for i in range(8)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path / "data.jsonl")


def test_a_trl_grpo_config_yaml_as_trls_docs_write_it_runs_unchanged(tmp_path, tiny_model_dir):
    (tmp_path / "grpo.yaml").write_text(
        f"model_name_or_path: {tiny_model_dir}\ndataset_name: {data_file(tmp_path)}\nreward_funcs: [accuracy_reward]\n"
        f"output_dir: {tmp_path / 'run'}\nper_device_train_batch_size: 4\ngradient_accumulation_steps: 2\nnum_generations: 4\n"
        "learning_rate: 1.0e-6\nbf16: true\nreport_to: none\nuse_vllm: true\nmax_completion_length: 6\nmax_steps: 2\n"
        "logging_steps: 1\nsave_steps: 0.5\n"
    )
    result = tandem("train", "--config", str(tmp_path / "grpo.yaml"))
    assert result.returncode == 0, result.stderr
    assert steps(tmp_path / "run") == [1, 2] and (tmp_path / "run" / "checkpoint-1").is_dir()  # save_steps 0.5 of 2
    for line in ("use_vllm ignored: the engine is built in", "--num_prompts_per_step 2", "--reward_funcs math_accuracy"):
        assert line in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trl_names = {"num_tokens", "completions/mean_terminated_length", "completions/min_terminated_length", "completions/max_terminated_length",
                 "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/min",
                 "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max", "reward", "entropy"}  # fmt: skip
    assert all(trl_names <= row.keys() for row in rows)
    assert not {"reward/mean", "time/step", "train/entropy"} & rows[0].keys()  # one name per metric
    assert 0 < rows[0]["num_tokens"] < rows[1]["num_tokens"]  # TRL's: prompt + completion tokens so far
    for row in rows:  # the step split adds up to the step's time
        phases = sum(row[k] for k in ("time/generate", "time/reward", "time/train", "time/sync", "time/other"))
        assert abs(phases - row["step_time"]) < 1e-6 and min(row[k] for k in ("time/generate", "time/reward", "time/train")) >= 0


def test_a_run_that_failed_in_its_first_step_restarts_in_place(tmp_path, tiny_model_dir):
    data, run = data_file(tmp_path), tmp_path / "run"
    (tmp_path / "rewards.py").write_text("def bad(completions, **kw):\n    return [1 / 0]\n\ndef good(completions, **kw):\n    return [1.0] * len(completions)\n")
    common = ["--model", tiny_model_dir, "--dataset", data, "--output_dir", str(run), "--max_steps", "1", "--num_prompts_per_step", "2", *TINY]
    failed = tandem("train", *common, "--reward_funcs", f"{tmp_path / 'rewards.py'}:bad")
    assert failed.returncode != 0 and "ZeroDivisionError" in failed.stderr
    again = tandem("train", *common, "--reward_funcs", f"{tmp_path / 'rewards.py'}:good")
    assert again.returncode == 0, again.stderr
    assert "held a run that ended before its first checkpoint: its files are now in" in again.stderr
    aside = [p for p in run.iterdir() if p.name.startswith("attempt-")]
    assert len(aside) == 1 and (aside[0] / "config.yaml").exists() and steps(run) == [1]
    finished = tandem("train", "--output_dir", str(run), "--resume")
    assert finished.returncode == 0 and "already finished: checkpoint-1 is step 1 of --max_steps 1" in finished.stdout
    assert "done:" not in finished.stdout and steps(run) == [1]


def test_resume_of_a_directory_without_a_checkpoint_starts_afresh_with_a_notice(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")  # what a run that failed in step 1 leaves
    result = tandem("train", "--model", tiny_model_dir, "--dataset", data_file(tmp_path), "--reward_funcs", "length",
                    "--output_dir", str(run), "--resume", "--max_steps", "1", "--num_prompts_per_step", "2", *TINY)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--resume: no complete checkpoint, so starting afresh" in result.stderr and steps(run) == [1]


def test_trls_step_ratios_are_of_the_steps_the_epochs_decide(tmp_path, tiny_model_dir):
    """logging_steps/save_steps/eval_steps below 1 are a ratio of the run's steps (TRL's ceil), also when
    num_train_epochs decides them once the data is loaded: 1 epoch of 8 prompts at 2 a step is 4 steps, 0.5 -> 2
    (they were taken of --max_steps' default 150: 75, so nothing was logged, saved or evaluated at step 2)."""
    data, run = data_file(tmp_path), tmp_path / "run"
    (tmp_path / "grpo.yaml").write_text(
        f"model_name_or_path: {tiny_model_dir}\ndataset_name: {data}\nreward_funcs: [accuracy_reward]\noutput_dir: {run}\n"
        "per_device_train_batch_size: 8\nnum_generations: 4\nmax_completion_length: 6\nnum_train_epochs: 1\n"
        f"logging_steps: 0.5\nsave_steps: 0.5\nsave_total_limit: 0\neval_dataset: {data}\neval_steps: 0.5\n"
    )
    result = tandem("train", "--config", str(tmp_path / "grpo.yaml"))
    assert result.returncode == 0, result.stderr
    assert steps(run) == [1, 2, 3, 4]
    step_lines = [line.split(" |")[0] for line in result.stdout.splitlines() if line.startswith("step ") and " | reward " in line]
    assert step_lines == ["step 1/4", "step 2/4", "step 4/4"]  # every 2, and the first and last
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "eval_reward" in row] == [2, 4]
    assert "logging_steps 0.5 (TRL: a ratio of the run's 4 steps) -> 2" in result.stderr
