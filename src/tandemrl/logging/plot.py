"""A run's dashboard: run_dir/metrics.jsonl -> one PNG (reward, lengths, KL, clip ratio, entropy, step time).

Uses matplotlib's Figure and Agg canvas directly, never pyplot, so no global backend is switched.
A metric not logged leaves its line out; noisy curves are drawn faint, with a moving average on top.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from tandemrl.logging.metrics import read_metrics

Rows = list[dict[str, float]]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Writes the dashboard PNG (default run_dir/dashboard.png) and returns its path."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no steps yet; plot again after the first step is logged")
    out = run_dir / "dashboard.png" if out is None else Path(out)
    fig = Figure(figsize=(16, 9), dpi=100, layout="constrained")
    axes = fig.subplots(2, 3).flat
    _reward_panel(next(axes), rows)
    _length_panel(next(axes), rows)
    _simple_panel(next(axes), rows, "KL to reference", ["kl"])
    _simple_panel(next(axes), rows, "clip ratio", _keys(rows, "clip_ratio"))
    _simple_panel(next(axes), rows, "entropy", ["entropy"])
    _time_panel(next(axes), rows)
    fig.suptitle(f"{run_dir.resolve().name}: steps {rows[0]['step']:g}-{rows[-1]['step']:g}")
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")  # then rename: a viewer refreshing the PNG never sees half of it
    os.replace(tmp, out)
    return out


def series(rows: Rows, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows that logged a finite `key`."""
    pairs = [(row["step"], row[key]) for row in rows if isinstance(row.get(key), int | float)]
    steps, values = (np.array(v, dtype=float) for v in zip(*pairs)) if pairs else (np.empty(0), np.empty(0))
    finite = np.isfinite(values)
    return steps[finite], values[finite]


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Centred mean over `window` points (fewer at the ends), so a trend is not drawn late.

    Example: [0, 2, 4, 6], 3 -> [1, 2, 4, 5]
    """
    half = window // 2
    sums = np.cumsum(np.insert(np.asarray(values, dtype=float), 0, 0.0))
    index = np.arange(len(values))
    starts = np.maximum(index - half, 0)
    ends = np.minimum(index + half + 1, len(values))
    return (sums[ends] - sums[starts]) / (ends - starts)


def smoothing_window(num_points: int) -> int:
    return int(np.clip(num_points // 10, 1, 50))


def _keys(rows: Rows, prefix: str, suffix: str = "") -> list[str]:
    """Metric names equal to `prefix`, or under `prefix/` and ending with `suffix`, in first-seen order."""
    names = dict.fromkeys(name for row in rows for name in row)
    return [n for n in names if n == prefix or (n.startswith(prefix + "/") and n.endswith(suffix))]


def _line(ax: Axes, rows: Rows, key: str, label: str | None = None, **style) -> bool:
    steps, values = series(rows, key)
    if not len(steps):
        return False
    window = smoothing_window(len(values))
    if window > 1:
        (faint,) = ax.plot(steps, values, alpha=0.25, linewidth=0.8, **style)
        style["color"] = faint.get_color()
    ax.plot(steps, moving_average(values, window), label=label or key, linewidth=1.6, **style)
    return True


def _finish(ax: Axes, title: str, drawn: bool) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if not drawn:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _band(ax: Axes, steps: np.ndarray, low: np.ndarray, high: np.ndarray, color: str, label: str) -> None:
    window = smoothing_window(len(steps))
    ax.fill_between(steps, moving_average(low, window), moving_average(high, window), color=color, alpha=0.15, label=label)


def _reward_panel(ax: Axes, rows: Rows) -> None:
    drawn = _line(ax, rows, "reward", color="C0")
    steps, mean = series(rows, "reward")
    std_steps, std = series(rows, "reward_std")
    if len(steps) and np.array_equal(steps, std_steps):
        _band(ax, steps, mean - std, mean + std, "C0", "± reward_std")
    for i, key in enumerate(k for k in _keys(rows, "rewards", "/mean")):
        drawn |= _line(ax, rows, key, label=key.removeprefix("rewards/").removesuffix("/mean"), color=f"C{i + 1}")
    _finish(ax, "reward", drawn)


def _length_panel(ax: Axes, rows: Rows) -> None:
    drawn = _line(ax, rows, "completions/mean_length", label="mean", color="C0")
    steps, low = series(rows, "completions/min_length")
    high_steps, high = series(rows, "completions/max_length")
    if len(steps) and np.array_equal(steps, high_steps):
        _band(ax, steps, low, high, "C0", "min-max")
        drawn = True
    ax.set_ylabel("tokens")
    if series(rows, "completions/clipped_ratio")[0].size:
        twin = ax.twinx()
        _line(twin, rows, "completions/clipped_ratio", label="clipped_ratio", color="C3")
        twin.set_ylabel("clipped ratio", color="C3")
        twin.set_ylim(0, 1.05)
        twin.legend(fontsize="small", loc="upper right")
        drawn = True
    _finish(ax, "completion length", drawn)


def _simple_panel(ax: Axes, rows: Rows, title: str, keys: list[str]) -> None:
    drawn = False
    for i, key in enumerate(keys):
        drawn |= _line(ax, rows, key, color=f"C{i}")
    _finish(ax, title, drawn)


def _time_panel(ax: Axes, rows: Rows) -> None:
    """Seconds per step, stacked by phase (time/*); the step_time line shows what the phases miss."""
    phases = _keys(rows, "time")
    phases = [p for p in phases if p != "time"]
    if phases:
        steps = np.array([row["step"] for row in rows], dtype=float)
        window = smoothing_window(len(steps))
        stacks = [moving_average(np.nan_to_num([row.get(p, 0.0) for row in rows]), window) for p in phases]
        ax.stackplot(steps, *stacks, labels=[p.removeprefix("time/") for p in phases], alpha=0.8)
    drawn = _line(ax, rows, "step_time", color="black") or bool(phases)
    ax.set_ylabel("seconds")
    _finish(ax, "step time by phase", drawn)
