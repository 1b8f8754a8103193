"""What `tandem train` prints, as a user reads it (a real subprocess, stdout not a terminal): the banner
before step 1, a full line every --logging_steps steps, sample completions, the end summary."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

TINY = ["--num_prompts_per_step", "4", "--num_generations", "4", "--max_completion_length", "6"]


def test_banner_step_lines_samples_and_summary(tmp_path):
    args = ["train", "--output_dir", str(tmp_path), "--max_steps", "4", "--logging_steps", "2", "--log_completions_steps", "4", *TINY]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-m", "tandemrl", *args], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    banner = "\n".join(lines[:4])
    for words in ("tandem:tiny (", "parameters) on task synthetic", "cpu, float32 weights", "4 prompts x 4 generations per step", "generator: engine",
                  "loss grpo", "learning rate 0.001", f"run directory {tmp_path}", f"tensorboard --logdir {tmp_path}"):  # fmt: skip
        assert words in banner, (words, banner)
    starts = [i for i, line in enumerate(lines) if line.startswith("step ") and " | " in line and "sample" not in line]
    assert [lines[i].split()[1] for i in starts] == ["1/4", "2/4", "4/4"]
    wrapped = itertools.takewhile(lambda line: line.startswith("    "), lines[starts[-1] + 1 :])
    last = lines[starts[-1]] + "".join(" | " + line.strip() for line in wrapped)
    for part in ("reward ", " ± ", "| len ", "| entropy ", "| grad_norm ", "| lr 1.00e-03", " tok/s", "s/step (gen "):
        assert part in last, (part, last)
    assert all(len(line) <= 80 for i in starts for line in lines[i : i + 3] if line.startswith(("step ", "    ")))
    samples = [line for line in lines if re.match(r"step 4 sample \d/4 ", line)]
    assert len(samples) == 4 and all("char_class_reward" not in line for line in samples)  # one function: no repeated total
    assert all("\ufffd" not in line and "\r" not in line for line in samples)
    summary = "\n".join(lines[-3:])
    assert re.search(r"done: 4 steps in \d+s; reward last \d\.\d{3}, best \d\.\d{3} \(step \d\)", summary), summary
    assert f"checkpoint {tmp_path}/checkpoint-4" in summary and f"tandem plot {tmp_path}" in summary
    assert (Path(tmp_path) / "checkpoint-4").is_dir()
