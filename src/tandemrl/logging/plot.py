"""A run's dashboard: run_dir/metrics.jsonl -> one PNG whose panels are chosen from what the run logged.

Uses matplotlib's Figure and Agg canvas directly, never pyplot, so no global backend is switched.
A panel whose metrics were never logged, or never moved (a constant clip ratio, a constant learning
rate), is left out and the next candidate takes its place. Noisy curves are drawn faint (raw, per
step) with a centred moving average on top; the figure says which is which.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from tandemrl.logging.console import TIME_SPLIT
from tandemrl.logging.metrics import read_metrics

Rows = list[dict[str, float]]
MAX_PANELS = 8


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Writes the dashboard PNG (default run_dir/dashboard.png) and returns its path."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no steps yet; plot again after the first step is logged")
    out = run_dir / "dashboard.png" if out is None else Path(out)
    panels = chosen_panels(rows)
    columns = max(2, (len(panels) + 1) // 2)
    fig = Figure(figsize=(4.5 * columns, 8), dpi=100, layout="constrained")
    axes = fig.subplots(2, columns, squeeze=False).flat
    for (_, draw), ax in zip(panels, axes):
        draw(ax, rows)
    for ax in list(axes):
        ax.set_visible(False)
    window = smoothing_window(len(rows))
    note = f"\nfaint: raw value per step; solid: centred moving average over {window} steps" if window > 1 else ""
    fig.suptitle(f"{_title(run_dir)}: steps {rows[0]['step']:g}-{rows[-1]['step']:g}{note}")
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png")  # then rename: a viewer refreshing the PNG never sees half of it
    os.replace(tmp, out)
    return out


def chosen_panels(rows: Rows) -> list[tuple[str, Callable[[Axes, Rows], None]]]:
    """(name, draw) of the panels worth drawing, in order: reward and step time always, the others when
    one of their metrics was logged and moved. At most MAX_PANELS, step time last."""
    candidates: list[tuple[str, list[str], Callable[[Axes, Rows], None]]] = [
        ("completion length", ["completions/mean_length", "completions/max_length"], _length_panel),
        ("clipped ratio", ["completions/clipped_ratio"], _simple("truncated at max length (clipped_ratio)", ["completions/clipped_ratio"])),
        ("KL", ["kl"], _simple("KL to reference", ["kl"])),
        ("entropy", ["entropy"], _simple("entropy", ["entropy"])),
        ("grad_norm", ["grad_norm"], _simple("gradient norm (before clipping)", ["grad_norm"])),
        ("clip ratio", _keys(rows, "clip_ratio"), _simple("clip ratio", _keys(rows, "clip_ratio"))),
        ("zero-std fraction", ["frac_reward_zero_std"], _simple("groups with zero reward std", ["frac_reward_zero_std"])),
        ("learning rate", ["learning_rate"], _simple("learning rate", ["learning_rate"])),
        ("loss", ["loss"], _simple("loss", ["loss"])),
    ]
    alive = [(name, draw) for name, keys, draw in candidates if any(_moved(rows, k) for k in keys)]
    return [("reward", _reward_panel), *alive[: MAX_PANELS - 2], ("step time", _time_panel)]


def _moved(rows: Rows, key: str) -> bool:
    """Whether `key` was logged with at least two different finite values."""
    values = series(rows, key)[1]
    return len(values) > 0 and bool(np.ptp(values) > 1e-12 * max(1.0, float(np.abs(values).max())))


def _title(run_dir: Path) -> str:
    """Model, task and loss from the run's config.yaml; the run directory's name alone without one."""
    name = run_dir.resolve().name
    try:
        import yaml

        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, ValueError):
        return name
    data = config.get("task") or config.get("dataset") or "?"
    return f"{config.get('model') or '?'} on {data}, loss {config.get('loss_type', '?')} ({name})"


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
    linewidth = style.pop("linewidth", 1.6)
    if window > 1:
        (faint,) = ax.plot(steps, values, alpha=0.25, linewidth=0.8, **style)
        style["color"] = faint.get_color()
    ax.plot(steps, moving_average(values, window), label=label or key, linewidth=linewidth, **style)
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
    """The total on top (thick); a function's mean is drawn only where it differs from the total."""
    functions = _keys(rows, "rewards", "/mean")
    same = [k for k in functions if np.array_equal(series(rows, k)[1], series(rows, "reward")[1])]
    label = "reward" + (f" (= {same[0].removeprefix('rewards/').removesuffix('/mean')})" if len(functions) == 1 and same else "")
    drawn = _line(ax, rows, "reward", label=label, color="C0", zorder=3, linewidth=2.4)
    steps, mean = series(rows, "reward")
    std_steps, std = series(rows, "reward_std")
    if len(steps) and np.array_equal(steps, std_steps):
        _band(ax, steps, mean - std, mean + std, "C0", "± reward_std")
    for i, key in enumerate(k for k in functions if not (len(functions) == 1 and k in same)):
        drawn |= _line(ax, rows, key, label=key.removeprefix("rewards/").removesuffix("/mean"), color=f"C{i + 1}", linestyle="--")
    _finish(ax, "reward", drawn)


def _length_panel(ax: Axes, rows: Rows) -> None:
    drawn = _line(ax, rows, "completions/mean_length", label="mean", color="C0")
    steps, low = series(rows, "completions/min_length")
    high_steps, high = series(rows, "completions/max_length")
    if len(steps) and np.array_equal(steps, high_steps):
        _band(ax, steps, low, high, "C0", "min-max")
        drawn = True
    ax.set_ylabel("tokens")
    _finish(ax, "completion length", drawn)


def _simple(title: str, keys: list[str]) -> Callable[[Axes, Rows], None]:
    def draw(ax: Axes, rows: Rows) -> None:
        drawn = False
        for i, key in enumerate(keys):
            drawn |= _line(ax, rows, key, color=f"C{i}")
        _finish(ax, title, drawn)

    return draw


def _time_panel(ax: Axes, rows: Rows) -> None:
    """Seconds per step, stacked by phase (the critical-path phases, which add up to step_time: the black line
    lies on the stack's top); never a total stacked as if it were a phase (a run logged before the split added
    up may hold time/step)."""
    logged = {key for row in rows for key in row}
    phases = [name for name, _ in TIME_SPLIT if name in logged]
    if phases:
        steps = np.array([row["step"] for row in rows], dtype=float)
        window = smoothing_window(len(steps))
        stacks = [moving_average(np.nan_to_num([row.get(p, 0.0) for row in rows]), window) for p in phases]
        ax.stackplot(steps, *stacks, labels=[p.removeprefix("time/") for p in phases], alpha=0.8)
    drawn = _line(ax, rows, "step_time", color="black") or bool(phases)
    ax.set_ylabel("seconds")
    _finish(ax, "step time by phase", drawn)
