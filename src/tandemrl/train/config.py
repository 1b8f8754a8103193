"""Leaf configs of the trainer and its checkpoints (torch-free, so `--help` stays instant)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tandemrl.memory import cpu_optimizer_compute
from tandemrl.types import steps_or_ratio


@dataclass(kw_only=True)
class TrainerConfig:
    """Optimizer, schedule and micro-batching of the policy."""

    learning_rate: float = 1e-6
    """Peak AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.99
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon (added to the second moment's root; TRL's and transformers' default)."""
    warmup_steps: int = 0
    """Linear warm-up steps from 0 to the peak learning rate."""
    warmup_ratio: float = 0.0
    """TRL's name: warm-up as a fraction of all optimizer steps (ceil); --warmup_steps wins when > 0."""
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    """After warm-up: constant, linear (to 0 at max_steps) or cosine (to 0 at max_steps)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    max_skipped_steps: int = 3
    """An optimizer step whose loss or gradient norm is inf or NaN is skipped (weights unchanged); stop
    with an error after this many in a row."""
    max_tokens_per_microbatch: int = 0
    """Token budget of one packed micro-batch (sequences packed without padding); 0 = auto: on a GPU chosen
    from free memory (at most 16384), on CPU 512. No-grad passes (reference, old policy) take 4x on a GPU."""
    logprob_chunk_size: int = 2048
    """Rows of logits computed at once: bounds float32 logits memory to chunk x vocab (2048 x 152k: 1.2 GB)."""
    torch_compile: bool = True
    """On a GPU, torch.compile each decoder layer and the logprob head (the first steps pay the compile time)."""
    triton_logprobs: bool = True
    """On a GPU with triton installed, the logprob head's per-row statistics (log-sum-exp, logprob, entropy)
    and its logits' gradient run as single-pass Triton kernels instead of the (compiled) torch path, and
    its weight's float32 gradient accumulates inside the matmul (faster: bench/RESULTS.md, bench/train.py).
    `--no-triton_logprobs` runs the torch path."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (less memory, more time)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Policy (master) weights and optimizer state: float32, or bfloat16 (then updates below bfloat16's
    resolution, e.g. lr 1e-6 on O(1e-2) weights, round to nothing)."""
    bf16: bool = True
    """On GPU, run forward and backward on bfloat16 copies of float32 --dtype weights, refreshed once per
    optimizer step; gradients accumulate in float32."""
    device: str = "auto"
    """Training device: auto (cuda if present), cpu or cuda."""
    ddp_timeout: int = 1800
    """TRL's name: under torchrun, seconds any collective among the ranks waits for the others: a rank that
    stopped answering (hung, stopped, cut off) ends the run past it. Keep it above what one rank can run
    ahead of the others (a step's generation and rewards; an evaluation, which rank 0 runs alone)."""
    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts policies: weight of the router's load-balancing loss added to the policy loss
    (transformers' router_aux_loss_coef; 0 = off, the loss is still logged as train/router_aux_loss)."""
    disable_dropout: bool = True
    """TRL's name: set every dropout of the policy (and reference) to 0, so the logprobs of training equal
    those of sampling. On by default here (TRL's default is off)."""

    def __post_init__(self) -> None:
        if not 0 < self.learning_rate < math.inf:  # inf was caught only by the checkpoint guard, NaN not at all
            raise ValueError(f"--learning_rate must be a finite number > 0, got {self.learning_rate}")
        if not 0 <= self.max_grad_norm < math.inf:  # NaN silently meant no clipping
            raise ValueError(f"--max_grad_norm must be a finite number >= 0 (0 = no clipping), got {self.max_grad_norm}")
        if not 0 <= self.adam_epsilon < math.inf:
            raise ValueError(f"--adam_epsilon must be a finite number >= 0, got {self.adam_epsilon}")
        for name in ("adam_beta1", "adam_beta2"):  # torch's own words named no flag: "Invalid beta parameter at index 0"
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        if self.logprob_chunk_size < 1 or self.warmup_steps < 0:  # 0 was "range() arg 3 must not be zero"; -1 taken
            raise ValueError(f"--logprob_chunk_size must be >= 1 and --warmup_steps >= 0, got {self.logprob_chunk_size} and {self.warmup_steps}")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"--router_aux_loss_coef must be >= 0, got {self.router_aux_loss_coef}")
        if self.lr_scheduler_type not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr_scheduler_type must be constant, linear or cosine, got {self.lr_scheduler_type!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.ddp_timeout < 1:
            raise ValueError(f"--ddp_timeout must be >= 1 (seconds), got {self.ddp_timeout}")
        if self.max_skipped_steps < 1:
            raise ValueError("--max_skipped_steps must be >= 1")
        if self.max_tokens_per_microbatch < 0:
            raise ValueError("--max_tokens_per_microbatch must be >= 0 (0 = chosen from free memory)")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"--warmup_ratio must be in [0, 1), got {self.warmup_ratio}")


@dataclass(kw_only=True)
class CheckpointConfig:
    """Where the run lives and how it is saved and resumed."""

    output_dir: str = ""
    """Run directory (default: runs/<date-time>, with runs/latest pointing at it)."""
    save_steps: float = 50
    """Save a checkpoint every this many steps (below 1: TRL's ratio of the run's steps; 0 = only at the end)."""
    save_total_limit: int = 2
    """Keep at most this many checkpoints (oldest deleted first; 0 = keep all)."""
    resume: bool = False
    """Continue from the newest complete checkpoint in --output_dir, with its flags; a flag given that changes what
    the run computes (model, data, seed, learning rate, loss, batch shape, lengths, sampling, precision) is refused."""
    resume_allow_changed_flags: bool = False
    """--resume with flags that change what the run computes, each named in a warning line (the rest, e.g.
    --max_steps, logging, saving, placement and memory levers, may change without it)."""

    def __post_init__(self) -> None:
        self.save_steps = steps_or_ratio("save_steps", self.save_steps, zero="only at the end")
        if self.save_total_limit < 0:
            raise ValueError(f"--save_total_limit must be >= 0 (0 = keep all), got {self.save_total_limit}")


@dataclass(kw_only=True)
class OffloadConfig:
    """Colocate memory levers of the trainer: what leaves the GPU while the engine generates (train/offload.py)."""

    offload_optimizer: bool = False
    """During generation, keep the optimizer state (AdamW moments) in pinned CPU memory; it comes back for
    training on a side stream, overlapped with the forward, and is waited for before the optimizer step."""
    offload_model: bool = False
    """During generation, keep the policy's weights (and the reference model's) in pinned CPU memory; the
    16-bit compute copy and the gradients are dropped, not copied (rebuilt from the weights for training)."""
    cpu_optimizer: bool = False
    """The optimizer state (AdamW moments, 8 bytes a parameter) lives in CPU memory, never on the GPU, which keeps
    the float32 masters and gradients; the optimizer step streams it in chunks whose copies overlap the math
    (ZeRO-Offload's split; one process only; --cpu_optimizer_compute says where the math runs). The memory plan
    turns it on when full fine-tuning does not fit."""
    cpu_optimizer_compute: Literal["auto", "cpu", "gpu"] = "auto"
    """Where --cpu_optimizer's AdamW math runs. gpu: each chunk's moments come from pinned CPU memory to the GPU
    and go back after the fused AdamW kernel (16 bytes a parameter cross PCIe, both directions at once; the CPU
    computes nothing); cpu: the gradients go to the CPU, which computes the update (8 bytes a parameter cross
    PCIe, but the step is bound by the host memory's bandwidth). auto: gpu for float32 weights on a GPU, else cpu
    (gpu needs float32 weights)."""
    gc_collect_after_offload: bool = False
    """After each offload, gc.collect() and hand the freed GPU memory back to the driver (empty_cache), so
    other processes see it too; otherwise it stays in PyTorch's cache for the engine of this process."""

    @property
    def enabled(self) -> bool:
        return self.offload_optimizer or self.offload_model

    def __post_init__(self) -> None:
        cpu_optimizer_compute(self.cpu_optimizer_compute, float32=True, on_gpu=False)  # an unknown value: its one-line error


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA through peft: only low-rank adapters train; the engine serves them beside the trainer's base or
    merged into a copy of its own (--lora_engine; train/lora.py)."""

    lora_r: int = 0
    """LoRA rank; 0 = off (every weight trains)."""
    lora_alpha: float = 32.0
    """LoRA scaling numerator: adapters are scaled by lora_alpha / lora_r."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input; needs --disable_dropout false (which otherwise sets it to 0)."""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """Module names that get adapters (e.g. q_proj v_proj), or all-linear (every linear layer but the head)."""
    lora_modules_to_save: tuple[str, ...] = ()
    """Modules trained whole beside the adapters and saved with them (peft's modules_to_save), e.g. norm
    (every module whose name ends so: the RMSNorms; their weights scale the logits). Not the embeddings
    or the head: the fused logprob head reads their weights directly."""
    lora_modules_to_save_learning_rate: float | None = None
    """Peak learning rate of the modules trained whole (--lora_modules_to_save); null = --learning_rate.
    AdamW moves every weight by about the learning rate a step: a norm's weights are ~1, an adapter's ~0.1
    or less, so a rate that suits the adapters barely moves a norm. The embedded default's LoRA recipe
    trains its final norm (which sets the logits' scale) at 1.0."""
    lora_engine: Literal["auto", "shared", "merged"] = "auto"
    """How a colocated engine serves the LoRA policy. shared: from the trainer's own frozen base tensors, the
    adapters applied beside them (one copy of the base on the GPU; each sync moves only the adapters);
    merged: from a copy of its own with the adapters merged in (each sync moves the adapted weights; it
    generates faster, without the adapters' extra matmuls). auto, on a GPU: merged where the memory plan has
    room for the copy at no other cost (the same levers, KV cache and micro-batch), else shared where it can
    be (the engine on the trainer's device, one process, --tensor_parallel_size 1, a dense model, no
    --offload_model); without a plan (CPU) shared where it can be. The banner's plan says which. With
    rollout servers, auto and shared push only the adapters after the first update where every server
    applies them (tandem rollout --max_lora_rank)."""
    lora_save_merged: bool = False
    """Checkpoints hold the adapter (peft format); also write the merged model, loadable by transformers as
    is, to checkpoint-N/merged."""

    @property
    def enabled(self) -> bool:
        return self.lora_r > 0

    def __post_init__(self) -> None:
        if self.lora_engine not in ("auto", "shared", "merged"):
            raise ValueError(f"--lora_engine must be auto, shared or merged, got {self.lora_engine!r}")
        if self.lora_r < 0 or not self.lora_target_modules or not 0 <= self.lora_dropout < 1:
            raise ValueError("--lora_r must be >= 0, --lora_target_modules non-empty and --lora_dropout in [0, 1)")
        rate = self.lora_modules_to_save_learning_rate
        if rate is not None and not 0 < rate < math.inf:
            raise ValueError(f"--lora_modules_to_save_learning_rate must be a finite number > 0 (or null: --learning_rate), got {rate}")
