"""`tandem train`'s memory plan (cli/plan.py): --print_plan, the levers and sizes it applies, and the
one-line error of a run that cannot fit."""

from __future__ import annotations

import dataclasses

import pytest

from tandemrl.cli.main import main
from tandemrl.cli.plan import memory_setup, plan_for, with_plan
from tandemrl.cli.train import parse
from tandemrl.memory import GiB, MemoryPlanError
from tandemrl.pipeline.loop import memory_line
from tandemrl.train.config import OffloadConfig

SEVEN_B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064, tie_word_embeddings=False)  # fmt: skip
WORKLOAD = ["--num_prompts_per_step", "16", "--num_generations", "8", "--max_prompt_length", "128", "--max_completion_length", "256"]


@pytest.fixture(scope="module")
def seven_b(tmp_path_factory):
    """A directory holding only a Qwen2.5-7B config.json: the plan reads nothing else."""
    from transformers import Qwen2Config

    path = tmp_path_factory.mktemp("qwen7b")
    Qwen2Config(**SEVEN_B).save_pretrained(path)
    return str(path)


def test_print_plan_prints_every_phase_and_loads_no_weights(seven_b, capsys):
    assert main(["train", "--model", seven_b, "--dataset", "x.jsonl", *WORKLOAD, "--print_plan", "141"]) == 0
    out = capsys.readouterr().out
    assert "memory plan: 7.62B parameters, full fine-tuning" in out
    assert "turned on by the plan: --sleep_level 2 --cpu_optimizer" in out
    assert all(f"  {phase}" in out for phase in ("generation", "training", "sync"))


def test_a_run_that_cannot_fit_is_one_line_naming_what_would(seven_b, capsys):
    assert main(["train", "--model", seven_b, "--dataset", "x.jsonl", *WORKLOAD, "--print_plan", "80"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not fit" in err and "--lora_r 16" in err


def test_the_plan_applies_its_levers_and_sizes_where_the_user_left_them(seven_b):
    config, _ = parse(["--model", seven_b, *WORKLOAD])
    plan = plan_for(config, int(139.8 * GiB))
    planned = with_plan(config, plan)
    assert planned.generation.sleep_level == 2 and planned.offload.cpu_optimizer
    assert planned.engine.kv_cache_tokens == 128 * 384 + 16 and planned.trainer.max_tokens_per_microbatch == plan.microbatch_tokens
    given, _ = parse(["--model", seven_b, *WORKLOAD, "--max_tokens_per_microbatch", "2048", "--gpu_memory_utilization", "0.7"])
    kept = with_plan(given, plan_for(given, int(139.8 * GiB)))
    assert kept.trainer.max_tokens_per_microbatch == 2048 and kept.engine.kv_cache_tokens == 0  # the fraction sizes it
    too_little, _ = parse(["--model", seven_b, *WORKLOAD, "--gpu_memory_utilization", "0.5"])  # the issue's -44845 KV blocks
    with pytest.raises(ValueError, match="--gpu_memory_utilization 0 "):
        plan_for(too_little, int(139.8 * GiB))


def test_the_plan_counts_the_cpu_optimizers_form(seven_b):
    """--cpu_optimizer_compute reaches the plan: the gpu form (auto's choice here) keeps 3 slots of both moments
    on the GPU, the cpu form two chunks of updates."""
    staging = {}
    for compute in ("auto", "cpu"):
        config, _ = parse(["--model", seven_b, *WORKLOAD, "--cpu_optimizer_compute", compute])
        assert memory_setup(config).cpu_optimizer_compute == compute
        staging[compute] = plan_for(config, int(139.8 * GiB)).phases["training"]["optimizer staging"]
    assert staging == {"auto": 768 * 2**20, "cpu": 512 * 2**20}
    with pytest.raises(ValueError, match="--cpu_optimizer_compute: 'tpu' is not one of auto, cpu, gpu"):
        parse(["--cpu_optimizer_compute", "tpu"])
    with pytest.raises(ValueError, match="--cpu_optimizer_compute must be auto, cpu or gpu"):
        OffloadConfig(cpu_optimizer_compute="tpu")


def test_levers_the_run_forbids_are_never_turned_on(seven_b):
    config, _ = parse(["--model", seven_b, *WORKLOAD, "--lora_r", "16", "--max_staleness", "1"])
    assert "sleep_level" in memory_setup(config).frozen_levers
    assert plan_for(config, int(79.2 * GiB)).levers.sleep_level == 0


def test_measured_peaks_are_logged_beside_the_plans():
    line = memory_line({"memory/generation_peak_gib": 45.0, "memory/training_peak_gib": 90.0}, {"generation": 50.0, "training": 100.0, "sync": 40.0})
    assert line == "memory: generation peak 45.0 GiB, plan 50.0 (-10%); training peak 90.0 GiB, plan 100.0 (-10%)"


def test_the_tiny_default_plans_on_a_gpu_without_levers():
    config, _ = parse([])
    plan = plan_for(config, int(23.6 * GiB))
    assert not plan.levers.names() and plan.kv_tokens > 0
    assert dataclasses.replace(memory_setup(config), levers=plan.levers) is not None


def test_lora_7b_served_beside_the_trainers_base_plans_one_copy_of_it(seven_b):
    """--lora_engine shared on one GPU: the engine holds only its adapters, so each phase's peak is a bf16
    base (15.2 GB for 7.6B parameters) lower than with the engine's own merged copy."""
    shared, _ = parse(["--model", seven_b, *WORKLOAD, "--lora_r", "16", "--lora_engine", "shared"])
    merged, _ = parse(["--model", seven_b, *WORKLOAD, "--lora_r", "16", "--lora_engine", "merged"])
    a, b = plan_for(shared, int(139.8 * GiB)), plan_for(merged, int(139.8 * GiB))
    assert a.setup.engine_shares_base and not b.setup.engine_shares_base
    assert a.phases["generation"]["engine weights"] < 0.1 * GiB < 14 * GiB < b.phases["generation"]["engine weights"]
    for phase in ("generation", "training"):
        assert 14 * GiB < b.peak(phase) - a.peak(phase) < 15 * GiB
    assert "offload_model" in memory_setup(shared).frozen_levers  # the engine generates from the base: it stays on the GPU


@pytest.mark.parametrize("gpu_gib, form", [(139.8, "merged"), (39.5, "merged"), (23.6, "shared")])
def test_lora_engine_auto_keeps_a_merged_copy_where_memory_is_spare(seven_b, gpu_gib, form, monkeypatch):
    """auto: the merged copy (faster generation) where it costs no lever, KV or micro-batch; else the shared
    base. The choice reaches the config the build reads, and the banner's plan names it."""
    config, _ = parse(["--model", seven_b, *WORKLOAD, "--lora_r", "16"])
    plan = plan_for(config, int(gpu_gib * GiB))  # this workload on 24 GB: ~20 GiB shared, ~36 merged
    assert plan.setup.engine_shares_base == (form == "shared")
    chosen = with_plan(config, plan)
    assert chosen.lora.lora_engine == form and chosen.lora_engine_shares_base() == (form == "shared")
    assert ("beside the trainer's base" if form == "shared" else "merged copy") in plan.lines()[0]
    if form == "shared":  # the merged copy would have cost something here: a lever, KV, micro-batch, or it does not fit
        try:
            merged = plan_for(dataclasses.replace(config, lora=dataclasses.replace(config.lora, lora_engine="merged")), int(gpu_gib * GiB))
        except MemoryPlanError:
            merged = None
        assert merged is None or (merged.levers, merged.kv_tokens, merged.microbatch_tokens) != (plan.levers, plan.kv_tokens, plan.microbatch_tokens)
    import torch

    from tandemrl.cli import build

    monkeypatch.setattr(build, "gpu_bytes", lambda device: int(gpu_gib * GiB))  # the plan `tandem train` makes (no GPU touched)
    assert build._memory_plan(config, torch.device("cuda"), 1).setup.engine_shares_base == (form == "shared")
    servers, _ = parse(["--model", seven_b, *WORKLOAD, "--lora_r", "16", "--rollout_mode", "server", "--rollout_server_urls", "http://h:1"])
    assert with_plan(servers, plan_for(servers, int(gpu_gib * GiB))).lora.lora_engine == "auto"  # servers: adapter-only pushes stay on


def test_the_lora_engine_rule_says_why_shared_cannot_be():
    from transformers import Qwen3MoeConfig

    def rule(*flags, **kw):
        config, _ = parse(["--model", "m", "--lora_r", "8", *flags])
        return config.lora_engine_shares_base(**kw)

    assert rule() and not rule("--lora_engine", "merged") and not rule(num_ranks=2)
    assert not rule("--lora_engine", "shared", "--rollout_mode", "server", "--rollout_server_urls", "http://h:1")  # servers: their own rule
    assert not rule(hf_config=Qwen3MoeConfig(num_hidden_layers=1))
    for flags, kw, why in [
        (["--tensor_parallel_size", "2"], {}, "split over ranks"),
        ([], {"num_ranks": 2}, "torchrun rank"),
        (["--offload_model"], {}, "--offload_model"),
        ([], {"hf_config": Qwen3MoeConfig(num_hidden_layers=1)}, "dense models only"),
    ]:
        with pytest.raises(ValueError, match=why):
            rule("--lora_engine", "shared", *flags, **kw)
