"""The one place a step's metrics are written: run_dir/metrics.jsonl, TensorBoard, and `--report_to` sinks.

Each metrics.jsonl line is flushed as it is written, so a crash loses nothing already logged; the file
is appended to, so a resumed run continues it (`read_metrics` keeps the last row of a repeated step).
Non-finite values are written as null (strict JSON) and read back as NaN.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandemrl.logging.sinks import build_sinks, flat_row

METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"

# One name per metric in metrics.jsonl: TRL's (1.16, and ms-swift's) where TRL reports the figure
# (reward, kl, completions/mean_length, sampling/..., num_tokens), else `area/name` (time/, rollout/,
# train/, pipeline/, ...), so a TRL user's scripts read a tandem run as they read a TRL run. The figures TRL
# names bare are also given to the sinks (TensorBoard, W&B, trackio) under an `area/name` alias, which
# those group into panels by area. This map is the one place the two names meet; an emitter may use either.
TRL_ALIASES: dict[str, str] = {  # area/name -> TRL's name
    "reward/mean": "reward",
    "reward/std": "reward_std",
    "reward/frac_zero_std": "frac_reward_zero_std",
    "train/loss": "loss",
    "train/kl": "kl",
    "train/entropy": "entropy",
    "train/clip_ratio": "clip_ratio",
    "train/cispo_clip_ratio": "cispo_clip_ratio",
    "train/ratio": "ratio",
    "train/grad_norm": "grad_norm",
    "train/learning_rate": "learning_rate",
    "train/policy_version": "policy_version",
    "time/step": "step_time",
}
_AREA_NAME = {alias: name for name, alias in TRL_ALIASES.items()}


def canonical(metrics: dict[str, Any]) -> dict[str, Any]:
    """Each figure under its one name: TRL's where TRL has one. Example: {"train/kl": 0.1} -> {"kl": 0.1}"""
    return {TRL_ALIASES.get(name, name): value for name, value in metrics.items()}


def with_aliases(metrics: dict[str, Any]) -> dict[str, Any]:
    """For the sinks: every figure under its one name, and under its area/name where TRL names it bare.

    Example: {"reward": 0.5, "time/generate": 1.0} -> {"reward": 0.5, "reward/mean": 0.5, "time/generate": 1.0}
    """
    out: dict[str, Any] = {}
    for name, value in canonical(metrics).items():
        out[name] = value
        if name in _AREA_NAME:
            out[_AREA_NAME[name]] = value
    return out


def prompt_text(prompt: Any) -> str:
    """A prompt as one text: chat messages one a line as role: content.

    Example: [{"role": "user", "content": "2+2?"}] -> "user: 2+2?"
    """
    if isinstance(prompt, list):
        return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" if isinstance(m, dict) else str(m) for m in prompt)
    return str(prompt)


def _json_value(value: Any) -> Any:
    """Plain JSON numbers: ints stay ints (policy_version), tensors and numpy scalars become floats."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsLogger:
    """Writes one row of metrics per step, and sample completions, to every sink of a run.

    `report_to` names extra sinks (wandb, trackio); `run_name` defaults to the run directory's name. A run
    resumed at `first_step` drops the rows of later steps first (logged after that checkpoint, before a crash:
    the resumed run logs them again), so each step is in metrics.jsonl and completions.jsonl once.
    """

    def __init__(
        self, run_dir: str | Path, *, report_to: Sequence[str], config: dict[str, Any], run_name: str | None = None,
        first_step: int | None = None,
    ) -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if first_step is not None:
            for name in (METRICS_FILE, COMPLETIONS_FILE):
                _drop_steps_after(self.run_dir / name, first_step)
        self.sinks = build_sinks(report_to, self.run_dir, config, run_name or self.run_dir.resolve().name)
        self._metrics_file = _open_append(self.run_dir / METRICS_FILE)
        self._completions_file = _open_append(self.run_dir / COMPLETIONS_FILE)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Example: log(3, {"reward/mean": 0.5}) appends the line {"step": 3, "reward": 0.5}; the sinks get
        reward and reward/mean."""
        row = {name: _json_value(value) for name, value in canonical(metrics).items()}
        _write_line(self._metrics_file, {"step": step, **row})
        scalars = {name: float(value) for name, value in with_aliases(row).items() if isinstance(value, int | float)}
        for sink in self.sinks:
            sink.log(step, scalars)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """Rows hold prompt, completion, reward and per-function rewards (`rewards/<fn>` or a nested dict).
        A chat prompt (a list of messages) is written to completions.jsonl as that list, to the sinks as text."""
        rows = [{name: v if isinstance(v, list) else _json_value(v) for name, v in flat_row(row).items()} for row in rows]
        for row in rows:
            _write_line(self._completions_file, {"step": step, **row})
        if rows:
            texts = [{**row, "prompt": prompt_text(row["prompt"])} if "prompt" in row else row for row in rows]
            for sink in self.sinks:
                sink.log_completions(step, texts)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self._metrics_file.close()
        self._completions_file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_append(path: Path) -> Any:
    """Opens for appending; ends a line torn by a killed writer, so the next row starts on its own line."""
    torn = False
    if path.is_file() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            f.seek(-1, 2)
            torn = f.read(1) != b"\n"
    file = open(path, "a", encoding="utf-8")
    if torn:
        file.write("\n")
    return file


def _drop_steps_after(path: Path, step: int) -> None:
    """Rewrites a JSONL file of {"step": ...} rows without those of later steps (and a torn last line)."""
    if not path.is_file():
        return
    kept = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("step", 0) <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    tmp.replace(path)


def last_value(run_dir: str | Path, name: str, *, step: int) -> float | None:
    """`name`'s value at `step` in run_dir/metrics.jsonl (None if not logged). Example: a resumed run's num_tokens."""
    try:
        rows = read_metrics(run_dir)
    except FileNotFoundError:
        return None
    value = next((row.get(name) for row in rows if row["step"] == step), None)
    return None if value is None or math.isnan(value) else value


def _write_line(file: Any, row: dict[str, Any]) -> None:
    file.write(json.dumps(row, allow_nan=False) + "\n")
    file.flush()


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """Rows of run_dir/metrics.jsonl in step order; a step logged twice (a resumed run) keeps its last row.

    A torn last line (the writer was killed mid-write) is skipped; null values come back as NaN.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a run directory written by `tandem train`")
    by_step: dict[int, dict[str, float]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            by_step[row["step"]] = {k: math.nan if v is None else v for k, v in row.items()}
    return [by_step[step] for step in sorted(by_step)]
