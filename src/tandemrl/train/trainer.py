"""The trainer: micro-batches -> loss -> backward -> clip -> step -> policy_version += 1.

Sequences are packed without padding into micro-batches by token budget; every micro-batch's loss is
weighted by counts of the whole optimizer step, so gradient accumulation equals one big batch.
On CUDA the forward and backward run on 16-bit compute weights refreshed once per optimizer step
(train/precision.py), with packed variable-length attention (train/attention.py), compiled decoder
layers, and the fused logprob head over trained positions only (algo/logprobs.py). On CPU in float32
the policy itself runs, with transformers' own attention: the reference path of every equivalence test.
Under torchrun the policy is sharded by FSDP2 and each rank trains its share of the step's groups, with
the normaliser counted over every rank (train/distributed.py), so W ranks step as one.

Legend: N packed tokens of a micro-batch, H hidden size, S sequences.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from tandemrl.algo.loss import combine_metrics, entropy_bonus, high_entropy_mask, logprob_mismatch_kl, policy_loss, token_weights
from tandemrl.algo.presets import AlgoConfig, loss_config
from tandemrl.train.batching import MicroBatches, PackedBatch, num_trained_targets, pack, plan_microbatches
from tandemrl.train.config import OffloadConfig, TrainerConfig
from tandemrl.train.distributed import (
    SINGLE, DataParallel, full_state_dict, full_tensor, load_full_state_dict, load_optimizer, load_whole_optimizer,
)  # fmt: skip
from tandemrl.train.forward import ForwardPlan, forward_plan, microbatch_budget
from tandemrl.train.lora import adapter_weights, is_lora, merged_weights, reference_policy, trained_whole, unwrap
from tandemrl.train.moe import aux_loss, hooks, prepare_forward, route_layout
from tandemrl.train.offload import TrainerOffload
from tandemrl.types import Batch, RolloutStatus, TokenTrace

log = logging.getLogger(__name__)


class Trainer:
    """Owns the policy's optimizer state and its policy_version (the count of optimizer steps)."""

    def __init__(
        self, config: TrainerConfig, algo: AlgoConfig, model: Any, *, max_steps: int, temperature: float = 1.0, top_k: int = 0,
        offload: OffloadConfig | None = None, dp: DataParallel = SINGLE, modules_to_save_lr: float | None = None,
    ) -> None:
        self.config = config
        self.algo = algo
        self.loss = loss_config(algo)
        self.model = model
        self.dp = dp
        self.device = next(model.parameters()).device
        self.policy_version = 0
        self.num_skipped_steps = 0  # optimizer steps skipped in a row for a non-finite loss or gradient
        self._filler: PackedBatch | None = None  # under FSDP, the step's zero-weight micro-batch (idle_batch)
        self._published: tuple[Any, list] | None = None  # (model, its named parameters): listed once, by published_weights
        # LoRA served beside the shared base (--lora_engine shared): the frozen weights the engine keeps a copy of;
        # None: the engine takes merged weights (set by cli/build.py once the engine holds the base)
        self.engine_unshared: set[str] | None = None
        # logprobs are taken under the sampling temperature (greedy sampling -> plain softmax)
        self.temperature = temperature if temperature > 0 else 1.0
        self.top_k = top_k  # > 0: the sampler's only filter, so each filtered row keeps its own top_k (algo/logprobs.py)
        if config.disable_dropout:
            disable_dropout(model)
        self.route_layout = route_layout(unwrap(model))  # an MoE policy's: the routes it replays (None: dense)
        self.plan: ForwardPlan = forward_plan(config, model, dp)
        # with LoRA the reference is the base itself: the adapters disabled (no second copy)
        self.reference = self.plan.frozen_copy(model) if algo.beta > 0 and not is_lora(model) else None
        self.plan.shard_policy(model)
        self.optimizer = build_optimizer(
            config, model, self.device, on_cpu=offload is not None and offload.cpu_optimizer, dp=dp, modules_to_save_lr=modules_to_save_lr,
            cpu_compute=offload.cpu_optimizer_compute if offload is not None else "auto",
        )  # fmt: skip
        total = max(1, max_steps * algo.num_iterations)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, config, total))
        self.offload = TrainerOffload(offload or OffloadConfig(), self)

    def train_step(self, batch: Batch) -> dict[str, float]:
        """num_iterations optimizer steps over one batch (this rank's share of it); returns the step's metrics."""
        if self.dp.enabled and self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # FSDP's collectives run on the current device of this worker thread
        groups = self.dp.share(batch.groups)
        traces = [self._trainable(r.trace, r.status) for g in groups for r in g.rollouts]
        advantages = [a for g in groups for a in g.advantages]
        # a trace with no trained target (masked truncated) adds nothing to the loss or its metrics: it is
        # not packed, so no micro-batch is left without a trained token (its backward would have no graph)
        kept = [i for i, t in enumerate(traces) if num_trained_targets(t) > 0]
        traces, advantages = [traces[i] for i in kept], [advantages[i] for i in kept]
        budget = microbatch_budget(self.config, self.model, self.device)
        plan = plan_microbatches([len(t.token_ids) for t in traces], budget)
        micro = MicroBatches(traces, advantages, plan, self.device, self.route_layout)  # packed as the loop reaches each
        num_tokens = self.dp.sum(micro.num_trained_tokens)  # trained tokens of every rank
        if num_tokens == 0:
            return {"train/num_trained_tokens": 0.0}
        counts = dict(num_sequences=sum(len(g.rollouts) for g in batch.groups), num_tokens=num_tokens)
        self._filler = idle_batch(batch, self.device) if self.dp.enabled else None
        # no-grad passes (reference, old policy) only when the loss needs them, in larger micro-batches
        scored = lambda model: self._score(model, traces, plan, budget * self.plan.no_grad_budget_factor)  # noqa: E731
        ref = self._reference_logprobs(scored)
        if self.algo.num_iterations > 1:  # the ratio's denominator: the policy before this batch's steps
            for m, old in zip(micro, scored(self.plan.forward_model(self.model, self.policy_version))):
                m.old_logprobs = old
        steps = [
            self._optimizer_step(micro, ref, counts, fresh_old=self.algo.num_iterations == 1)
            for _ in range(self.algo.num_iterations)
        ]
        return mean_over_iterations(steps)

    def _reference_logprobs(self, scored: Any) -> list[torch.Tensor] | None:
        if self.algo.beta == 0:
            return None
        if self.reference is not None:
            return scored(self.reference)
        model = self.plan.forward_model(self.model, self.policy_version)
        with reference_policy(model):
            return scored(model)

    def published_weights(self, *, changed_only: bool = False) -> Any:
        """(Hugging Face name, tensor) of the policy as the generators load it (with LoRA: merged; with
        `changed_only` only the weights training changes, for a generator holding the rest). Under
        mixed precision, the 16-bit compute twin refreshed for this version: half the bytes of the float32
        masters, the weights the trainer computes with, and no extra copy (the next forward's refresh
        then has nothing to do)."""
        if is_lora(self.model):
            if self.engine_unshared is not None:  # an engine serving beside the shared base: the adapters (train/lora.py)
                return adapter_weights(self.model, unshared=set() if changed_only else self.engine_unshared)
            return merged_weights(self.model, changed_only=changed_only)
        model = self.plan.forward_model(self.model, self.policy_version)
        if self._published is None or self._published[0] is not model:  # the same Parameter objects every step: listing
            self._published = (model, list(model.named_parameters()))  # them took ~1 ms of each 0.5B weight sync
        return self._published[1]

    def _optimizer_step(self, micro: MicroBatches, ref: list | None, counts: dict, *, fresh_old: bool) -> dict[str, float]:
        model = self.plan.forward_model(self.model, self.policy_version)
        model.train()
        self.plan.zero_grad(self.optimizer)
        sums: dict[str, torch.Tensor] = {}
        for i, m in enumerate(micro):
            loss, parts = self._micro_loss(model, m, None if ref is None else ref[i], counts, fresh_old=fresh_old)
            loss.backward()
            self.plan.after_backward()
            combine_metrics(sums, parts)  # summed on the device (min / max for the extremes): the loop never waits
        prepare_forward(unwrap(model), None)  # the filler has no routes (an MoE's last routes were another batch's)
        for _ in range(self.dp.max(len(micro)) - len(micro)):  # FSDP: as many passes as the busiest rank
            (self.plan.logprobs(model, self._filler, **self._head_options(False))[0].sum() * 0.0).backward()
        values = self.dp.combine_metrics(dict(zip(sums, torch.stack(list(sums.values())).tolist())) if sums else {})
        grad_norm = self._clip_gradients()
        lr = self.scheduler.get_last_lr()[0]
        if not (math.isfinite(grad_norm) and math.isfinite(values["loss"])):
            return {**self._skip_step(values, grad_norm), "learning_rate": lr}
        self.num_skipped_steps = 0
        self.offload.optimizer_ready()
        started = time.perf_counter()
        self.optimizer.step()  # on a GPU a launch (the device time lands in the next sync); --cpu_optimizer: the whole step
        optimizer_s = time.perf_counter() - started
        self.scheduler.step()
        self.policy_version += 1
        if self.algo.sync_ref_model and self.policy_version % self.algo.ref_model_sync_steps == 0:
            mix_into(self.reference, self.model, alpha=self.algo.ref_model_mixup_alpha)
        return {**values, "grad_norm": grad_norm, "learning_rate": lr, "policy_version": float(self.policy_version), "train/optimizer_step_s": optimizer_s}

    def _skip_step(self, sums: dict[str, float], grad_norm: float) -> dict[str, float]:
        """A non-finite loss or gradient is never applied: the weights stay as they are (no NaN reaches
        a checkpoint), and too many such steps in a row stop the run with the reason."""
        self.plan.zero_grad(self.optimizer)
        self.num_skipped_steps += 1
        log.warning("optimizer step skipped: loss %s, grad norm %s (%d in a row)", sums["loss"], grad_norm, self.num_skipped_steps)
        if self.num_skipped_steps >= self.config.max_skipped_steps:
            raise ValueError(
                f"{self.num_skipped_steps} optimizer steps in a row had a non-finite loss or gradient norm (last: loss "
                f"{sums['loss']}, grad norm {grad_norm}); lower --learning_rate or check the rewards (--max_skipped_steps)"
            )
        return {**sums, "grad_norm": grad_norm, "train/skipped_steps": 1.0, "policy_version": float(self.policy_version)}

    def _micro_loss(self, model: Any, m: PackedBatch, ref: torch.Tensor | None, counts: dict, *, fresh_old: bool):
        logprobs, entropy = self._forward(model, m)  # [N], [N]
        if fresh_old:  # one pass per batch: the ratio is 1 in value, its gradient is the policy gradient's
            m.old_logprobs = logprobs.detach()
        weights = token_weights(
            m.seq_index, m.loss_mask, aggregation=self.loss.aggregation, max_completion_length=self.algo.max_completion_length, **counts
        )  # [N]
        mean_weights = m.loss_mask.float() / counts["num_tokens"]  # [N]: per-token means over the step
        sequence_means = token_weights(
            m.seq_index, m.loss_mask, aggregation="seq_mean_token_mean", max_completion_length=1, **counts
        )  # [N]: per-sequence means over the step (clip metrics at sequence level, as TRL)
        keep = None
        if self.algo.top_entropy_quantile < 1:
            keep = high_entropy_mask(entropy, m.loss_mask, quantile=self.algo.top_entropy_quantile)  # [N]
        loss, metrics = policy_loss(
            m, logprobs, config=self.loss, weights=weights, ref_logprobs=ref, beta=self.algo.beta,
            tis_cap=self.algo.tis_cap, metric_weights=mean_weights, sequence_metric_weights=sequence_means, keep=keep,
        )
        if self.algo.entropy_coef:  # the bonus acts on the tokens the policy term trains
            mask = m.loss_mask if keep is None else keep
            loss = loss - self.algo.entropy_coef * entropy_bonus(entropy, mask, share=m.num_trained_tokens / counts["num_tokens"])
        if self.route_layout is not None:  # the router's load-balancing loss, a token-weighted mean over the step
            share = m.num_trained_tokens / counts["num_tokens"]
            aux = share * aux_loss(unwrap(model), hooks(unwrap(model)))
            if self.config.router_aux_loss_coef:
                loss = loss + self.config.router_aux_loss_coef * aux
            metrics["train/router_aux_loss"] = aux.detach()
            replayed = m.routes[:, 0, 0] >= 0 if m.routes is not None else torch.zeros_like(m.loss_mask)  # [N]
            metrics["train/routing_replay_fraction"] = (mean_weights * replayed).sum()  # of trained tokens: 1 with --routing_replay
        metrics["loss"] = loss.detach()
        metrics["entropy"] = (mean_weights * entropy.detach()).sum()
        # lesson 4: the trainer's and the sampler's logprobs of the same tokens at the same version
        difference = (m.old_logprobs - m.behaviour_logprobs).abs()  # [N]: TRL's sampling/sampling_logp_difference
        metrics["sampling/sampling_logp_difference/mean"] = (mean_weights * difference).sum()
        metrics["sampling/sampling_logp_difference/max"] = torch.where(m.loss_mask, difference, 0.0).max()
        metrics.update(logprob_mismatch_kl(m.old_logprobs, m.behaviour_logprobs, mean_weights, m.policy_versions == self.policy_version))
        return loss, metrics

    def _forward(self, model: Any, m: PackedBatch, *, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Logprobs and entropy [N] of the targets; only trained positions are scored (0 elsewhere)."""
        prepare_forward(unwrap(model), m.routes)  # an MoE policy replays the routes the sampler recorded
        logprobs, entropy = self.plan.logprobs(unwrap(model), m, **self._head_options(with_entropy))  # [T], [T]  (peft: its transformers model)
        trained = m.trained_index  # [T]
        zeros = torch.zeros(m.target_ids.shape, dtype=torch.float32, device=m.target_ids.device)  # [N]
        return zeros.index_put((trained,), logprobs), zeros.index_put((trained,), entropy)

    def _head_options(self, with_entropy: bool) -> dict:
        return dict(temperature=self.temperature, top_k=self.top_k, chunk_size=self.config.logprob_chunk_size, with_entropy=with_entropy)

    @torch.no_grad()
    def _score(self, model: Any, traces: list[TokenTrace], plan: list[list[int]], budget: int) -> list[torch.Tensor]:
        """Logprobs [N] of each training micro-batch in `plan`, computed in no-grad micro-batches of `budget` tokens."""
        lengths = [len(t.token_ids) for t in traces]
        per_trace: list[torch.Tensor] = [torch.empty(0)] * len(traces)
        no_grad_plan = plan_microbatches(lengths, budget)
        for idx in no_grad_plan:
            m = pack([traces[i] for i in idx], [0.0] * len(idx), self.device, self.route_layout)
            logprobs = self._forward(model, m, with_entropy=False)[0]
            for i, part in zip(idx, logprobs.split([lengths[i] for i in idx])):
                per_trace[i] = part
        prepare_forward(unwrap(model), None)
        for _ in range(self.dp.max(len(no_grad_plan)) - len(no_grad_plan)):  # FSDP: as many passes as the busiest rank
            self.plan.logprobs(model, self._filler, **self._head_options(False))
        self.plan.reshard(model)
        return [torch.cat([per_trace[i] for i in idx]) for idx in plan]

    def _trainable(self, trace: TokenTrace, status: RolloutStatus) -> TokenTrace:
        """Truncated rollouts are kept out of the loss when --mask_truncated_completions is set (DAPO)."""
        if status is RolloutStatus.TRUNCATED and self.algo.mask_truncated_completions:
            return dataclasses.replace(trace, loss_mask=[False] * len(trace.loss_mask))
        return trace

    def _clip_gradients(self) -> float:
        """clip_grad_norm_ in its two halves, so a sharded norm is made whole (one all-reduce) before it scales."""
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else math.inf
        params = list(self.model.parameters())
        norm = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return float(norm)

    def state_dict(self) -> dict[str, Any]:
        """Everything but, under FSDP, the optimizer (each rank writes its shard: checkpoint.save_checkpoint).
        A collective under FSDP (the reference is gathered whole)."""
        return {
            "optimizer": None if self.dp.enabled else self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "policy_version": self.policy_version,
            "num_skipped_steps": self.num_skipped_steps,  # the streak --max_skipped_steps stops at goes on after a resume
            "reference": None if self.reference is None else full_state_dict(self.reference, self.dp),
        }

    def load_state_dict(self, state: dict[str, Any], *, optimizer_shards: Path | None = None) -> None:
        """A checkpoint's state, written on any rank count: a sharded optimizer comes from `optimizer_shards`."""
        if optimizer_shards is not None:
            load_optimizer(self.model, self.optimizer, optimizer_shards)
        elif self.dp.enabled:
            load_whole_optimizer(self.model, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.policy_version = state["policy_version"]
        self.num_skipped_steps = state.get("num_skipped_steps", 0)  # a checkpoint written before it was saved: no streak
        if self.reference is not None and state["reference"] is not None:
            load_full_state_dict(self.reference, state["reference"], self.dp)
        self.plan.invalidate()  # the masters changed under the compute weights


def build_optimizer(
    config: TrainerConfig, model: Any, device: torch.device, *, on_cpu: bool, dp: DataParallel = SINGLE, modules_to_save_lr: float | None = None,
    cpu_compute: str = "auto",
) -> torch.optim.Optimizer:
    """AdamW over the trained parameters (with LoRA, only the adapters and the modules trained whole); with
    `on_cpu` its state in CPU memory and its math where `cpu_compute` says (--cpu_optimizer and
    --cpu_optimizer_compute, train/cpu_adam.py). `modules_to_save_lr`: the modules trained whole beside
    LoRA's adapters in a group of their own at that peak rate (the scheduler scales both groups alike)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    params: list[Any] = [p for _, p in named]
    whole = [p for name, p in named if trained_whole(name)] if is_lora(model) else []
    grouped = modules_to_save_lr is not None and bool(whole)
    if grouped:
        params = [{"params": [p for name, p in named if not trained_whole(name)]}, {"params": whole, "lr": modules_to_save_lr}]
    options = dict(lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon, weight_decay=config.weight_decay)
    if on_cpu:
        if dp.enabled:
            raise ValueError("--cpu_optimizer runs in one process; under torchrun FSDP2 already shards the optimizer state (drop the flag)")
        if grouped:
            raise ValueError("--cpu_optimizer steps every weight at one learning rate: drop --lora_modules_to_save_learning_rate (or --cpu_optimizer)")
        from tandemrl.train.cpu_adam import CpuAdamW

        return CpuAdamW(params, **options, compute=cpu_compute)
    return torch.optim.AdamW(params, **options, fused=device.type == "cuda")


def idle_batch(batch: Batch, device: torch.device) -> PackedBatch:
    """A micro-batch that an idle rank runs with zero weight, so it joins FSDP's gathers: the batch's
    shortest trace, every target trained (so the pass reaches every weight)."""
    trace = min(batch.traces(), key=lambda t: len(t.token_ids))
    return pack([dataclasses.replace(trace, loss_mask=[True] * len(trace.loss_mask))], [0.0], device)


def disable_dropout(model: Any) -> None:
    """Every dropout of `model` to 0, attention dropout included (TRL's disable_dropout)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


@torch.no_grad()
def mix_into(reference: Any, model: Any, *, alpha: float) -> None:
    """reference <- alpha * model + (1 - alpha) * reference, parameter by parameter (TR-DPO's soft update)."""
    for ref, new in zip(reference.parameters(), model.parameters()):
        ref.lerp_(new.to(ref.dtype), alpha)


def mean_over_iterations(steps: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of num_iterations optimizer steps: means over them (as TRL logs), the last version and rate.

    Example: [{"loss": 1.0, "policy_version": 1.0}, {"loss": 3.0, "policy_version": 2.0}] -> loss 2.0, version 2.0
    """
    last = steps[-1]
    keys = {key for step in steps for key in step}  # a skipped step (non-finite loss) logs fewer keys
    means = {key: sum(step[key] for step in steps if key in step) / sum(key in step for step in steps) for key in keys}
    return {**means, **{key: last[key] for key in ("policy_version", "learning_rate") if key in last}}


def lr_factor(step: int, config: TrainerConfig, total_steps: int) -> float:
    """Multiplier of the peak learning rate at optimizer step `step`: linear warm-up, then the schedule.

    Warm-up lasts --warmup_steps, else ceil(--warmup_ratio x total_steps).
    Example: warmup_steps=2, constant -> step 0: 0.5, 1: 1.0, 2: 1.0
    """
    warmup = config.warmup_steps or math.ceil(config.warmup_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    if config.lr_scheduler_type == "linear":
        return max(0.0, 1.0 - progress)
    if config.lr_scheduler_type == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return 1.0
