import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tandemrl.cli import main as tandem
from tandemrl.cli import plot as plot_cli
from tandemrl.logging.plot import moving_average, plot_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, num_steps: int = 60, keys: tuple[str, ...] | None = None) -> Path:
    """A synthetic metrics.jsonl with every metric the trainer logs (or only `keys`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for step in range(1, num_steps + 1):
            reward = 1 / (1 + math.exp(-(step - num_steps / 2) / 5)) + rng.normal(0, 0.1)
            row = {
                "reward": reward, "reward_std": 0.3, "rewards/format/mean": min(1.0, step / 20),
                "rewards/format/std": 0.1, "rewards/math_accuracy/mean": reward * 0.9,
                "completions/mean_length": 100 + step, "completions/min_length": 20,
                "completions/max_length": 256, "completions/clipped_ratio": 0.1,
                "kl": step * 1e-4, "entropy": 1 - step / 100, "clip_ratio": rng.uniform(0, 0.01),
                "grad_norm": 1.0, "learning_rate": 1e-6, "policy_version": step, "frac_reward_zero_std": 0.2,
                "step_time": 2.2, "time/generate": 1.2, "time/reward": 0.1, "time/train": 0.7, "time/sync": 0.1,
            }  # fmt: skip
            if keys is not None:
                row = {k: v for k, v in row.items() if k in keys}
            f.write(json.dumps({"step": step, **row}) + "\n")
    return run_dir


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 10_000


def test_plot_run_writes_a_png_dashboard(tmp_path):
    out = plot_run(write_run(tmp_path / "run"))
    assert out == tmp_path / "run" / "dashboard.png"
    assert_png(out)
    assert not list((tmp_path / "run").glob("*.tmp"))


def test_plot_run_with_only_some_metrics_still_draws(tmp_path):
    assert_png(plot_run(write_run(tmp_path / "run", num_steps=1, keys=("reward",)), tmp_path / "x.png"))


def test_plot_run_of_empty_or_missing_metrics_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match="tandem train"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no steps yet"):
        plot_run(tmp_path)


def test_moving_average_is_centred():
    np.testing.assert_allclose(moving_average(np.array([0.0, 2.0, 4.0, 6.0]), 3), [1.0, 2.0, 4.0, 5.0])
    np.testing.assert_allclose(moving_average(np.array([3.0, 1.0]), 1), [3.0, 1.0])


def test_cli_plot_follows_latest_symlink_and_prints_path(tmp_path, capsys):
    run = write_run(tmp_path / "runs" / "2025-01-01_000000")
    os.symlink(run.name, tmp_path / "runs" / "latest")
    assert plot_cli.main([str(tmp_path / "runs" / "latest")]) == 0
    assert capsys.readouterr().out.strip() == str(run.resolve() / "dashboard.png")
    assert plot_cli.main([str(tmp_path / "runs"), "--out", str(tmp_path / "d.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "d.png")
    assert_png(tmp_path / "d.png")


def test_cli_plot_of_missing_dir_exits_2_with_one_line(tmp_path, capsys):
    assert tandem.main(["plot", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tandem plot: error: run directory") and "nope" in err


def test_python_m_tandemrl_plot(tmp_path):
    run = write_run(tmp_path / "run", num_steps=5)
    result = subprocess.run(
        [sys.executable, "-m", "tandemrl", "plot", str(run)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(run.resolve() / "dashboard.png")
    assert_png(run / "dashboard.png")


def test_panels_are_chosen_from_what_moved(tmp_path):
    from tandemrl.logging.plot import chosen_panels
    from tandemrl.logging.metrics import read_metrics

    run = write_run(tmp_path / "run", keys=("reward", "rewards/format/mean", "completions/mean_length", "clip_ratio",
                                            "grad_norm", "learning_rate", "frac_reward_zero_std", "step_time"))  # fmt: skip
    rows = read_metrics(run)
    for row in rows:
        row["clip_ratio"] = 0.0  # flat, as in the default run
        row["frac_reward_zero_std"] = row["step"] / 60  # moves
    names = [name for name, _ in chosen_panels(rows)]
    assert names == ["reward", "completion length", "zero-std fraction", "step time"]  # no KL, flat clip ratio, lr, grad_norm
    rows[3]["grad_norm"] = 2.0
    assert "grad_norm" in [name for name, _ in chosen_panels(rows)]


def test_title_names_model_task_and_loss_and_the_total_reward_is_labelled(tmp_path):
    run = write_run(tmp_path / "run", keys=("reward", "reward_std", "step_time"))
    (run / "config.yaml").write_text("task: synthetic\nmodel: tandem:tiny\nloss_type: dapo\n")
    import tandemrl.logging.plot as plot

    seen = {}
    original = plot.Figure.suptitle

    def spy(self, text, **kw):
        seen["title"] = text
        return original(self, text, **kw)

    plot.Figure.suptitle = spy
    try:
        plot_run(run)
    finally:
        plot.Figure.suptitle = original
    assert seen["title"].startswith("tandem:tiny on synthetic, loss dapo (run): steps 1-60")
    assert "faint: raw value per step; solid: centred moving average over 6 steps" in seen["title"]
