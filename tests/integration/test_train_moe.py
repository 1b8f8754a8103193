"""`tandem train --routing_replay` on a tiny Qwen3-MoE, as a user runs it (a real subprocess): the engine's
routes reach the trainer (every trained token replayed) and the load-balancing loss is logged and added."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def moe_run(tmp_path, launcher: list[str], env: dict) -> tuple[subprocess.CompletedProcess, list[dict], object]:
    """`tandem train --routing_replay --router_aux_loss_coef 0.01` on a tiny Qwen3-MoE: (result, its steps' metrics, run dir)."""
    from tandemrl.tasks.tiny import save_tiny

    model_dir = save_tiny(
        str(tmp_path / "moe"), model_type="qwen3_moe", seed=1, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, num_hidden_layers=2,
    )  # fmt: skip
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"hello there {i}"}) + "\n" for i in range(8)))
    run_dir = tmp_path / "run"
    args = [
        *launcher, "-m", "tandemrl", "train", "--model", model_dir, "--dataset", str(data), "--reward_funcs", "length",
        "--output_dir", str(run_dir), "--max_steps", "2", "--num_prompts_per_step", "2", "--num_generations", "4",
        "--max_completion_length", "6", "--routing_replay", "--router_aux_loss_coef", "0.01",
    ]  # fmt: skip
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "train/router_aux_loss" in row]
    assert len(steps) == 2
    assert all(abs(row["train/routing_replay_fraction"] - 1.0) < 1e-6 and 0 < row["train/router_aux_loss"] < 10 for row in steps)
    return result, steps, run_dir


def test_routing_replay_end_to_end(tmp_path):
    moe_run(tmp_path, [sys.executable], {})


@pytest.mark.slow
def test_routing_replay_under_torchrun_with_fsdp2(tmp_path):
    """Two ranks (torchrun, gloo, FSDP2 sharding the MoE policy's decoder layers, experts included): every trained
    token of each rank replayed, the load-balancing loss logged, a checkpoint written."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    result, _, run_dir = moe_run(tmp_path, launcher, {"OMP_NUM_THREADS": "1"})
    assert "2 ranks (FSDP2)" in result.stdout + result.stderr
    assert (run_dir / "checkpoint-2").is_dir()
