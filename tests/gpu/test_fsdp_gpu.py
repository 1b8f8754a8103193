"""`torchrun --nproc_per_node 2 -m tandemrl train` on two GPUs: FSDP2 (bf16 compute over float32 shards,
packed varlen attention, compiled layers, fused head), an engine per rank; the same run on one GPU, and a
resume of the two-GPU run on one GPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

FLAGS = ["--device", "cuda", "--num_prompts_per_step", "8", "--num_generations", "8", "--max_completion_length", "16", "--logging_steps", "1"]


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_gpus_train_as_one_and_resume_on_one(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "tandemrl", "train"]
    two = run([*torchrun, "--output_dir", str(tmp_path / "two"), "--max_steps", "4", "--save_steps", "2", *FLAGS])
    assert two.returncode == 0, two.stderr[-4000:]
    one = run([sys.executable, "-m", "tandemrl", "train", "--output_dir", str(tmp_path / "one"), "--max_steps", "4", *FLAGS])
    assert one.returncode == 0, one.stderr[-4000:]
    a, b = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    print("two GPUs:", [(round(r["loss"], 5), round(r["grad_norm"], 4), round(r["step_time"], 2)) for r in a])
    print("one GPU: ", [(round(r["loss"], 5), round(r["grad_norm"], 4), round(r["step_time"], 2)) for r in b])
    assert a[0]["reward"] == pytest.approx(b[0]["reward"], abs=0.05)  # bf16 engines may round a sample apart
    assert a[0]["grad_norm"] == pytest.approx(b[0]["grad_norm"], rel=0.05)
    assert all(r["sampling/sampling_logp_difference/mean"] < 0.05 for r in a)  # each rank's engine holds the gathered weights
    # two GPUs -> one GPU: the optimizer shards load on one rank
    (tmp_path / "two" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in a[:2]))
    shutil.rmtree(tmp_path / "two" / "checkpoint-4")
    resumed = run([sys.executable, "-m", "tandemrl", "train", "--output_dir", str(tmp_path / "two"), "--resume", "--max_steps", "3"])
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [r["step"] for r in metrics(tmp_path / "two")] == [1, 2, 3]
