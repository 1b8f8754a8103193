"""The lines of `tandem train` a person reads: the start banner, a line every `--logging_steps` steps
kept in the scrollback, and the end summary; and completion text made safe to print.

Each line is built from values already logged (a metric not logged is left out), so the console
never shows a number that metrics.jsonl does not hold, apart from tokens/s, derived from logged ones.
"""

from __future__ import annotations

import functools
import math
from typing import Any

# (metric, label, format) in the order shown on the step line.
STEP_LINE = (
    ("reward", "reward", "{:.3f}"),
    ("reward_std", "±", "{:.3f}"),
    ("completions/mean_length", "len", "{:.1f}"),
    ("entropy", "entropy", "{:.3g}"),
    ("kl", "kl", "{:.3g}"),
    ("grad_norm", "grad_norm", "{:.3g}"),
    ("learning_rate", "lr", "{:.2e}"),
)
TIME_SPLIT = (("time/generate", "gen"), ("time/reward", "reward"), ("time/train", "train"), ("time/sync", "sync"), ("time/other", "other"))
# the step's seconds on the trainer's critical path (pipeline.loop.PHASES): they add up to step_time
LINE_WIDTH = 80  # a step line longer than this wraps at a " | ", its continuation indented


def format_duration(seconds: float) -> str:
    """Example: 7 -> "7s", 245 -> "4m05s", 3725 -> "1h02m"."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def step_line(
    step: int, total_steps: int, metrics: dict[str, float], *, num_rollouts: int, memory_gb: float | None, width: int = LINE_WIDTH
) -> str:
    """The line, wrapped at " | " to `width` columns (continuations indented).

    Example: step_line(10, 150, {"reward": 0.5, "completions/mean_length": 8.0, "rollout/generate_s": 0.2,
    "time/generate": 0.2, "step_time": 0.5}, num_rollouts=128, memory_gb=None)
    -> "step 10/150 | reward 0.500 | len 8.0 | 5.1k tok/s | 0.50s/step (gen 0.20)"
    """
    parts = [f"step {step}/{total_steps}"]
    for name, label, fmt in STEP_LINE:
        value = metrics.get(name)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if label == "±":
            parts[-1] += f" ± {fmt.format(value)}" if parts[-1].startswith("reward") else ""
            continue
        parts.append(f"{label} {fmt.format(value)}")
    generate_s = metrics.get("rollout/generate_s")  # the whole generation, overlapped or not
    if generate_s and "completions/mean_length" in metrics:
        parts.append(f"{_si(metrics['completions/mean_length'] * num_rollouts / generate_s)} tok/s")
    if memory_gb is not None:
        parts.append(f"mem {memory_gb:.1f}G")
    if "step_time" in metrics:
        split = " ".join(f"{label} {metrics[name]:.2f}" for name, label in TIME_SPLIT if name in metrics)
        parts.append(f"{metrics['step_time']:.2f}s/step" + (f" ({split})" if split else ""))
    return wrap(parts, width)


def wrap(parts: list[str], width: int, indent: str = "    ") -> str:
    """Parts joined by " | ", a new indented line where the next part would pass `width`.

    Example: wrap(["step 1/2", "reward 0.5", "lr 1e-3"], 20) -> "step 1/2 | reward 0.5\n    lr 1e-3"
    """
    lines = [parts[0]]
    for part in parts[1:]:
        if len(lines[-1]) + 3 + len(part) > width:
            lines.append(indent + part)
        else:
            lines[-1] += " | " + part
    return "\n".join(lines)


def _si(value: float) -> str:
    """Example: 5120 -> "5.1k"; 830 -> "830"; 2.5e6 -> "2.5M"."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.1f}{suffix}"
    return f"{value:.0f}"


def banner(*, model: str, num_parameters: int, task: str, device: str, dtype: str, num_prompts: int, num_generations: int,
           loss_type: str, learning_rate: float, max_steps: int, run_dir: str, generator: str = "", lora: str = "") -> list[str]:  # fmt: skip
    """The lines printed before step 1: what trains, on what, how, what generates, and where it is written."""
    return [
        f"tandem train: {model} ({_si(num_parameters)} parameters) on task {task or '(none: --dataset)'}, {device}, {dtype}",
        f"  {num_prompts} prompts x {num_generations} generations per step, loss {loss_type}, learning rate {learning_rate:g}, {max_steps} steps",
        *([f"  {lora}"] if lora else []),
        *([f"  generator: {generator}"] if generator else []),
        f"  run directory {run_dir}  (TensorBoard now: tensorboard --logdir {run_dir})",
    ]


def lora_line(*, r: int, alpha: float, targets: tuple[str, ...], trained: int, whole: tuple[str, ...] = (), whole_lr: float = 0.0) -> str:
    """What LoRA trains, for the banner: rank, alpha, target modules, the parameters that train (`trained`),
    and the modules trained whole (`whole`) with their learning rate.

    Example: r 16, alpha 32, ("all-linear",), 32_832, ("model.norm",), 1.0
      -> "LoRA r 16, alpha 32 on all-linear (32.8k parameters trained); trained whole: model.norm, learning rate 1"
    """
    line = f"LoRA r {r}, alpha {alpha:g} on {' '.join(targets)} ({_si(trained)} parameters trained)"
    return line + (f"; trained whole: {' '.join(whole)}, learning rate {whole_lr:g}" if whole else "")


def summary(rows: list[dict[str, float]], *, wall_s: float, run_dir: str, checkpoint: str | None) -> list[str]:
    """The lines printed after the last step: steps, wall time, best and last reward, where things are."""
    rewards = [(r["step"], r["reward"]) for r in rows if "reward" in r and not math.isnan(r["reward"])]
    lines = [f"done: {len(rows)} step{'' if len(rows) == 1 else 's'} in {format_duration(wall_s)}"]
    if rewards:
        best_step, best = max(rewards, key=lambda sr: sr[1])
        lines[0] += f"; reward last {rewards[-1][1]:.3f}, best {best:.3f} (step {int(best_step)})"
    lines.append(f"  checkpoint {checkpoint}" if checkpoint else "  no checkpoint written")
    lines.append(f"  run directory {run_dir}  (plot it: tandem plot {run_dir})")
    return lines


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode map, which every byte-level BPE (GPT-2, Qwen, Llama 3) uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


def readable_text(tokenizer: Any, token_ids: list[int], text: str) -> str:
    """`text` (the decoding of `token_ids`) fit to print: bytes that are not UTF-8 shown as \\xNN
    (byte-level tokenizers; others keep U+FFFD) and control characters but newlines and tabs escaped. `text`
    may hold the special tokens (a conversation's turn markers) or not (a completion's).

    Example: ids whose bytes are b"ab\\xe2\\r" -> "ab\\\\xe2\\\\r" (shown as ab\\xe2\\r)
    """
    if "\ufffd" in text:
        for skip in (True, False):
            if tokenizer.decode(token_ids, skip_special_tokens=skip) == text:
                tokens = tokenizer.convert_ids_to_tokens(token_ids, skip_special_tokens=skip)
                text = _from_bytes(tokens, set(tokenizer.all_special_tokens)) or text
                break
    return printable(text, keep_newlines=True)


def _from_bytes(tokens: list[str | None], specials: set[str]) -> str | None:
    """Byte-level tokens as text, bytes that are not UTF-8 as \\xNN, a special token as itself; None where a
    token is not byte-level (or None: an id past the tokenizer's vocab)."""
    byte_of = _byte_of_char()
    if not all(t is not None and (t in specials or all(c in byte_of for c in t)) for t in tokens):
        return None
    return b"".join(t.encode() if t in specials else bytes(byte_of[c] for c in t) for t in tokens).decode("utf-8", errors="backslashreplace")  # type: ignore[union-attr]


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """Control characters escaped, so one text cannot redraw or break a terminal line.

    Example: printable("a\rb\n") -> "a\\rb\\n"; with keep_newlines -> "a\\rb\n"
    """
    kept = " \n\t" if keep_newlines else " "
    return "".join(c if c.isprintable() or c in kept else c.encode("unicode_escape").decode() for c in text)
