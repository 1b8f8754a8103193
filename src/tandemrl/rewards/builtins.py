"""Built-in reward functions, in TRL's signature: `fn(prompts, completions, **columns) -> list[float | None]`.

`prompts` are strings or chat-message lists, `completions` are strings, or message lists where the
prompt is one (the last message's content is scored); every other dataset column arrives as a keyword
list aligned with `completions`. None means "not applicable to this row".
Invariant: each function returns exactly one value per completion and never raises on model output.
"""

from __future__ import annotations

import logging
import re
from typing import Any

FORMAT_PATTERN = r"(?s)\S.*\\boxed\{.+\}\W*$"
"""Default of `format`: some reasoning, then a \\boxed{...} answer that only punctuation may follow."""

TARGET_LENGTH = 2000
"""Default of `length`: characters a completion may use before it is penalised."""

MAX_ANSWER_CHARS = 200  # math_verify runs without its signal timeout (we are in a thread): keep inputs short

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


def math_accuracy(prompts: list[Any], completions: list[Any], **columns: list[Any]) -> list[float | None]:
    """1.0 if the completion's final answer equals the reference answer, else 0.0; None without a reference.

    The final answer is the last \\boxed{...}, else the text after the last "####", else the last number.
    The reference is the `solution` column, else `answer` (GSM8K's "steps #### 72" keeps "72").
    Equality is math_verify's: "\\frac{1}{2}" equals "0.5", "1,000" equals "1000".
    Example: completions ["so \\boxed{72}", "it is 71"], answer ["... #### 72"] * 2 -> [1.0, 0.0]
    """
    solutions = _per_row(columns.get("solution"), None, len(completions))
    answers = _per_row(columns.get("answer"), None, len(completions))
    references = [s if s is not None else a for s, a in zip(solutions, answers)]
    return [_accuracy(text(completion), reference) for completion, reference in zip(completions, references)]


def format(prompts: list[Any], completions: list[Any], **columns: list[Any]) -> list[float | None]:  # noqa: A001
    """1.0 if the completion matches a regex (`re.search`), else 0.0.

    The pattern is the row's `format_pattern` column when the dataset has one, else FORMAT_PATTERN
    (reasoning, then a final \\boxed{} answer). For a fixed other pattern use `make_format(pattern)`.
    Example: completions ["2 + 2 = 4, so \\boxed{4}.", "4"] -> [1.0, 0.0]
    """
    patterns = _per_row(columns.get("format_pattern"), FORMAT_PATTERN, len(completions))
    return [1.0 if re.search(pattern, text(completion)) else 0.0 for completion, pattern in zip(completions, patterns)]


def make_format(pattern: str) -> Any:
    """A `format` reward with a fixed pattern, for `module:function` use: `my_format = make_format(r"...")`."""
    re.compile(pattern)

    def format_pattern(prompts: list[Any], completions: list[Any], **columns: list[Any]) -> list[float | None]:
        return [1.0 if re.search(pattern, text(completion)) else 0.0 for completion in completions]

    return format_pattern


def length(prompts: list[Any], completions: list[Any], **columns: list[Any]) -> list[float | None]:
    """0.0 up to a target length in characters, then falling linearly to -1.0 at twice the target.

    The target is the row's `target_length` column when the dataset has one, else TARGET_LENGTH.
    Use it with a small weight beside an accuracy reward to discourage rambling.
    Example: completions ["x" * 10, "x" * 15, "x" * 40], target_length [10] * 3 -> [0.0, -0.5, -1.0]
    """
    targets = _per_row(columns.get("target_length"), TARGET_LENGTH, len(completions))
    return [-min(1.0, max(0, len(text(c)) - t) / t) for c, t in zip(completions, targets)]


BUILTINS = {"math_accuracy": math_accuracy, "format": format, "length": length}


def text(completion: str | list[dict[str, Any]]) -> str:
    """A completion's text: the string itself, or the content of a conversational completion's last message.

    Example: [{"role": "assistant", "content": "42"}] -> "42"
    """
    return completion if isinstance(completion, str) else str(completion[-1].get("content") or "")


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: last \\boxed{...}, else after the last "####", else the last number.

    A box left open (the completion was cut off inside it) means no answer.
    Example: "a \\boxed{1} b \\boxed{\\frac{2}{3}}" -> "\\frac{2}{3}"; "x #### 1,000" -> "1000"; "\\boxed{7" -> None
    """
    if "\\boxed{" in text or "\\fbox{" in text:
        answer = _last_boxed(text)
    elif "####" in text:
        answer = text.rsplit("####", 1)[1].strip().split("\n")[0]
    else:
        numbers = _NUMBER.findall(text)
        answer = numbers[-1] if numbers else None
    return _normalize(answer) if answer is not None else None


def reference_answer(value: Any) -> str | None:
    """The reference of a row: GSM8K's "steps #### 72" -> "72"; a number -> its text; missing -> None."""
    if value is None:
        return None
    text = str(value)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = _normalize(text)
    return text or None


def _per_row(column: list[Any] | None, default: Any, num_rows: int) -> list[Any]:
    """A column's values, `default` where the column or a row's value is missing."""
    column = column or [None] * num_rows
    return [default if value is None else value for value in column]


def _accuracy(completion: str, reference: Any) -> float | None:
    gold = reference_answer(reference)
    if gold is None:
        return None
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    if answer == gold:
        return 1.0
    return 1.0 if _verify(gold[:MAX_ANSWER_CHARS], answer[:MAX_ANSWER_CHARS]) else 0.0


def _verify(gold: str, answer: str) -> bool:
    from math_verify import parse, verify

    # Timeouts off: math_verify's timeout uses signal.alarm, which fails outside the main thread. Its one
    # warning then says to bound the call yourself, as --reward_timeout_s does: not shown on the console.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    gold_parsed = parse(f"${gold}$", parsing_timeout=None)
    answer_parsed = parse(f"${answer}$", parsing_timeout=None)
    return bool(gold_parsed and answer_parsed and verify(gold_parsed, answer_parsed, timeout_seconds=None))


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    start = text.index("{", start) + 1
    depth = 1
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end]
    return None  # unbalanced: the completion was cut off inside the box


def _normalize(answer: str) -> str:
    answer = answer.strip().strip("$").strip().rstrip(".").strip()
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    return answer
