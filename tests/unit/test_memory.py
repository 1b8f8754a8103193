"""The memory plan (memory.py): its arithmetic against tensors of tiny models, and its choices for the
Qwen2.5 shapes on 24/80/141 GB GPUs."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from tandemrl.memory import GiB, PHASES, Levers, MemoryPlanError, ModelShape, Setup, budget, plan_memory, residents

QWEN = {  # Qwen2.5's published configs (hidden, intermediate, layers, heads, kv heads, tied)
    "0.5b": (896, 4864, 24, 14, 2, True),
    "1.5b": (1536, 8960, 28, 12, 2, True),
    "3b": (2048, 11008, 36, 16, 2, True),
    "7b": (3584, 18944, 28, 28, 4, False),
    "14b": (5120, 13824, 48, 40, 8, False),
    "32b": (5120, 27648, 64, 40, 8, False),
    "72b": (8192, 29568, 80, 64, 8, False),
}
GPUS = {"24": 23.6 * GiB, "80": 79.2 * GiB, "141": 139.8 * GiB}  # what torch reports as their total
WORKLOAD = Setup(num_sequences=128, prompt_tokens=128, max_model_len=384)  # 16 prompts x 8, 128 + 256 tokens


def qwen(name: str) -> ModelShape:
    h, i, layers, heads, kv, tied = QWEN[name]
    vocab = 151936 if tied else 152064
    return ModelShape(vocab_size=vocab, hidden_size=h, intermediate_size=i, num_layers=layers, num_heads=heads,
                      num_kv_heads=kv, head_dim=h // heads, tied=tied, qkv_bias=True)  # fmt: skip


def hf_config(**overrides):
    from transformers import Qwen2Config

    dims = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return Qwen2Config(**{**dims, **overrides})


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_is_the_models(tied):
    from transformers import AutoModelForCausalLM

    config = hf_config(tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    assert ModelShape.from_hf_config(config).num_parameters == sum(p.numel() for p in model.parameters())


def test_published_sizes():
    assert round(qwen("7b").num_parameters / 1e9, 2) == 7.62  # Qwen2.5-7B: 7.61B
    assert round(qwen("72b").num_parameters / 1e9, 1) == 72.7


def test_lora_parameters_are_peft_adapters():
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    config = hf_config()
    model = peft.get_peft_model(AutoModelForCausalLM.from_config(config), peft.LoraConfig(r=4, target_modules="all-linear"))
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert ModelShape.from_hf_config(config).lora_parameters(4) == adapters


def test_kv_bytes_are_the_engines_cache():
    from tandemrl.generation.engine.runner import ModelRunner  # noqa: F401  (the engine's layout: [L, 2, slots, K, D])

    config = hf_config()
    shape = ModelShape.from_hf_config(config)
    cache = torch.empty(config.num_hidden_layers, 2, 16, config.num_key_value_heads, 32 // 4, dtype=torch.bfloat16)
    assert shape.kv_bytes_per_token() * 16 == cache.nbytes


def test_training_residents_are_the_trainers_tensors():
    """Full fine-tuning on CPU (float32 masters, no compute copy): the plan's master weights, gradients and
    optimizer state are the bytes of the trainer's tensors after one AdamW step."""
    from transformers import AutoModelForCausalLM

    config = hf_config()
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    state = sum(t.nbytes for s in optimizer.state.values() for k, t in s.items() if k != "step")
    shape = ModelShape.from_hf_config(config)
    phases = residents(shape, dataclasses.replace(WORKLOAD, mixed=False, engine=False), Levers(), kv_tokens=0, microbatch_tokens=0)
    assert phases["training"]["master weights"] == sum(p.nbytes for p in model.parameters())
    assert phases["training"]["gradients"] == sum(p.grad.nbytes for p in model.parameters())
    assert phases["training"]["optimizer state"] == state


@pytest.mark.parametrize("compute", ["cpu", "gpu"])
def test_cpu_optimizer_staging_is_the_optimizers_device_buffers(compute):
    """--cpu_optimizer in either form: the plan's optimizer staging is the bytes of the buffers CpuAdamW keeps on
    the device (a tiny model: one chunk holds every parameter), and no optimizer state is on it."""
    from transformers import AutoModelForCausalLM

    from tandemrl.train.cpu_adam import CpuAdamW

    config = hf_config()
    optimizer = CpuAdamW(list(AutoModelForCausalLM.from_config(config).parameters()), lr=1e-3, compute=compute)
    setup = dataclasses.replace(WORKLOAD, mixed=False, engine=False, cpu_optimizer_compute=compute)
    phases = residents(ModelShape.from_hf_config(config), setup, Levers(cpu_optimizer=True), kv_tokens=0, microbatch_tokens=0)
    assert phases["training"]["optimizer staging"] == sum(t.nbytes for t in optimizer.staging()) > 0
    assert "optimizer state" not in phases["training"]


def test_cpu_optimizer_staging_of_each_form():
    """7B: the gpu form's 3 slots of a 32M-parameter chunk of both float32 moments (768 MiB), the cpu form's two
    64M-parameter float32 chunks of updates (512 MiB); auto is the gpu form for float32 masters and for LoRA's
    float32 adapters, the cpu form for bfloat16 masters. The constants are train/cpu_adam.py's."""
    from tandemrl import memory
    from tandemrl.train import cpu_adam

    assert (memory.CPU_OPTIMIZER_CHUNK, memory.CPU_OPTIMIZER_GPU_CHUNK, memory.CPU_OPTIMIZER_GPU_SLOTS) == (
        cpu_adam.CHUNK_NUMEL, cpu_adam.GPU_CHUNK_NUMEL, cpu_adam.GPU_SLOTS)  # fmt: skip
    shape = qwen("7b")

    def staging(**setup) -> int:
        phases = residents(shape, dataclasses.replace(WORKLOAD, **setup), Levers(cpu_optimizer=True), kv_tokens=0, microbatch_tokens=0)
        assert phases["generation"]["optimizer staging"] == phases["sync"]["optimizer staging"] == phases["training"]["optimizer staging"]
        return phases["training"]["optimizer staging"]

    assert staging() == staging(cpu_optimizer_compute="gpu") == staging(lora_rank=16, master_bytes=2) == 3 * 2 * 4 * 2**25 == 768 * 2**20
    assert staging(cpu_optimizer_compute="cpu") == staging(master_bytes=2, mixed=False) == 2 * 4 * 2**26 == 512 * 2**20
    assert staging(lora_rank=1, lora_targets=("q_proj",)) == 3 * 2 * 4 * shape.lora_parameters(1, ("q_proj",))  # fewer than a chunk


def test_lora_trains_a_16_bit_base_and_float32_adapters():
    shape = qwen("7b")
    phases = residents(shape, dataclasses.replace(WORKLOAD, lora_rank=16), Levers(), kv_tokens=0, microbatch_tokens=0)
    assert phases["training"]["base weights"] == 2 * shape.num_parameters
    assert "master weights" not in phases["training"] and "compute copy" not in phases["training"]
    assert phases["training"]["adapters + gradients"] == 8 * shape.lora_parameters(16)


# (shape, GPU GB, LoRA rank) -> the levers the plan turns on, or None: cannot fit (a MemoryPlanError)
CHOICES = {
    ("0.5b", "24", 0): [], ("0.5b", "80", 0): [], ("0.5b", "141", 0): [],
    ("1.5b", "24", 0): ["--sleep_level 2", "--cpu_optimizer"], ("1.5b", "80", 0): [], ("1.5b", "141", 0): [],
    ("7b", "24", 0): None, ("7b", "80", 0): None, ("7b", "141", 0): ["--sleep_level 2", "--cpu_optimizer"],
    ("7b", "24", 16): None, ("7b", "80", 16): [], ("7b", "141", 16): [],
    ("14b", "80", 16): [], ("14b", "141", 16): [], ("14b", "141", 0): None,
    ("32b", "80", 16): None, ("32b", "141", 16): None,  # two 16-bit copies (trainer, engine) + a sync's merged weights
    ("72b", "141", 16): None, ("72b", "141", 0): None,
}


@pytest.mark.parametrize("key", list(CHOICES))
def test_the_plan_turns_on_the_fewest_levers(key):
    name, gpu, rank = key
    setup = dataclasses.replace(WORKLOAD, lora_rank=rank)
    if CHOICES[key] is None:
        with pytest.raises(MemoryPlanError, match="does not fit"):
            plan_memory(qwen(name), setup, gpu_bytes=int(GPUS[gpu]))
        return
    plan = plan_memory(qwen(name), setup, gpu_bytes=int(GPUS[gpu]))
    assert plan.levers.names() == CHOICES[key]
    assert all(plan.peak(phase) <= plan.budget for phase in PHASES)
    assert plan.kv_tokens >= setup.max_model_len and plan.microbatch_tokens >= 1024


def test_seven_b_full_on_one_h200_sizes_kv_for_the_whole_round():
    plan = plan_memory(qwen("7b"), WORKLOAD, gpu_bytes=int(GPUS["141"]))
    assert plan.kv_tokens == 128 * 384 + 16
    assert "optimizer state" not in plan.phases["training"]  # on the CPU
    assert "engine weights" not in plan.phases["training"] and "KV cache" not in plan.phases["training"]  # asleep


def test_the_users_levers_stay_on():
    forced = dataclasses.replace(WORKLOAD, levers=Levers(offload_optimizer=True))
    plan = plan_memory(qwen("0.5b"), forced, gpu_bytes=int(GPUS["141"]))
    assert plan.levers.offload_optimizer and not plan.added.offload_optimizer
    assert "optimizer state" not in plan.phases["generation"]


def test_cannot_fit_is_one_line_naming_residents_and_fixes():
    with pytest.raises(MemoryPlanError) as error:
        plan_memory(qwen("7b"), WORKLOAD, gpu_bytes=int(GPUS["80"]))
    message = str(error.value)
    assert "\n" not in message and not re.search(r"-\d", message)  # no negative count
    assert "master weights 28.4" in message and "--lora_r 16" in message and "--nproc_per_node 2" in message


def test_gpu_memory_utilization_keeps_its_meaning_in_colocate():
    """A fraction of the whole GPU for the engine: what is in use when it starts counts against it; a
    fraction too small for one sequence is a MemoryPlanError, never a negative count."""
    shape = qwen("7b")
    lora = dataclasses.replace(WORKLOAD, lora_rank=16, engine_fraction=0.3)
    planned = plan_memory(shape, lora, gpu_bytes=int(GPUS["141"]))
    assert 0 < planned.kv_tokens <= 128 * 384 + 16
    with pytest.raises(MemoryPlanError, match="does not fit"):
        plan_memory(shape, dataclasses.replace(lora, engine_fraction=0.1), gpu_bytes=int(GPUS["141"]))


def test_budget_leaves_context_and_slack():
    assert 0 < budget(int(GPUS["80"])) < GPUS["80"] * 0.95
    assert budget(0) == 0


def test_a_mixture_of_experts_is_not_sized_as_dense():
    """The arithmetic counts dense layers: an MoE config is refused (the run goes unplanned), never undercounted."""
    from transformers import Qwen3MoeConfig

    with pytest.raises(ValueError, match="128 experts"):
        ModelShape.from_hf_config(Qwen3MoeConfig(num_experts=128))
