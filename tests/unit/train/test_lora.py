"""LoRA through peft: only the adapters train, the base never changes, the generators receive the merged
policy under plain names, and the reference is the base (adapters disabled), with no copy."""

from __future__ import annotations

import copy

import pytest
import torch

from tandemrl.algo.presets import AlgoConfig
from tandemrl.tasks.tiny import build_model, build_tokenizer
from tandemrl.train.config import LoraConfig, TrainerConfig
from tandemrl.train.lora import apply_lora, reference_policy
from tandemrl.train.trainer import Trainer
from tests.unit.train.test_trainer import make_batch

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def trained():
    base = build_model(build_tokenizer(), seed=1)
    plain = copy.deepcopy(base)
    trainer = Trainer(TrainerConfig(learning_rate=1e-2), AlgoConfig(beta=0.1), apply_lora(base, LoraConfig(lora_r=4)), max_steps=3)
    metrics = [trainer.train_step(make_batch(seed=step)) for step in range(3)]
    return plain, trainer, metrics


def test_only_the_adapters_train_and_the_base_is_untouched(trained):
    plain, trainer, _ = trained
    trained_names = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained_names and all(".lora_" in name for name in trained_names)
    assert sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"]) == sum(
        p.numel() for p in trainer.model.parameters() if p.requires_grad
    )
    with reference_policy(trainer.model):
        x = torch.tensor([[5, 6, 7, 8]])
        assert torch.equal(trainer.model(x).logits, plain(x).logits)  # adapters off: the base, bit for bit


def test_the_reference_is_the_base_without_a_copy(trained):
    _, trainer, metrics = trained
    assert trainer.reference is None
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-7) and metrics[-1]["kl"] > 1e-7


def test_published_weights_are_the_merged_policy_under_plain_names(trained):
    plain, trainer, _ = trained
    published = dict(trainer.published_weights())
    assert published.keys() == dict(plain.named_parameters()).keys()
    merged = copy.deepcopy(plain)
    merged.load_state_dict(published, strict=False)
    x = torch.tensor([[5, 6, 7, 8, 9]])
    torch.testing.assert_close(merged(x).logits, trainer.model(x).logits, rtol=1e-5, atol=1e-5)
    assert not torch.equal(merged(x).logits, plain(x).logits)


def test_adapters_on_the_head_are_refused():
    with pytest.raises(ValueError, match="leave out the embeddings and the head"):
        apply_lora(build_model(build_tokenizer(), seed=1), LoraConfig(lora_r=4, lora_target_modules=("q_proj", "lm_head")))


def test_a_16_bit_base_is_one_copy_with_float32_adapters():
    """The GPU layout on CPU: the frozen base stays bfloat16 (no float32 master, no compute copy), every
    trained tensor is float32 (modules_to_save too), adapters take the 16-bit input as is, and under
    16-bit autocast the adapters receive float32 gradients."""
    from tandemrl.memory import Levers, ModelShape, Setup, residents
    from tandemrl.train.lora import runs_under_autocast

    base = build_model(build_tokenizer(), seed=1).to(torch.bfloat16)
    model = apply_lora(base, LoraConfig(lora_r=4, lora_modules_to_save=("norm",)))
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trained = [p for p in model.parameters() if p.requires_grad]
    assert all(p.dtype == torch.bfloat16 for p in frozen) and all(p.dtype == torch.float32 for p in trained)
    assert runs_under_autocast(model)
    assert all(not m.cast_input_dtype_enabled for m in model.modules() if hasattr(m, "lora_A"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(torch.tensor([[5, 6, 7, 8]])).logits.float().logsumexp(-1).sum()
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in trained)
    # the plan's LoRA residents are these tensors' bytes (the adapters on every linear: all-linear)
    shape = ModelShape.from_hf_config(base.config)
    plain = residents(shape, Setup(lora_rank=4), Levers(), kv_tokens=0, microbatch_tokens=0)["training"]
    adapters = [p for n, p in model.named_parameters() if ".lora_" in n]
    assert plain["base weights"] == sum(p.nbytes for p in frozen)
    assert plain["adapters + gradients"] == 2 * sum(p.nbytes for p in adapters)


def test_after_a_step_only_the_changed_weights_move(trained):
    """changed_only: the adapted weights merged (and modules trained whole), nothing the step left as it
    was; loaded over the full policy they give the same weights as a full publish."""
    _, trainer, _ = trained
    full = dict(trainer.published_weights())
    changed = dict(trainer.published_weights(changed_only=True))
    assert changed and set(changed) < set(full)
    assert all(name.endswith(".weight") and "proj" in name for name in changed)  # adapted linears only
    assert "model.embed_tokens.weight" not in changed and not any("norm" in name for name in changed)
    for name, tensor in changed.items():
        assert torch.equal(tensor, full[name])


def test_modules_trained_whole_step_at_their_own_learning_rate():
    """--lora_modules_to_save_learning_rate: the norm trained whole is a group of its own at that rate (the
    adapters at --learning_rate); AdamW's first step moves each weight by about its rate. --cpu_optimizer
    (one rate) is refused in one line."""
    from tandemrl.train.trainer import build_optimizer

    model = apply_lora(build_model(build_tokenizer(), seed=1), LoraConfig(lora_r=4, lora_modules_to_save=("model.norm",)))
    trainer = Trainer(TrainerConfig(learning_rate=1e-3), AlgoConfig(), model, max_steps=1, modules_to_save_lr=0.5)
    norm = model.get_base_model().model.norm.modules_to_save["default"].weight
    adapters = [p for n, p in model.named_parameters() if ".lora_B." in n]  # A has no gradient while B is 0
    assert [group["lr"] for group in trainer.optimizer.param_groups] == [1e-3, 0.5]
    assert trainer.optimizer.param_groups[1]["params"] == [norm]
    before, first = norm.detach().clone(), [p.detach().clone() for p in adapters]
    trainer.train_step(make_batch(seed=0))
    assert (norm - before).abs().max().item() == pytest.approx(0.5, rel=0.05)
    assert max((p - q).abs().max().item() for p, q in zip(adapters, first)) == pytest.approx(1e-3, rel=0.05)
    with pytest.raises(ValueError, match="--cpu_optimizer steps every weight at one learning rate"):
        build_optimizer(TrainerConfig(), model, torch.device("cpu"), on_cpu=True, modules_to_save_lr=0.5)
