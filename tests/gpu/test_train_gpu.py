"""`tandem train` on a GPU: the embedded default with the trainer (float32 master weights, bfloat16
autocast) and the colocated engine (CUDA graphs, Triton) on one device. Prints where a step's time goes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_embedded_default_learns_on_the_gpu(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "tandemrl", "train", "--device", "cuda", "--output_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=590, env=env,
    )  # fmt: skip
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows]
    steady = rows[10:]  # past Triton compiles and first-shape warm-ups
    split = {k: sum(r[k] for r in steady) / len(steady) for k in ("step_time", "time/generate", "time/reward", "time/train", "time/sync")}
    print(f"default run on {torch.cuda.get_device_name()}: {elapsed:.0f}s for {len(rows)} steps, first reward {rewards[0]:.3f}, "
          f"last-10 mean {sum(rewards[-10:]) / 10:.3f}; mean s per step after step 10: {json.dumps({k: round(v, 4) for k, v in split.items()})}")  # fmt: skip
    assert rewards[0] <= 0.3
    assert sum(rewards[-10:]) / 10 >= 0.9
