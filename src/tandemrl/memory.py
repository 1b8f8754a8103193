"""The memory plan: what each phase of a colocated step holds on one GPU, computed before anything loads.

Pure arithmetic (no torch): from the model's shape (its Hugging Face config), the dtypes, LoRA, the
levers, the batch shape and max_model_len, every resident of each phase (generation, training, sync)
in bytes, the levers that make the run fit (the fewest, cheapest first), the KV cache and the training
micro-batch. The peaks are what torch's allocator counts (max_memory_allocated); the budget they must
fit is the GPU less the CUDA context and the allocator's slack. Invariant: a plan that is returned fits
every phase; one that cannot is a one-line `MemoryPlanError` naming the largest residents and what
would make it fit; no size is ever negative.

Example: a Qwen2.5-7B shape, full fine-tuning, 16 x 8 rollouts of 128 + 256 tokens on a 141 GB GPU ->
levers sleep_level 2 + optimizer state on CPU; training peak ~95 GiB (float32 masters and gradients,
16-bit compute copy, activations of the micro-batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

GiB = 2**30
CONTEXT_BYTES = int(1.5 * GiB)  # CUDA context, cuBLAS workspaces, compiled kernels: outside the allocator's counts
SLACK = 0.05  # of the GPU: what the caching allocator holds beyond what is allocated (fragmentation)
MAX_MICROBATCH_TOKENS = 16384
MIN_MICROBATCH_TOKENS = 1024
ACTIVATION_SHARE = 0.15  # of the budget: past it a larger micro-batch buys no speed, only memory
PHASES = ("generation", "training", "sync")
# --cpu_optimizer's sizes, defined here for the plan and train/cpu_adam.py alike (this module imports no torch)
CPU_OPTIMIZER_CHUNK = 1 << 26  # the cpu form: 64M float32 values (256 MB) a chunk: large copies, small staging
CPU_OPTIMIZER_GPU_CHUNK = 1 << 25  # the gpu form: 32M values a chunk, 256 MB of moments a slot
CPU_OPTIMIZER_GPU_SLOTS = 3  # chunk i-1's moments going out, i's in the kernel, i+1's coming in: neither copy waits
CPU_OPTIMIZER_COMPUTES = ("auto", "cpu", "gpu")


class MemoryPlanError(ValueError):
    """The run cannot fit this GPU with any lever; the message says what would make it fit."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes a plan needs, read from a Hugging Face config (Llama/Qwen-family names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = False

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """Raises ValueError for a config this arithmetic does not describe (mixtures of experts, nested
        text configs): the run then goes unplanned."""
        get = lambda name, default=None: getattr(config, name, default)  # noqa: E731
        experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts")
        missing = [n for n in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if not get(n)]
        if experts or missing:
            reason = f"{experts} experts" if experts else f"no {', '.join(missing)}"
            raise ValueError(f"the memory plan cannot size a {get('model_type', 'this')} model ({reason})")
        heads = get("num_attention_heads")
        return cls(
            vocab_size=get("vocab_size"), hidden_size=get("hidden_size"), num_layers=get("num_hidden_layers"),
            intermediate_size=get("intermediate_size") or 4 * get("hidden_size"), num_heads=heads,
            num_kv_heads=get("num_key_value_heads") or heads, head_dim=get("head_dim") or get("hidden_size") // heads,
            tied=bool(get("tie_word_embeddings", False)), qkv_bias=get("model_type") == "qwen2" or bool(get("attention_bias", False)),
        )  # fmt: skip

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear of one decoder layer, by its Hugging Face module name."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_parameters(self) -> int:
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim if self.qkv_bias else 0
        return sum(a * b for a, b in self.linears().values()) + bias + 2 * self.hidden_size

    @property
    def num_parameters(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied else 2)
        return embeddings + self.num_layers * self.layer_parameters() + self.hidden_size

    def lora_parameters(self, rank: int, targets: tuple[str, ...] = ("all-linear",)) -> int:
        every = targets == ("all-linear",)
        per_layer = sum(rank * (a + b) for name, (a, b) in self.linears().items() if every or name in targets)
        return self.num_layers * per_layer

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def activation_bytes_per_token(self, *, checkpointing: bool = False) -> int:
        """What backward keeps per trained token (16-bit, compiled decoder layers, flash attention): per
        layer its input, two norm outputs and the residual, q/k/v and the attention output, gate, up and
        their product, the attention's float32 log-sum-exp; with checkpointing only each layer's input
        (plus one layer recomputed). Embedding, final norm and the gathered hidden states besides."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        layer = 2 * (4 * h + 2 * q + 2 * kv + 3 * i) + 4 * (self.num_heads + 2)
        outside = 2 * 4 * h
        if checkpointing:
            return self.num_layers * 2 * h + layer + outside
        return self.num_layers * layer + outside


@dataclass(frozen=True, kw_only=True)
class Levers:
    """The colocate memory levers (each a flag of `tandem train`)."""

    sleep_level: int = 0
    offload_optimizer: bool = False
    offload_model: bool = False
    gradient_checkpointing: bool = False
    cpu_optimizer: bool = False  # the optimizer state lives on the CPU, streamed through the step (train/cpu_adam.py)

    def union(self, other: Levers) -> Levers:
        return Levers(
            sleep_level=max(self.sleep_level, other.sleep_level), offload_optimizer=self.offload_optimizer or other.offload_optimizer,
            offload_model=self.offload_model or other.offload_model, cpu_optimizer=self.cpu_optimizer or other.cpu_optimizer,
            gradient_checkpointing=self.gradient_checkpointing or other.gradient_checkpointing,
        )  # fmt: skip

    def names(self) -> list[str]:
        """The flags that turn these levers on. Example: Levers(sleep_level=2, cpu_optimizer=True) -> ["--sleep_level 2", "--cpu_optimizer"]"""
        names = [f"--sleep_level {self.sleep_level}"] if self.sleep_level else []
        return names + [f"--{f.name}" for f in dataclasses.fields(self) if f.name != "sleep_level" and getattr(self, f.name)]


# cheapest first: sleeping frees the engine's memory for a re-publish the step makes anyway; the optimizer
# state on the CPU costs its transfer each step; recomputing activations costs ~1/3 of training
_FULL = [
    Levers(), Levers(sleep_level=1), Levers(sleep_level=2), Levers(sleep_level=2, offload_optimizer=True),
    Levers(sleep_level=2, cpu_optimizer=True), Levers(sleep_level=2, cpu_optimizer=True, offload_model=True),
    Levers(sleep_level=2, cpu_optimizer=True, gradient_checkpointing=True),
    Levers(sleep_level=2, cpu_optimizer=True, offload_model=True, gradient_checkpointing=True),
]
_LORA = [
    Levers(), Levers(sleep_level=1), Levers(sleep_level=2), Levers(sleep_level=2, offload_model=True),
    Levers(sleep_level=2, gradient_checkpointing=True), Levers(sleep_level=2, offload_model=True, gradient_checkpointing=True),
]


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One process's run as the plan sees it (cli/ builds it from TrainConfig)."""

    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ("all-linear",)
    master_bytes: int = 4  # float32 masters (2: --dtype bfloat16)
    mixed: bool = True  # a 16-bit compute copy of float32 masters (--bf16 on a GPU)
    engine: bool = True  # a colocated engine shares the GPU
    engine_shares_base: bool = False  # LoRA: the engine serves from the trainer's frozen base tensors
    reference: bool = False  # --beta > 0 without LoRA: a frozen copy of the policy
    num_ranks: int = 1  # FSDP2 shards the masters, gradients and optimizer state over this many
    num_sequences: int = 128  # of one generation round (prompts x generations x steps per round)
    group_size: int = 8  # sequences sharing a prompt (its prefill is computed once: prefix sharing)
    prompt_tokens: int = 512
    max_model_len: int = 768
    block_size: int = 16
    prefill_tokens: int = 16384  # the engine's --max_num_batched_tokens
    logprob_chunk_size: int = 2048
    levers: Levers = field(default_factory=Levers)  # those the user turned on (the plan may add more)
    frozen_levers: tuple[str, ...] = ()  # Levers fields the plan may not turn on (e.g. sleep_level under --max_staleness)
    choose_levers: bool = True  # False: exactly `levers` (the plan only sizes)
    microbatch_tokens: int = 0  # 0 = sized by the plan
    kv_tokens: int = 0  # 0 = sized by the plan
    engine_fraction: float = 0.0  # --gpu_memory_utilization in colocate: the engine's share (weights + KV), 0 = planned
    cpu_optimizer_compute: str = "auto"  # where --cpu_optimizer's math runs (auto: gpu for float32 trained weights)


@dataclass(kw_only=True)
class MemoryPlan:
    """Residents of each phase in bytes, the levers, the KV cache and the micro-batch. Written by `plan_memory`."""

    shape: ModelShape
    setup: Setup
    gpu_bytes: int
    levers: Levers
    added: Levers  # the levers the plan turned on beyond the user's
    kv_tokens: int
    microbatch_tokens: int
    phases: dict[str, dict[str, int]]  # phase -> resident -> bytes

    @property
    def budget(self) -> int:
        return budget(self.gpu_bytes)

    def peak(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    def lines(self) -> list[str]:
        """The plan in a few lines (the banner and --print_plan)."""
        gib = lambda n: f"{n / GiB:.1f} GiB" if n >= GiB // 10 else f"{n / 2**20:.1f} MiB"  # noqa: E731
        p = self.shape.num_parameters
        count = f"{p / 1e9:.2f}B" if p >= 1e8 else f"{p / 1e6:.2f}M"
        what = f"LoRA r{self.setup.lora_rank}" if self.setup.lora_rank else "full fine-tuning"
        if self.setup.lora_rank and self.setup.engine:
            what += " (engine beside the trainer's base)" if self.setup.engine_shares_base else " (engine's own merged copy)"
        levers = " ".join(self.levers.names()) or "none"
        added = f" (turned on by the plan: {' '.join(self.added.names())})" if self.added.names() else ""
        lines = [
            f"memory plan: {count} parameters, {what}, GPU {gib(self.gpu_bytes)} (budget {gib(self.budget)} after context and allocator slack)",
            f"  levers: {levers}{added}; KV cache {self.kv_tokens} tokens, micro-batch {self.microbatch_tokens} tokens",
        ]
        for phase in PHASES:
            parts = ", ".join(f"{name} {gib(n)}" for name, n in sorted(self.phases[phase].items(), key=lambda kv: -kv[1]) if n)
            lines.append(f"  {phase:<10} peak {gib(self.peak(phase)):>9}: {parts}")
        return lines


def budget(gpu_bytes: int) -> int:
    """What the allocator may hand out: the GPU less the CUDA context and the allocator's slack."""
    return max(0, int(gpu_bytes * (1 - SLACK)) - CONTEXT_BYTES)


def plan_memory(shape: ModelShape, setup: Setup, *, gpu_bytes: int) -> MemoryPlan:
    """The fewest levers (cheapest first) with which every phase fits, and the sizes they leave room for.

    Tried first with the KV cache for every sequence of a round at max_model_len, then with the least
    the engine accepts (one such sequence). Raises MemoryPlanError when nothing fits.
    """
    plan = _search(shape, setup, gpu_bytes)
    if plan is None:
        raise MemoryPlanError(_cannot_fit(shape, setup, _candidates(setup)[-1], gpu_bytes))
    return plan


def _candidates(setup: Setup) -> list[Levers]:
    forced = setup.levers
    candidates = [forced] if not setup.choose_levers else [forced.union(c) for c in (_LORA if setup.lora_rank else _FULL)]
    if not setup.engine:  # no engine on this GPU: nothing sleeps
        candidates = [dataclasses.replace(c, sleep_level=0) for c in candidates]
    candidates = [c for c in candidates if all(getattr(c, name) == getattr(forced, name) for name in setup.frozen_levers)]
    return list(dict.fromkeys(candidates)) or [forced]


def _search(shape: ModelShape, setup: Setup, gpu_bytes: int) -> MemoryPlan | None:
    for kv_goal in (_wanted_kv_tokens(setup), _least_kv_tokens(setup)):
        for levers in _candidates(setup):
            plan = _sized(shape, setup, levers, gpu_bytes, kv_goal)
            if plan is not None:
                return plan
    return None


def _wanted_kv_tokens(setup: Setup) -> int:
    if setup.kv_tokens:
        return setup.kv_tokens
    per_seq = -(-setup.max_model_len // setup.block_size) * setup.block_size
    return setup.num_sequences * per_seq + setup.block_size  # + the scratch block


def _least_kv_tokens(setup: Setup) -> int:
    return setup.kv_tokens or (-(-setup.max_model_len // setup.block_size) + 2) * setup.block_size


def _least_microbatch(setup: Setup) -> int:
    return setup.microbatch_tokens or max(MIN_MICROBATCH_TOKENS, -(-setup.max_model_len // 1024) * 1024)


def _sized(shape: ModelShape, setup: Setup, levers: Levers, gpu_bytes: int, kv_goal: int) -> MemoryPlan | None:
    """The plan with these levers if every phase fits with `kv_goal` KV tokens and the least micro-batch;
    the micro-batch then grows into what training leaves (up to ACTIVATION_SHARE of the budget)."""
    room = budget(gpu_bytes)
    kv = _engine_kv_tokens(shape, setup, gpu_bytes) if setup.engine_fraction else kv_goal
    least = _least_microbatch(setup)
    phases = residents(shape, setup, levers, kv_tokens=kv if setup.engine else 0, microbatch_tokens=least)
    if any(sum(p.values()) > room for p in phases.values()) or kv <= 0:
        return None
    tokens = least
    if not setup.microbatch_tokens:
        per_token = shape.activation_bytes_per_token(checkpointing=levers.gradient_checkpointing)
        spare = room - sum(phases["training"].values())
        cap = max(least, int(ACTIVATION_SHARE * room) // per_token)
        tokens = max(least, min(MAX_MICROBATCH_TOKENS, cap, least + spare // per_token) // 1024 * 1024)
        phases = residents(shape, setup, levers, kv_tokens=kv if setup.engine else 0, microbatch_tokens=tokens)
    added = Levers(**{f.name: getattr(levers, f.name) != getattr(setup.levers, f.name) and getattr(levers, f.name) for f in dataclasses.fields(levers)})
    return MemoryPlan(shape=shape, setup=setup, gpu_bytes=gpu_bytes, levers=levers, added=added, kv_tokens=kv if setup.engine else 0,
                      microbatch_tokens=tokens, phases=phases)  # fmt: skip


def _engine_kv_tokens(shape: ModelShape, setup: Setup, gpu_bytes: int) -> int:
    """--gpu_memory_utilization's KV cache (its meaning in tandem rollout): the fraction of the whole GPU
    less what is in use when the engine starts (the trainer's weights, the engine's) and its activations."""
    trainer, _ = _trainer_static(shape, setup, Levers())  # AdamW's state is created at the first step, after
    used = sum(trainer.values()) + CONTEXT_BYTES + _engine_weights(shape, setup) + _engine_activations(shape, setup)
    cap = _wanted_kv_tokens(dataclasses.replace(setup, kv_tokens=0))
    return max(0, min(cap, int(gpu_bytes * setup.engine_fraction - used) // shape.kv_bytes_per_token()))


def residents(shape: ModelShape, setup: Setup, levers: Levers, *, kv_tokens: int, microbatch_tokens: int) -> dict[str, dict[str, int]]:
    """Bytes of each resident at the peak of each phase (module docstring)."""
    model, optimizer = _trainer_static(shape, setup, levers)
    engine_weights = _engine_weights(shape, setup) if setup.engine else 0
    kv = kv_tokens * shape.kv_bytes_per_token()
    trained = _trained_parameters(shape, setup)
    activations = microbatch_tokens * shape.activation_bytes_per_token(checkpointing=levers.gradient_checkpointing)
    # the 16-bit gradients of the compute copy grow as backward frees activations: the larger of the two
    backward = max(activations, 2 * trained // setup.num_ranks if setup.mixed and not setup.lora_rank else 0)
    logits = min(setup.logprob_chunk_size, microbatch_tokens) * shape.vocab_size * 4 * 2  # float32 logits and their gradient
    staging = {"optimizer staging": cpu_optimizer_staging(setup, trained)} if levers.cpu_optimizer else {}
    training = {**model, **optimizer, **staging, "activations": backward, "logprob chunk": logits}
    if levers.sleep_level < 2:
        training["engine weights"] = engine_weights
    if levers.sleep_level < 1:
        training["KV cache"] = kv
    generation = {**staging, "engine weights": engine_weights, "KV cache": kv, "engine activations": _engine_activations(shape, setup) if setup.engine else 0}
    if not levers.offload_model:
        generation.update(model)
    if not levers.offload_optimizer:
        generation.update(optimizer)
    sync = {**model, **staging, "engine weights": engine_weights, "KV cache": kv}
    if not levers.offload_optimizer:
        sync.update(optimizer)
    if setup.lora_rank and setup.engine and not setup.engine_shares_base:
        # the adapted weights, merged, stream to the engine, which copies them 64 tensors a launch (all-linear:
        # ~9 layers' worth in 16 bits); one weight's float32 delta and sum while it is merged
        linears = {n: ab for n, ab in shape.linears().items() if setup.lora_targets == ("all-linear",) or n in setup.lora_targets}
        largest = max((a * b for a, b in linears.values()), default=0)
        per_layer = sum(a * b for a, b in linears.values())
        sync["merge buffer"] = 2 * min(shape.num_layers, 64 // max(1, len(linears))) * per_layer + 8 * largest
    return {"generation": generation, "training": training, "sync": sync}


def cpu_optimizer_compute(compute: str, *, float32: bool, on_gpu: bool) -> str:
    """Where --cpu_optimizer's AdamW math runs (train/cpu_adam.py), for trained weights that are `float32` or not:
    auto is gpu for float32 weights on a GPU, else cpu. Raises ValueError for an unknown value, and for gpu over
    weights that are not float32 (the fused kernel takes moments of its weights' dtype)."""
    if compute not in CPU_OPTIMIZER_COMPUTES:
        raise ValueError(f"--cpu_optimizer_compute must be auto, cpu or gpu, got {compute!r}")
    if compute == "gpu" and not float32:
        raise ValueError("--cpu_optimizer_compute gpu needs float32 weights (the fused kernel takes moments of its weights' dtype): "
                         "--dtype float32, or --cpu_optimizer_compute cpu")  # fmt: skip
    if compute == "auto":
        return "gpu" if on_gpu and float32 else "cpu"
    return compute


def cpu_optimizer_staging(setup: Setup, trained: int) -> int:
    """--cpu_optimizer's buffers on the GPU (train/cpu_adam.py), allocated once: its gpu form's slots, a chunk of
    each float32 moment, or its cpu form's two float32 chunks of updates."""
    float32 = setup.lora_rank > 0 or setup.master_bytes == 4  # LoRA's adapters are float32 whatever the base's dtype (train/lora.py)
    if cpu_optimizer_compute(setup.cpu_optimizer_compute, float32=float32, on_gpu=True) == "gpu":
        return CPU_OPTIMIZER_GPU_SLOTS * 2 * 4 * min(CPU_OPTIMIZER_GPU_CHUNK, trained)
    return 2 * 4 * min(CPU_OPTIMIZER_CHUNK, trained)


def _trained_parameters(shape: ModelShape, setup: Setup) -> int:
    return shape.lora_parameters(setup.lora_rank, setup.lora_targets) if setup.lora_rank else shape.num_parameters


def _trainer_static(shape: ModelShape, setup: Setup, levers: Levers) -> tuple[dict[str, int], dict[str, int]]:
    """(the trainer's weights and gradients, its optimizer state on the GPU) between micro-batches."""
    p, w = shape.num_parameters, setup.num_ranks
    trained = _trained_parameters(shape, setup)
    if setup.lora_rank:  # the frozen base in 16 bits, once (under torchrun FSDP2 shards its float32 masters); float32 adapters
        base = 2 * p if w == 1 or not setup.mixed else setup.master_bytes * p // w
        model = {"base weights": base, "adapters + gradients": 2 * 4 * trained // w}
        optimizer = {} if levers.cpu_optimizer else {"optimizer state": 2 * 4 * trained // w}
        return model, optimizer
    m = setup.master_bytes
    model = {"master weights": m * p // w, "gradients": m * p // w}
    if setup.mixed and w == 1:
        model["compute copy"] = 2 * p
    if setup.reference:
        model["reference model"] = (2 if setup.mixed else m) * p // w
    optimizer = {} if levers.cpu_optimizer else {"optimizer state": 2 * m * p // w}
    return model, optimizer


def _engine_weights(shape: ModelShape, setup: Setup) -> int:
    """The engine's own weights in 16 bits; serving beside a LoRA trainer's base (--lora_engine shared), only its
    adapters (on every projection, whatever the targets: generation/engine/layers/lora.py)."""
    if setup.engine_shares_base and setup.lora_rank:
        return 2 * shape.lora_parameters(setup.lora_rank, ("all-linear",))
    return 2 * shape.num_parameters


def _engine_activations(shape: ModelShape, setup: Setup) -> int:
    """One prefill's layer at a time (hidden, residual, qkv, attention output, gate/up and their product)
    and the sampler's float32 logits of a round's sequences."""
    h, q, kv, i = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, shape.intermediate_size
    prompts = -(-setup.num_sequences // max(1, setup.group_size))
    tokens = min(setup.prefill_tokens, prompts * setup.prompt_tokens + setup.num_sequences * setup.block_size)
    return 2 * tokens * (2 * h + 2 * q + 2 * kv + 3 * i) + 4 * 4 * min(setup.num_sequences, 512) * shape.vocab_size


def _cannot_fit(shape: ModelShape, setup: Setup, levers: Levers, gpu_bytes: int) -> str:
    """One line: the phase that overflows with every lever, its largest residents, and what would fit."""
    phases = residents(shape, setup, levers, kv_tokens=_least_kv_tokens(setup) if setup.engine else 0, microbatch_tokens=_least_microbatch(setup))
    phase = max(PHASES, key=lambda name: sum(phases[name].values()))
    top = sorted(phases[phase].items(), key=lambda kv: -kv[1])[:3]
    largest = ", ".join(f"{name} {n / GiB:.1f}" for name, n in top)
    fixes = []
    if setup.engine_fraction and _fits(shape, dataclasses.replace(setup, engine_fraction=0.0), gpu_bytes):
        fixes.append(f"--gpu_memory_utilization 0 (the plan sizes the KV cache; {setup.engine_fraction} of the whole GPU leaves the engine too little)")
    if not setup.lora_rank and _fits(shape, dataclasses.replace(setup, lora_rank=16), gpu_bytes):
        fixes.append("LoRA (--lora_r 16)")
    ranks = next((n for n in (2, 4, 8) if _fits(shape, dataclasses.replace(setup, num_ranks=setup.num_ranks * n), gpu_bytes)), None)
    if ranks:
        fixes.append(f"{setup.num_ranks * ranks} GPUs (torchrun --nproc_per_node {setup.num_ranks * ranks} shards the weights and optimizer)")
    if setup.engine and _fits(shape, dataclasses.replace(setup, engine=False), gpu_bytes):
        fixes.append("a rollout server on another GPU (--rollout_mode server)")
    shorter = dataclasses.replace(setup, max_model_len=max(setup.block_size, setup.max_model_len // 2), kv_tokens=0, microbatch_tokens=0)
    if _fits(shape, shorter, gpu_bytes):
        fixes.append(f"a shorter --max_model_len (now {setup.max_model_len})")
    if not fixes:
        fixes.append("a GPU with more memory, or several GPUs with a rollout server beside them")
    what = f"LoRA r{setup.lora_rank}" if setup.lora_rank else "full fine-tuning"
    return (
        f"a {shape.num_parameters / 1e9:.1f}B model ({what}) does not fit this {gpu_bytes / GiB:.0f} GiB GPU even with "
        f"{' '.join(levers.names()) or 'every lever'}: {phase} needs {sum(phases[phase].values()) / GiB:.1f} GiB of "
        f"{budget(gpu_bytes) / GiB:.1f} ({largest} GiB); try {', or '.join(fixes)}"
    )


def _fits(shape: ModelShape, setup: Setup, gpu_bytes: int) -> bool:
    return _search(shape, dataclasses.replace(setup, choose_levers=True), gpu_bytes) is not None
