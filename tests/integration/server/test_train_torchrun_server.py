"""`torchrun --nproc_per_node 2 -m tandemrl train --rollout_mode server` on CPU (gloo, FSDP2) with a real
`tandem rollout` process, one for the module: rank 0 generates every group through the server and pushes
the weights both ranks gather. Two ranks train as one process through the same server, the server's
version follows every step, --max_staleness 1 keeps every token's lag <= 1, and a server killed mid-run
ends the run with one line (last: the server is gone after it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from rollout_helpers import start_server

TINY = ["--num_prompts_per_step", "4", "--num_generations", "4", "--max_completion_length", "6", "--max_prompt_length", "64"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def server(tiny_model_dir: str):
    s = start_server(tiny_model_dir, backend="engine")
    yield s
    s.stop()


def train_args(model_dir: str, server, run_dir: Path, *flags: str) -> list[str]:
    return [
        "-m", "tandemrl", "train", "--model", model_dir, "--rollout_mode", "server", "--rollout_server_urls", server.url,
        "--weight_sync_port", "0", "--weight_sync_timeout_s", "20", "--output_dir", str(run_dir), *TINY, *flags,
    ]  # fmt: skip


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_two_ranks_through_a_server_train_as_one_process_and_the_server_follows_each_step(tiny_model_dir, server, tmp_path):
    from safetensors.torch import load_file

    runs = {}
    for name, launcher, extra in [("one", [sys.executable], []), ("two", TORCHRUN, ["--move_model_batches", "3"])]:
        args = train_args(tiny_model_dir, server, tmp_path / name, "--max_steps", "2", "--save_steps", "2", *extra)
        result = subprocess.run([*launcher, *args], capture_output=True, text=True, timeout=300, env=ENV)
        assert result.returncode == 0, result.stderr[-3000:] + server.log_text()[-2000:]
        assert server.get("/ready").json()["policy_version"] == 2  # the run's last version is live on the server
        runs[name] = metrics(tmp_path / name)
    assert "2 ranks (FSDP2; rank 0 drives the rollout servers)" in result.stdout
    for one, two in zip(runs["one"], runs["two"], strict=True):
        assert one["reward"] == pytest.approx(two["reward"], abs=1e-9)  # the same tokens: version 1 reached the server whole
        assert one["policy_version"] == two["policy_version"] and two["rollout/policy_lag_max"] == 0
        for key in ("grad_norm", "entropy", "clip_ratio/region_mean"):
            assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-6), key
        assert one["loss"] == pytest.approx(two["loss"], abs=1e-6)
    a, b = (load_file(tmp_path / name / "checkpoint-2" / "model.safetensors") for name in ("one", "two"))
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_staleness_1_under_torchrun_then_a_killed_server_ends_the_run_with_one_line(tiny_model_dir, server, tmp_path):
    args = train_args(tiny_model_dir, server, tmp_path, "--max_steps", "500", "--max_staleness", "1", "--save_steps", "0")
    trainer = subprocess.Popen([*TORCHRUN, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 240
        while len(metrics(tmp_path)) < 3:
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()[1][-3000:]
            time.sleep(0.2)
        server.kill()
        _, stderr = trainer.communicate(timeout=120)
    finally:
        trainer.kill()
    rows = metrics(tmp_path)
    assert [r["policy_version"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[0]["rollout/policy_lag_max"] == 0 and all(r["rollout/policy_lag_max"] <= 1 for r in rows)
    assert trainer.returncode == 1, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("tandem train: error")]
    assert len(errors) == 1 and server.url.split("//")[1] in errors[0], stderr[-3000:]
    assert not re.search(r'File ".*tandemrl/', stderr), stderr[-3000:]  # no traceback of ours (torchrun prints its own summary)
    assert "Task was destroyed" not in stderr, stderr[-3000:]  # the rollout client cancelled its requests in flight at close


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_on_two_gpus_fsdp_ranks_push_over_nccl_to_a_server_beside_rank_1(tiny_model_dir, tmp_path):
    """Trainer ranks on GPUs 0 and 1 (FSDP2, bf16 compute), a server on GPU 1 beside rank 1 (small KV
    cache): rank 0 pushes the gathered weights over NCCL. Step 1 as one GPU's trainer through the same
    server; the server at the run's version; the weights reach it intact (lag-0 logprob mismatch)."""
    gpu_server = start_server(
        tiny_model_dir, "--dtype", "float32", "--gpu_memory_utilization", "0.2", backend="engine", device="cuda",
        env={"CUDA_VISIBLE_DEVICES": "1"}, timeout_s=180,
    )  # fmt: skip
    flags = ["--max_steps", "3", "--save_steps", "0", "--device", "cuda", "--no-torch_compile", "--weight_sync_backend", "nccl"]
    try:
        rows = {}
        for name, launcher, extra in [("one", [sys.executable], []), ("two", TORCHRUN, ["--max_staleness", "1", "--move_model_batches", "4"])]:
            started = time.monotonic()
            args = train_args(tiny_model_dir, gpu_server, tmp_path / name, *flags, *extra)
            result = subprocess.run([*launcher, *args], capture_output=True, text=True, timeout=200, env=ENV)
            assert result.returncode == 0, result.stderr[-4000:] + gpu_server.log_text()[-2000:]
            assert gpu_server.get("/ready").json()["policy_version"] == 3
            rows[name] = metrics(tmp_path / name)
            print(name, f"{time.monotonic() - started:.1f} s", [(round(r["grad_norm"], 4), round(r["step_time"], 3), round(r["time/sync"], 3)) for r in rows[name]])
    finally:
        gpu_server.stop()
    one, two = rows["one"], rows["two"]
    assert two[0]["reward"] == pytest.approx(one[0]["reward"], abs=1e-9)  # version 0 on the same server: the same tokens
    assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=0.05)
    assert [r["policy_version"] for r in two] == [1, 2, 3] and max(r["rollout/policy_lag_max"] for r in two) <= 1
    assert two[0]["train/logprob_mismatch_kl_lag0"] < 0.02  # version 0 pushed by rank 0 reached the server intact
