"""`torchrun --nproc_per_node 2 -m tandemrl train` on CPU (gloo, FSDP2): one launch, shared by every test
here, then one rank resumes it. Two ranks train as one rank on the same data; resume changes rank count.
A second launch turns every memory lever on: the same run, bit for bit. A third trains LoRA with one
engine split over both ranks (tensor parallel): one process's LoRA run within float tolerance."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TINY = ["--num_prompts_per_step", "4", "--num_generations", "4", "--max_completion_length", "6"]
FIRST_GOLDEN_REWARD = 0.1015625  # step 1 of test_train_cli's golden curve: the groups one process samples


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def torchrun_train(run_dir: Path, *flags: str) -> tuple[Path, subprocess.CompletedProcess]:
    """Two ranks train 2 steps, a checkpoint after each."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    args = ["--output_dir", str(run_dir), "--max_steps", "2", "--save_steps", "1", "--save_total_limit", "0", *TINY, *flags]
    return run_dir, run([*torchrun, "-m", "tandemrl", "train", *args])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    return torchrun_train(tmp_path_factory.mktemp("torchrun") / "run")


@pytest.fixture(scope="module")
def one_rank_step_2(two_ranks, tmp_path_factory) -> Path:
    """One process resumes the two-rank run's checkpoint-1 and trains its step 2 again."""
    run_dir, result = two_ranks
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(run_dir, resumed, ignore=shutil.ignore_patterns("checkpoint-2"))
    (resumed / "metrics.jsonl").write_text((run_dir / "metrics.jsonl").read_text().splitlines()[0] + "\n")
    done = run([sys.executable, "-m", "tandemrl", "train", "--output_dir", str(resumed), "--resume", "--max_steps", "2"])
    assert done.returncode == 0, done.stderr[-3000:]
    return resumed


def test_two_ranks_print_once_and_write_one_checkpoint_with_optimizer_shards(two_ranks):
    from transformers import AutoModelForCausalLM

    run_dir, result = two_ranks
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("tandem train:") == 1 and "2 ranks (FSDP2)" in result.stdout
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    assert sorted(p.name for p in (run_dir / "checkpoint-2" / "optimizer").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint-2")  # HF format, loadable as is


def test_two_ranks_sample_the_groups_one_process_samples(two_ranks):
    run_dir, result = two_ranks
    assert result.returncode == 0, result.stderr[-3000:]
    assert metrics(run_dir)[0]["reward"] == pytest.approx(FIRST_GOLDEN_REWARD, abs=1e-9)


def test_two_ranks_train_as_one_rank_on_the_same_data_and_resume_on_one(two_ranks, one_rank_step_2):
    from safetensors.torch import load_file

    two, one = metrics(two_ranks[0])[1], metrics(one_rank_step_2)[1]
    assert one["reward"] == two["reward"]  # the same groups, from the same checkpoint
    for key in ("loss", "grad_norm", "entropy", "clip_ratio/region_mean"):
        assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-6), key
    a = load_file(two_ranks[0] / "checkpoint-2" / "model.safetensors")
    b = load_file(one_rank_step_2 / "checkpoint-2" / "model.safetensors")
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_memory_levers_under_torchrun_leave_the_run_bit_identical(two_ranks, tmp_path):
    """Each rank's engine frees its KV cache and weights while training (refilled from the sharded policy,
    gathered in batches), and each rank's optimizer and weight shards wait on the CPU while it generates,
    a checkpoint written between: every metric and weight is the plain two-rank run's."""
    from safetensors.torch import load_file

    levers = ["--sleep_level", "2", "--offload_optimizer", "--offload_model", "--gc_collect_after_offload", "--move_model_batches", "2"]
    run_dir, result = torchrun_train(tmp_path / "run", *levers)
    assert result.returncode == 0, result.stderr[-3000:]
    plain = metrics(two_ranks[0])
    for got, expected in zip(metrics(run_dir), plain, strict=True):
        for key in ("reward", "loss", "grad_norm", "entropy", "policy_version"):
            assert got[key] == expected[key], key
    a = load_file(two_ranks[0] / "checkpoint-2" / "model.safetensors")
    b = load_file(run_dir / "checkpoint-2" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_with_an_engine_split_over_both_ranks_trains_as_one_rank(tmp_path):
    """LoRA under FSDP2 (adapters trained, the base with adapters off as the reference) and one engine
    split over both ranks (--tensor_parallel_size 2: rank 0 generates every group, the engine's weights
    refilled after a level-2 sleep with the merged policy gathered in batches) against one process with
    LoRA and an engine of its own: the same rollouts, the same steps within float tolerance."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tandemrl.tasks.tiny import save_tiny

    model = save_tiny(str(tmp_path / "tiny"), initializer_range=0.2)  # LoRA's test model (test_train_cli.py)
    lora = ["--model", model, "--task", "synthetic", "--lora_r", "16", "--learning_rate", "1e-2", "--beta", "0.1", "--lora_save_merged"]
    split_dir, result = torchrun_train(tmp_path / "split", *lora, "--tensor_parallel_size", "2", "--sleep_level", "2", "--move_model_batches", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "engines split over 2 ranks" in result.stdout
    one_dir = tmp_path / "one"
    one = run([sys.executable, "-m", "tandemrl", "train", "--output_dir", str(one_dir), "--max_steps", "2", "--save_steps", "2", *TINY, *lora])
    assert one.returncode == 0, one.stderr[-3000:]
    for got, expected in zip(metrics(split_dir), metrics(one_dir), strict=True):
        assert got["reward"] == pytest.approx(expected["reward"], abs=1e-9)  # the same tokens sampled
        for key in ("loss", "grad_norm", "entropy", "kl"):
            assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key
    a, b = (load_file(d / "checkpoint-2" / "adapter_model.safetensors") for d in (split_dir, one_dir))
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    AutoModelForCausalLM.from_pretrained(split_dir / "checkpoint-2" / "merged")  # gathered from every rank, loadable as is


def test_a_bad_flag_under_torchrun_is_one_line_from_rank_zero(tmp_path):
    """Every rank parses the same flags: rank 0 says the error, the others are stopped by torchrun unheard."""
    _, result = torchrun_train(tmp_path / "run", "--logprob_chunk_size", "0")
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if line.startswith("tandem train: error:")]
    assert said == ["tandem train: error: --logprob_chunk_size must be >= 1 and --warmup_steps >= 0, got 0 and 0"], result.stderr[-3000:]
