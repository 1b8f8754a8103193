"""Asynchronous GRPO on two GPUs: the trainer on cuda:0, the in-process engine on cuda:1 (weights copied
device to device), --max_staleness 1. The embedded default must still learn, every token's lag stay <= 1,
and trainer and engine agree on the logprobs of the same weights (the lag-0 mismatch KL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]
DEADLINE_S = 240  # the run takes about a minute; past this it is stuck, and its last lines say where


def test_embedded_default_learns_with_the_engine_on_a_second_gpu_at_staleness_1(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # no torch.compile: it buys nothing on a 2-layer model and costs ~20 s of compiling before step 1
    run = subprocess.Popen(
        [sys.executable, "-m", "tandemrl", "train", "--device", "cuda", "--generator_device", "cuda:1",
         "--max_staleness", "1", "--no-torch_compile", "--heartbeat_s", "10", "--output_dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        output, _ = run.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        run.kill()
        output, _ = run.communicate()
        pytest.fail(f"tandem train did not finish within {DEADLINE_S} s; its last lines:\n{output[-3000:]}")
    assert run.returncode == 0, output[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows]
    steady = rows[10:]
    print(f"S=1, engine on cuda:1: last-10 mean reward {sum(rewards[-10:]) / 10:.3f}, mean step_time after step 10 "
          f"{sum(r['step_time'] for r in steady) / len(steady):.4f} s, lag-0 KL at step 1 {rows[0]['train/logprob_mismatch_kl_lag0']:.2e}")  # fmt: skip
    assert max(r["rollout/policy_lag_max"] for r in rows) == 1
    assert rows[0]["train/logprob_mismatch_kl_lag0"] < 0.02  # the weights reached cuda:1 intact
    assert sum(rewards[-10:]) / 10 >= 0.9
