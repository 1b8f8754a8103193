"""What a person watches: a rich progress bar on a terminal, a plain heartbeat line otherwise.

Under nohup or CI (stream not a tty) a line like `step 12/200 reward 0.41 kl 0.002 step_time 1.3s eta
4m05s queue 3` is written at most every `heartbeat_s` seconds, always for the first and last step, and
on close for a step not yet shown, so a log never ends silent. A step that runs past `heartbeat_s`
gets a line too, saying which phase it is in (`step 13/200 in reward for 2m00s`), written by a watch
thread, so a stuck step is visible even while nothing else runs.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from rich.console import Console
from rich.table import Table
from rich.text import Text

from tandemrl.logging.console import format_duration, printable, step_line
from tandemrl.logging.sinks import completion_columns, flat_row

# In the order shown; a metric not logged is left out of the line. "eta" is computed here.
HEARTBEAT_METRICS = ("reward", "kl", "step_time", "eta", "pipeline/queue_depth")
LABELS = {"pipeline/queue_depth": "queue"}
MAX_CELL_CHARS = 400


def _format_value(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if name.endswith("_time") or name.startswith("time/"):
        return f"{value:.1f}s"
    if float(value).is_integer() and abs(value) >= 1:
        return str(int(value))
    return f"{value:.3g}"


def _is_tty(stream: TextIO) -> bool:
    # The stream itself decides, not FORCE_COLOR: a bar redrawn into a nohup log is unreadable.
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """Shows step/total, reward and ETA; the ETA is the mean time per step so far times the steps left."""

    def __init__(
        self,
        total_steps: int,
        *,
        start_step: int = 0,
        stream: TextIO | None = None,
        heartbeat_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        logging_steps: int = 0,
        num_rollouts: int = 0,
        memory_gb: Callable[[], float | None] = lambda: None,
        watch: bool = False,
    ) -> None:
        """`logging_steps` > 0 prints a full step line (console.step_line) every that many steps, on the
        first and on the last, kept in the scrollback; `num_rollouts` per step gives its tokens/s; `watch`
        starts the thread that reports a step stuck in one phase (beat_if_stuck)."""
        stream = sys.stdout if stream is None else stream
        self.total_steps = total_steps
        self.start_step = start_step
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.logging_steps, self.num_rollouts, self.memory_gb = logging_steps, num_rollouts, memory_gb
        self.interactive = _is_tty(stream)
        self.console = Console(file=stream, force_terminal=self.interactive, soft_wrap=not self.interactive)
        self._start_time = clock()
        self._last_beat: float | None = None
        self._pending: str | None = None  # the newest heartbeat line not yet written
        self._bar = self._start_bar() if self.interactive else None
        self._step = start_step  # steps done
        self._phase = ("start", clock())  # the phase now running, and since when
        self._last_line = clock()  # the last time a line (or bar update) told the user something
        self._closed = threading.Event()
        if watch:
            threading.Thread(target=self._watch, name="progress-watch", daemon=True).start()

    def _start_bar(self) -> Any:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        bar = RichProgress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[stats]}"),
            console=self.console,
            get_time=self.clock,
        )
        self._task = bar.add_task("train", total=self.total_steps, completed=self.start_step, stats="")
        bar.start()
        return bar

    def stats(self, step: int, metrics: dict[str, float]) -> str:
        """Example: stats(12, {"reward": 0.41, "kl": 0.002}) -> "reward 0.41 kl 0.002 eta 4m05s"."""
        shown: dict[str, Any] = dict(metrics)
        done = step - self.start_step
        if done > 0 and step < self.total_steps:
            seconds_per_step = (self.clock() - self._start_time) / done
            shown["eta"] = format_duration(seconds_per_step * (self.total_steps - step))
        parts = [f"{LABELS.get(name, name)} {_format_value(name, shown[name])}" for name in HEARTBEAT_METRICS if name in shown]
        return " ".join(parts)

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Call after step `step` (1-based: the count of steps done) with that step's metrics."""
        stats = self.stats(step, metrics)
        self._step, self._last_line = step, self.clock()
        if self._is_logging_step(step):
            line = step_line(step, self.total_steps, metrics, num_rollouts=self.num_rollouts, memory_gb=self.memory_gb())
            self.console.print(line, markup=False, highlight=False)  # above the bar on a terminal
            if self._bar is None:  # the line says more than the heartbeat would
                self._pending, self._last_beat = None, self.clock()
                return
        if self._bar is not None:
            self._bar.update(self._task, completed=step, stats=stats)
            return
        self._pending = f"step {step}/{self.total_steps} {stats}".rstrip()
        now = self.clock()
        if self._last_beat is None or now - self._last_beat >= self.heartbeat_s or step >= self.total_steps:
            self._write_pending()
            self._last_beat = now

    def _is_logging_step(self, step: int) -> bool:
        every = self.logging_steps
        return every > 0 and (step % every == 0 or step == self.start_step + 1 or step >= self.total_steps)

    def phase(self, name: str) -> None:
        """The part of the step now running (generate, reward, train, sync, save)."""
        self._phase = (name, self.clock())

    def beat_if_stuck(self) -> None:
        """Past `heartbeat_s` without a line: say which phase the running step is in, and for how long."""
        now = self.clock()
        if now - self._last_line < self.heartbeat_s or self._step >= self.total_steps:
            return
        name, since = self._phase
        line = f"step {self._step + 1}/{self.total_steps} in {name} for {format_duration(now - since)}"
        self._last_line = now
        if self._bar is not None:
            self._bar.update(self._task, stats=line)
        else:
            self.console.print(line, markup=False, highlight=False)

    def _watch(self) -> None:
        while not self._closed.wait(min(self.heartbeat_s, 5.0)):
            self.beat_if_stuck()

    def _write_pending(self) -> None:
        if self._pending is not None:
            self.console.print(self._pending, markup=False, highlight=False)
            self._pending = None

    def print_completions(self, step: int, rows: list[dict[str, Any]], *, max_rows: int = 4) -> None:
        """A rich table on a terminal, one plain line per completion otherwise (newlines shown as \\n)."""
        rows = [flat_row(row) for row in rows[:max_rows]]
        if not rows:
            return
        columns = [c for c in completion_columns(rows) if c not in _repeated_total(rows)]
        if self.interactive:
            table = Table(title=f"step {step}: sample completions", show_lines=True)
            for column in columns:
                table.add_column(column, overflow="fold", ratio=4 if column in ("prompt", "completion") else 1)
            for row in rows:  # cells as Text: a completion's "[/INST]" is text, not rich markup (MarkupError ended the run)
                table.add_row(*(Text(printable(_cell(c, row.get(c, ""), MAX_CELL_CHARS), keep_newlines=c in ("prompt", "completion"))) for c in columns))
            self.console.print(table)
            return
        for i, row in enumerate(rows):
            # a text column a reward function logged (log_extra) is escaped as the completion is: one line each
            scores = " ".join(f"{c} {printable(_cell(c, row[c], 20))}" for c in columns if c not in ("prompt", "completion") and c in row)
            texts = " | ".join(f"{c}: '{printable(_cell(c, row[c], MAX_CELL_CHARS))}'" for c in ("prompt", "completion") if c in row)
            line = f"step {step} sample {i + 1}/{len(rows)} {scores} | {texts}"
            self.console.print(line, markup=False, highlight=False)

    def close(self) -> None:
        self._closed.set()
        if self._bar is not None:
            self._bar.stop()
        self._write_pending()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _repeated_total(rows: list[dict[str, Any]]) -> set[str]:
    """The one reward function's column when it equals `reward` in every row (it would repeat the total)."""
    scores = {c for row in rows for c in row if c not in ("prompt", "completion", "reward")}
    if len(scores) == 1 and all(row.get(c) == row.get("reward") for row in rows for c in scores):
        return scores
    return set()


def _cell(name: str, value: Any, max_chars: int) -> str:
    text = value if isinstance(value, str) else _format_value(name, value) if isinstance(value, int | float) else str(value)
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"
