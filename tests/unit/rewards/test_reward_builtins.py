"""The built-in reward functions on hand-written completions."""

from __future__ import annotations

import logging

import pytest

from tandemrl.rewards.builtins import extract_answer, format, length, make_format, math_accuracy, reference_answer

GSM8K_ANSWER = "Natalia sold 48/2 = 24 clips in May.\n48+24 = 72 clips altogether.\n#### 72"


@pytest.mark.parametrize(
    "completion",
    ["She sold 72 clips, so the answer is \\boxed{72}.", "First 48, then 24.\n#### 72", "48 + 24 makes 72"],
)
def test_math_accuracy_reads_boxed_hashes_and_last_number(completion: str) -> None:
    assert math_accuracy(["q"], [completion], answer=[GSM8K_ANSWER]) == [1.0]


def test_math_accuracy_scores_a_wrong_answer_zero() -> None:
    completions = ["\\boxed{71}", "#### 70", "it is 48 + 23 = 71", "no number at all", "\\boxed{72"]
    assert math_accuracy(["q"] * 5, completions, answer=[GSM8K_ANSWER] * 5) == [0.0] * 5


def test_math_accuracy_takes_the_last_boxed_answer() -> None:
    assert math_accuracy(["q"] * 2, ["\\boxed{1} then \\boxed{72}", "\\boxed{72} then \\boxed{1}"], solution=["72"] * 2) == [1.0, 0.0]


def test_math_accuracy_equates_a_latex_fraction_and_a_decimal() -> None:
    completions = ["so \\boxed{\\frac{1}{2}}", "so \\boxed{0.5}", "so \\boxed{\\dfrac{3}{4}}"]
    assert math_accuracy(["q"] * 3, completions, solution=["0.5", "\\frac{1}{2}", "0.5"]) == [1.0, 1.0, 0.0]


def test_math_accuracy_logs_no_warning_that_its_timeouts_are_off(caplog, monkeypatch) -> None:
    """math_verify warned once a process that its timeouts were off (the gsm8k task's console showed it
    twice), telling the user to bound the call, which --reward_timeout_s does."""
    import math_verify.grader
    import math_verify.parser

    monkeypatch.setattr(math_verify.parser, "TIMEOUT_WARNING_SHOWN", False)
    monkeypatch.setattr(math_verify.grader, "TIMEOUT_WARNING_SHOWN", False)
    with caplog.at_level(logging.WARNING):
        assert math_accuracy(["q"], ["so \\boxed{\\frac{1}{2}}"], solution=["0.5"]) == [1.0]
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_math_accuracy_ignores_thousands_separators() -> None:
    assert math_accuracy(["q"] * 2, ["\\boxed{1,000}", "it costs $1,000."], answer=["x #### 1000"] * 2) == [1.0, 1.0]


def test_math_accuracy_prefers_solution_and_is_none_without_reference() -> None:
    values = math_accuracy(["q"] * 3, ["\\boxed{5}"] * 3, solution=["5", None, None], answer=["#### 6", "#### 5", None])
    assert values == [1.0, 1.0, None]
    assert math_accuracy(["q"], ["\\boxed{5}"]) == [None]


def test_extract_answer_and_reference_answer() -> None:
    assert extract_answer("a \\boxed{1} b \\boxed{\\frac{2}{3}}") == "\\frac{2}{3}"
    assert extract_answer("x\n#### 1,000\n") == "1000"
    assert extract_answer("none") is None
    assert reference_answer("steps #### 72") == "72"
    assert reference_answer(7) == "7"
    assert reference_answer(None) is None


def test_format_wants_reasoning_then_a_final_boxed_answer() -> None:
    completions = ["2 + 2 = 4, so \\boxed{4}.", "\\boxed{4}", "4", "so \\boxed{4} and more words", "we get $\\boxed{4}$"]
    assert format(["q"] * 5, completions) == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_format_pattern_column_overrides_the_default() -> None:
    completions = ["<answer>4</answer>", "4"]
    patterns = [r"<answer>.*</answer>\s*$"] * 2
    assert format(["q"] * 2, completions, format_pattern=patterns) == [1.0, 0.0]
    assert make_format(r"^\d+$")(["q"] * 2, completions) == [0.0, 1.0]


def test_length_is_zero_up_to_target_then_falls_to_minus_one() -> None:
    completions = ["x" * 10, "x" * 15, "x" * 40]
    assert length(["q"] * 3, completions, target_length=[10] * 3) == [0.0, -0.5, -1.0]
    assert length(["q"] * 2, ["short", "x" * 20], target_length=[None, 10]) == [0.0, -1.0]
