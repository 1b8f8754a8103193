"""`tandem train` end to end on each family the engine gained (a real subprocess, CPU, ~10 s each): the banner
says the engine generates, and a step trains (e.g. Gemma 2: windows, soft caps, scaled embeddings; Phi-3:
fused checkpoint tensors, partial rotary, longrope; SmolLM3: layers without RoPE, yarn)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.unit.generation.engine.conftest import FAMILIES


@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3_text", "phi3-longrope", "olmo2", "smollm3-yarn"])
def test_a_train_step_runs_with_the_engine(tmp_path, name):
    from tandemrl.tasks.tiny import save_tiny

    model_dir = save_tiny(str(tmp_path / "model"), seed=1, **FAMILIES[name])
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i} and more", "solution": str(i)}) + "\n" for i in range(8)))
    args = [
        "train", "--model", model_dir, "--dataset", str(data), "--reward_funcs", "length", "--output_dir", str(tmp_path / "run"),
        "--max_steps", "1", "--num_prompts_per_step", "2", "--num_generations", "4", "--max_completion_length", "12",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run([sys.executable, "-m", "tandemrl", *args], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "generator: engine" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and math.isfinite(rows[0]["loss"])
