"""Where metrics go besides metrics.jsonl: TensorBoard always, W&B and trackio when `--report_to` asks.

Each sink is chosen once by `build_sinks`; its optional package is imported only here, when asked for.
A sink takes a flat `dict[str, float]` per step and a list of completion rows (flat dicts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Protocol

REPORT_TO = ("tensorboard", "wandb", "trackio", "none")
COMPLETION_COLUMNS = ("prompt", "completion", "reward")


class Sink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None: ...
    def close(self) -> None: ...


def build_sinks(report_to: Sequence[str], run_dir: Path, config: dict[str, Any], run_name: str | None) -> list[Sink]:
    """TensorBoard first (always on), then each optional sink named in `report_to`, in order.

    "tensorboard" and "none" add nothing: JSONL and TensorBoard cost little and are always written.
    """
    unknown = [name for name in report_to if name not in REPORT_TO]
    if unknown:
        raise ValueError(f"--report_to: unknown sink(s) {', '.join(unknown)}; choose from {', '.join(REPORT_TO)}")
    sinks: list[Sink] = [TensorBoardSink(run_dir / "tensorboard", config)]
    for name in dict.fromkeys(report_to):
        if name == "wandb":
            sinks.append(WandbSink(run_dir, config, run_name))
        elif name == "trackio":
            sinks.append(TrackioSink(config, run_name))
    return sinks


def _import_optional(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        raise ValueError(f"--report_to {name} needs the {name} package: pip install {name}") from None


def flat_row(row: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become `outer/inner` keys, as metric names are.

    Example: {"reward": 1.0, "rewards": {"format": 0.0}} -> {"reward": 1.0, "rewards/format": 0.0}
    """
    flat: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            flat.update(flat_row(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def completion_columns(rows: list[dict[str, Any]]) -> list[str]:
    """prompt, completion, reward first, then every other key in order of first appearance."""
    keys = dict.fromkeys(COMPLETION_COLUMNS)
    for row in rows:
        keys.update(dict.fromkeys(row))
    return [key for key in keys if any(key in row for row in rows)]


def _markdown_cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", "<br>")


class TensorBoardSink:
    """Scalars under their metric names; completions as a markdown table in the text panel."""

    def __init__(self, log_dir: Path, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # flush_secs: a run killed between flushes loses at most this much of its TensorBoard curve.
        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=10)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns = completion_columns(rows)
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(_markdown_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
        self.writer.add_text("completions", "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases: project from $WANDB_PROJECT (default "tandem"), completions as a wandb.Table."""

    def __init__(self, run_dir: Path, config: dict[str, Any], run_name: str | None) -> None:
        self.wandb = _import_optional("wandb")
        project = os.environ.get("WANDB_PROJECT", "tandem")
        self.run = self.wandb.init(project=project, name=run_name, config=config, dir=str(run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns = completion_columns(rows)
        table = self.wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.run.log({"completions": table}, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioSink:
    """trackio (local, W&B-like API): project from $TRACKIO_PROJECT (default "tandem")."""

    def __init__(self, config: dict[str, Any], run_name: str | None) -> None:
        self.trackio = _import_optional("trackio")
        self.trackio.init(project=os.environ.get("TRACKIO_PROJECT", "tandem"), name=run_name, config=config)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.trackio.log(metrics, step=step)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        columns = completion_columns(rows)
        table = self.trackio.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])
        self.trackio.log({"completions": table}, step=step)

    def close(self) -> None:
        self.trackio.finish()
