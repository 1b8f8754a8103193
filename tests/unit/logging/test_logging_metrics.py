import json
import math
import sys
import types

import pytest

from tandemrl.logging.metrics import TRL_ALIASES, MetricsLogger, canonical, read_metrics, with_aliases


def test_metrics_round_trip_keeps_ints_and_nan(tmp_path):
    with MetricsLogger(tmp_path, report_to=[], config={}) as logger:
        logger.log(1, {"reward": 0.25, "policy_version": 1, "kl": float("nan")})
        logger.log(2, {"reward": 0.5, "policy_version": 2, "kl": 0.01})
    rows = read_metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2]
    assert rows[1] == {"step": 2, "reward": 0.5, "policy_version": 2, "kl": 0.01}  # one name per metric
    assert isinstance(rows[0]["policy_version"], int) and math.isnan(rows[0]["kl"])
    first_line = (tmp_path / "metrics.jsonl").read_text().splitlines()[0]
    assert json.loads(first_line)["kl"] is None  # strict JSON: jq and pandas read it


def test_each_metrics_line_is_on_disk_before_close(tmp_path):
    logger = MetricsLogger(tmp_path, report_to=["none"], config={})
    logger.log(1, {"time/train": 1.0})
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "time/train": 1.0}\n'
    logger.log(2, {"time/train": 0.0})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    logger.close()


def test_resumed_run_appends_and_repeated_step_keeps_last_row(tmp_path):
    with MetricsLogger(tmp_path, report_to=[], config={}) as logger:
        logger.log(1, {"reward": 0.1})
        logger.log(2, {"reward": 0.2})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # killed mid-write
    with MetricsLogger(tmp_path, report_to=[], config={}) as logger:
        logger.log(2, {"reward": 0.7})
        logger.log(3, {"reward": 0.3})
    assert [(row["step"], row["reward"]) for row in read_metrics(tmp_path)] == [(1, 0.1), (2, 0.7), (3, 0.3)]


def test_tensorboard_scalars_and_completions_are_readable(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path, report_to=["tensorboard"], config={"lr": 1e-6}) as logger:
        for step in range(1, 4):
            logger.log(step, {"reward": step / 10, "rewards/format/mean": 1.0})
        logger.log_completions(3, [{"prompt": "1+1", "completion": "2 | two", "reward": 1.0}])
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert {"reward", "rewards/format/mean"} <= set(events.Tags()["scalars"])
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    (text,) = events.Tensors("completions/text_summary")
    assert text.step == 3 and b"2 \\| two" in text.tensor_proto.string_val[0]


def test_completions_are_flattened_into_jsonl(tmp_path):
    with MetricsLogger(tmp_path, report_to=[], config={}) as logger:
        row = {"prompt": "p", "completion": "c\nd", "reward": 1.0, "rewards": {"format": 1.0, "math_accuracy": None}}
        logger.log_completions(5, [row])
        logger.log_completions(6, [])
    lines = (tmp_path / "completions.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 5, "prompt": "p", "completion": "c\nd", "reward": 1.0, "rewards/format": 1.0, "rewards/math_accuracy": None}
    ]


def test_unknown_sink_names_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown sink.*mlflow.*tensorboard, wandb, trackio, none"):
        MetricsLogger(tmp_path, report_to=["tensorboard", "mlflow"], config={})


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_missing_optional_package_says_how_to_install(tmp_path, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # makes `import name` raise ImportError
    with pytest.raises(ValueError) as error:
        MetricsLogger(tmp_path, report_to=[name], config={})
    assert str(error.value) == f"--report_to {name} needs the {name} package: pip install {name}"


def test_wandb_sink_gets_config_metrics_table_and_finish(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    fake = types.SimpleNamespace(init=init, Table=lambda columns, data: ("table", columns, data))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "p")
    with MetricsLogger(tmp_path, report_to=["wandb"], config={"beta": 0.0}, run_name="r") as logger:
        logger.log(1, {"reward": 0.5, "policy_version": 1})
        logger.log_completions(1, [{"prompt": "a", "completion": "b", "reward": 0.5}])
    assert calls[0] == ("init", {"project": "p", "name": "r", "config": {"beta": 0.0}, "dir": str(tmp_path)})
    assert calls[1] == ("log", 1, {"reward": 0.5, "reward/mean": 0.5, "policy_version": 1.0, "train/policy_version": 1.0})
    assert calls[2] == ("log", 1, {"completions": ("table", ["prompt", "completion", "reward"], [["a", "b", 0.5]])})
    assert calls[3] == ("finish",)


def test_read_metrics_of_missing_dir_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="tandem train"):
        read_metrics(tmp_path / "nope")


def test_one_name_per_metric_trls_where_it_has_one_and_area_aliases_for_sinks(tmp_path):
    assert canonical({"reward/mean": 0.5, "train/kl": 0.1, "time/train": 1.0}) == {"reward": 0.5, "kl": 0.1, "time/train": 1.0}
    assert with_aliases({"reward": 0.5, "time/generate": 1.0}) == {"reward": 0.5, "reward/mean": 0.5, "time/generate": 1.0}
    assert with_aliases({"train/kl": 0.1}) == {"kl": 0.1, "train/kl": 0.1}  # either name in, both out
    assert all("/" in name and "/" not in alias for name, alias in TRL_ALIASES.items())
    with MetricsLogger(tmp_path, report_to=[], config={}) as logger:
        logger.log(1, {"reward/mean": 0.5, "step_time": 1.0, "time/train": 0.5})
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {"step": 1, "reward": 0.5, "step_time": 1.0, "time/train": 0.5}


def test_a_resumed_run_drops_the_steps_it_replays_from_both_files(tmp_path):
    with MetricsLogger(tmp_path, report_to=[], config={}) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"reward": step / 10})
            logger.log_completions(step, [{"prompt": "p", "completion": "c", "reward": 0.0}])
    with MetricsLogger(tmp_path, report_to=[], config={}, first_step=2) as logger:  # resumed from checkpoint-2
        logger.log(3, {"reward": 0.9})
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3] and read_metrics(tmp_path)[-1]["reward"] == 0.9
    assert [json.loads(line)["step"] for line in (tmp_path / "completions.jsonl").read_text().splitlines()] == [1, 2]


def test_a_chat_prompt_is_stored_as_its_messages_and_shown_to_sinks_as_text(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    seen = []
    with MetricsLogger(tmp_path, report_to=[], config={}) as logger:
        logger.sinks.append(types.SimpleNamespace(log=lambda *a: None, log_completions=lambda step, rows: seen.extend(rows), close=lambda: None))
        logger.log_completions(1, [{"prompt": messages, "completion": "4", "reward": 1.0}])
    assert json.loads((tmp_path / "completions.jsonl").read_text())["prompt"] == messages
    assert seen[0]["prompt"] == "system: be brief\nuser: 2+2?"
