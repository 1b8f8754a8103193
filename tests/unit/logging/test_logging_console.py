"""The console's pieces: the step line from logged metrics, undecodable bytes shown readably."""

from __future__ import annotations

from tandemrl.logging.console import lora_line, printable, readable_text, step_line, summary
from tandemrl.tasks.tiny import build_tokenizer


def test_step_line_shows_what_was_logged_and_derives_tokens_per_s():
    metrics = {"reward": 0.5, "reward_std": 0.1, "completions/mean_length": 8.0, "learning_rate": 1e-3,
               "rollout/generate_s": 0.2, "time/generate": 0.1, "time/train": 0.25, "step_time": 0.5}  # fmt: skip
    line = step_line(10, 150, metrics, num_rollouts=128, memory_gb=3.25, width=200)
    assert line == "step 10/150 | reward 0.500 ± 0.100 | len 8.0 | lr 1.00e-03 | 5.1k tok/s | mem 3.2G | 0.50s/step (gen 0.10 train 0.25)"


def test_a_full_step_line_wraps_at_80_columns_between_parts():
    metrics = {"reward": 0.25, "reward_std": 0.176, "completions/mean_length": 7.9, "entropy": 5.73, "kl": 0.00123,
               "grad_norm": 0.345, "learning_rate": 1e-3, "rollout/generate_s": 0.04, "time/generate": 0.04, "time/reward": 0.0,
               "time/train": 0.16, "time/sync": 0.0, "time/other": 0.01, "step_time": 0.21}  # fmt: skip
    lines = step_line(20, 150, metrics, num_rollouts=128, memory_gb=31.5).split("\n")
    assert len(lines) == 3 and all(len(line) <= 80 for line in lines), lines
    assert lines[0].startswith("step 20/150 | reward 0.250 ± 0.176") and lines[1].startswith("    ")
    assert " | ".join(line.strip() for line in lines).endswith("0.21s/step (gen 0.04 reward 0.00 train 0.16 sync 0.00 other 0.01)")


def test_undecodable_bytes_show_as_hex_and_control_characters_are_escaped():
    tokenizer = build_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["a", "â", "Ċ", "b"])  # byte-level: "â" is the lone byte 0xE2, "Ċ" is "\n"
    text = tokenizer.decode(ids)
    assert "\ufffd" in text
    assert readable_text(tokenizer, ids, text) == "a\\xe2\nb"
    assert printable("a\rb\nc") == "a\\rb\\nc" and printable("a\tb", keep_newlines=True) == "a\tb"


def test_undecodable_bytes_show_as_hex_in_a_conversation_with_turn_markers_too():
    """A tool rollout's conversation (the lookup task's samples) keeps its special tokens: its bytes that
    are not UTF-8 showed as U+FFFD, since only a text decoded without them was mapped back to bytes."""
    tokenizer = build_tokenizer()
    ids = [*tokenizer.convert_tokens_to_ids(["a", "â"]), tokenizer.convert_tokens_to_ids("<|im_end|>"), *tokenizer.convert_tokens_to_ids(["Ċ", "b"])]
    text = tokenizer.decode(ids)
    assert "\ufffd" in text and "<|im_end|>" in text
    assert readable_text(tokenizer, ids, text) == "a\\xe2<|im_end|>\nb"


def test_summary_names_best_and_last_reward_and_the_checkpoint():
    rows = [{"step": 1, "reward": 0.2}, {"step": 2, "reward": 0.9}, {"step": 3, "reward": 0.7}]
    lines = summary(rows, wall_s=75, run_dir="runs/x", checkpoint="runs/x/checkpoint-3")
    assert lines == ["done: 3 steps in 1m15s; reward last 0.700, best 0.900 (step 2)", "  checkpoint runs/x/checkpoint-3",
                     "  run directory runs/x  (plot it: tandem plot runs/x)"]  # fmt: skip


def test_the_summary_of_a_one_step_run_says_step():
    lines = summary([{"step": 1, "reward": 0.5}], wall_s=8, run_dir="runs/x", checkpoint=None)
    assert lines[0] == "done: 1 step in 8s; reward last 0.500, best 0.500 (step 1)"


def test_the_banner_says_what_lora_trains():
    line = lora_line(r=16, alpha=32.0, targets=("all-linear",), trained=32_832, whole=("model.norm",), whole_lr=1.0)
    assert line == "LoRA r 16, alpha 32 on all-linear (32.8k parameters trained); trained whole: model.norm, learning rate 1"
    assert lora_line(r=8, alpha=16.0, targets=("q_proj", "v_proj"), trained=10) == "LoRA r 8, alpha 16 on q_proj v_proj (10 parameters trained)"


def test_ids_past_the_tokenizers_vocab_do_not_break_the_completion_log():
    """A model whose vocab is wider than its tokenizer's (Qwen2.5's 152,064 rows over 151,665 tokens) can sample an id
    that has no token: convert_ids_to_tokens gives None for it, which readable_text met as a TypeError (issue 30's
    LoRA 7B run on the H200, at its first logged completion)."""
    tokenizer = build_tokenizer()
    ids = [*tokenizer.convert_tokens_to_ids(["a", "â"]), len(tokenizer) + 5]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=True)[-1] is None
    assert "\ufffd" in text  # the lone byte 0xE2: readable_text maps tokens back to bytes, and met the None
    assert readable_text(tokenizer, ids, text) == printable(text, keep_newlines=True)
