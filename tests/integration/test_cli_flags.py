"""`tandem`'s flags as a user meets them, each behaviour through a real subprocess: no abbreviations,
one-line errors with a "did you mean", `--help` grouped for people, `--print_config`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml


def tandem(*args: str, cwd: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "tandemrl", *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no usage dump
    return lines[0]


def test_a_flag_prefix_is_an_error_with_did_you_mean_not_the_longer_flag():
    line = one_line_error(tandem("train", "--learning_rat", "1e-5"))
    assert line == "tandem train: error: unknown flag --learning_rat (did you mean --learning_rate?); see `tandem train --help`"


def test_lr_is_not_taken_as_lr_scheduler_type():
    line = one_line_error(tandem("train", "--lr", "1e-5"))
    assert "unknown flag --lr" in line and "lr_scheduler_type" not in line


def test_a_bad_value_is_one_line_naming_the_flag():
    assert "--learning_rate: invalid float value: 'fast'" in one_line_error(tandem("train", "--learning_rate", "fast"))
    assert "--num_generations must be >= 2" in one_line_error(tandem("train", "--num_generations", "1"))


def test_a_bad_choice_lists_the_choices_and_the_nearest():
    line = one_line_error(tandem("train", "--loss_type", "grp"))
    assert "'grp' is not one of grpo, dapo, dr_grpo, gspo, bnpo, cispo (did you mean grpo?)" in line


def test_an_unknown_command_suggests_the_nearest():
    assert "unknown command 'trian' (did you mean train?)" in one_line_error(tandem("trian"))


def test_an_unknown_yaml_setting_suggests_the_nearest(tmp_path):
    (tmp_path / "run.yaml").write_text("learning_rat: 0.1\n")
    line = one_line_error(tandem("train", "--config", str(tmp_path / "run.yaml")))
    assert "unknown setting(s) learning_rat (did you mean learning_rate?)" in line


@pytest.fixture(scope="module")
def train_help() -> str:
    result = tandem("train", "--help")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_help_groups_are_titled_for_people(train_help):
    for title in ("Task and model:", "Data:", "Generation:", "Rewards:", "Algorithm:", "Optimizer and training:", "Logging:"):
        assert f"\n{title}\n" in train_help
    assert "Config:" not in train_help  # no class names as help titles


def test_help_shows_no_empty_defaults(train_help):
    assert "(default: )" not in train_help and "(default: ())" not in train_help and "(default: None)" not in train_help
    assert "(default: {})" not in train_help


def test_help_shows_booleans_as_flag_and_no_flag(train_help):
    assert "--resume [true|false], --no-resume" in train_help and "--bf16 [true|false], --no-bf16" in train_help


def test_help_shows_choices_of_every_enumerated_flag(train_help):
    for choices in ("{grpo,dapo,dr_grpo,gspo,bnpo,cispo}", "{engine,hf}", "{colocate,server}", "{constant,linear,cosine}", "{drain,pause}"):
        assert choices in train_help


def test_help_says_where_a_task_recipe_overrides_a_default(train_help):
    text = " ".join(train_help.split())
    assert "Peak AdamW learning rate. (default: 1e-06) [task lookup: 0.002; task synthetic (the default): 0.001]" in text


def test_print_config_prints_the_resolved_config_and_runs_nothing(tmp_path):
    result = tandem("train", "--print_config", "--beta", "0.04", "--no-bf16", cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert (config["task"], config["model"], config["learning_rate"]) == ("synthetic", "tandem:tiny", 0.001)
    assert config["beta"] == 0.04 and config["bf16"] is False
    assert not (tmp_path / "runs").exists()


def test_rollout_flags_are_strict_too():
    assert "unknown flag --tensor_parallel (did you mean --tensor_parallel_size?)" in one_line_error(
        tandem("rollout", "--model", "m", "--tensor_parallel", "2")
    )


def test_help_group_descriptions_are_whole_sentences(train_help):
    text = " ".join(train_help.split())
    assert "beside the trainer's base or merged into a copy of its own (--lora_engine; train/lora.py). --lora_r" in text
    rollout_help = " ".join(tandem("rollout", "--help").stdout.split())
    assert "A model source (ignored when the trainer hands its model in colocate mode) plus the engine's settings. --gpu_memory_utilization" in rollout_help


def test_a_run_stopped_by_bad_input_before_writing_leaves_no_run_directory(tmp_path):
    """A run that stops before its first file (bad data here) leaves no empty runs/<date-time> (it left one, holding
    only its lock file); an --output_dir the user made stays."""
    (tmp_path / "d.jsonl").write_text('{"question": "hi"}\n')
    (tmp_path / "mine").mkdir()
    for output_dir in ([], ["--output_dir", "out"], ["--output_dir", "mine"]):
        result = tandem("train", "--model", "tandem:tiny", "--dataset", "d.jsonl", "--max_steps", "1", *output_dir, cwd=str(tmp_path))
        assert "no 'prompt' column" in one_line_error(result)
    assert not list((tmp_path / "runs").glob("*")) and not (tmp_path / "out").exists() and (tmp_path / "mine").is_dir()
