"""Composes the leaf configs into TrainConfig: one flag per leaf field, names unique across leaves, and
resolves it into the run's Plan (plan.py): every derived setting and every rule spanning leaves, once.

Leaves live beside the code they configure; the ones here belong to the run as a whole.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from tandemrl.algo.presets import AlgoConfig
from tandemrl.generation.base import EngineConfig, EngineSettings, GeneratorConfig, HFConfig, RemoteConfig, resolve_api_key
from tandemrl.pipeline.settings import LoopSettings
from tandemrl.plan import JUDGE_MEMORY_FRACTION, EngineSizing, Plan
from tandemrl.rewards.judge import JudgeConfig
from tandemrl.rollout.env import ToolsConfig
from tandemrl.train.config import CheckpointConfig, LoraConfig, OffloadConfig, TrainerConfig
from tandemrl.types import SamplingParams, steps_or_ratio
from tandemrl.weights.base import DistributedSyncConfig, LocalSyncConfig

_SAMPLING = SamplingParams()  # the sampling flags' defaults are SamplingParams' own
_REMOTE = RemoteConfig()  # the server-mode flags' defaults are the client's own


MAX_RUN_SEED = 2**24 - 1  # the seeds derived per step and rollout ((seed x 1,000,003 + step) x 100,003 + i) stay in 63 bits


@dataclass(kw_only=True)
class RunConfig:
    """What runs and for how long."""

    task: str = ""
    """Built-in task (data + rewards + recipe): synthetic (digits/letters, the tiny policy learns it on a CPU),
    gsm8k (grade-school math), calculator (arithmetic with a Python tool, multi-turn) or lookup (a tool task
    the tiny policy learns on a CPU). Default: synthetic when no --dataset."""
    model: str = ""
    """Policy: a Hugging Face id or local directory (any causal LM), or tandem:tiny (built in code)."""
    max_steps: int = 150
    """Optimizer steps to run (--num_train_epochs, when set, decides instead)."""
    num_train_epochs: float | None = None
    """TRL's name: passes over the dataset; sets the steps to ceil(epochs x examples / --num_prompts_per_step).
    None = --max_steps decides."""
    model_init_kwargs: dict[str, Any] = field(default_factory=dict)
    """TRL's name: keyword arguments of AutoModelForCausalLM.from_pretrained, as JSON on the command line,
    e.g. '{"revision": "main"}' (dtype is --dtype's; attention runs on sdpa)."""
    trust_remote_code: bool = False
    """TRL's name: allow models and tokenizers that ship their own Python code from the hub."""
    seed: int = 0
    """Seed of everything: data order, sampling, init of built-in models."""

    def __post_init__(self) -> None:
        if self.max_steps < 1:
            raise ValueError(f"--max_steps must be >= 1, got {self.max_steps}")
        if self.num_train_epochs is not None and not 0 < self.num_train_epochs < math.inf:  # 0 trained a step
            raise ValueError(f"--num_train_epochs must be > 0 (or unset: --max_steps decides), got {self.num_train_epochs}")
        if not 0 <= self.seed <= MAX_RUN_SEED:  # -1 was refused as the seed derived from it: "got -100003300009"
            raise ValueError(f"--seed must be in [0, {MAX_RUN_SEED}], got {self.seed}")


@dataclass(kw_only=True)
class DataConfig:
    """Where prompts come from and how many a step takes."""

    dataset: str = ""
    """Hub id, local .jsonl/.json/.parquet/.csv file or directory (save_to_disk's, or of data files) with a `prompt`
    column (other columns go to rewards)."""
    dataset_split: str = "train"
    """Split of a hub dataset or a directory; a single file is one split, train (as datasets reads a file): another is refused."""
    shuffle_dataset: bool = True
    """TRL's name: draw the prompts in an order reshuffled every epoch (from --seed); false = the dataset's order,
    every epoch. A resumed run goes on in its checkpoint's order."""
    max_prompt_length: int = 512
    """Longest prompt in tokens (after the chat template); a longer one stops the run before its first step, naming
    its row and dataset: a prompt is never truncated (TRL 1.16 keeps every prompt whole)."""
    num_prompts_per_step: int = 16
    """Groups (distinct prompts) per optimizer step."""
    num_generations: int = 8
    """Rollouts per prompt: the group size G."""
    steps_per_generation: int | None = None
    """TRL's name: optimizer steps one generation round feeds. A round's prompts (this x
    --num_prompts_per_step) are sampled by one policy version and scored together (advantages of
    --scale_rewards batch over the round), then trained --num_prompts_per_step a step, so the round's last
    step trains on rollouts this - 1 versions old. Counted in optimizer steps (TRL counts micro-batches: the
    same with gradient_accumulation_steps 1). None = 1, or from --generation_batch_size."""
    generation_batch_size: int | None = None
    """TRL's name: completions per generation round, a multiple of --num_prompts_per_step x --num_generations
    (--steps_per_generation = this / that); set one of the two. None = one step's completions."""
    eval_dataset: str = ""
    """Evaluation prompts, as --dataset (with --task: that task's data format); empty = no evaluation."""
    eval_dataset_split: str = "test"
    """Split of a hub or directory --eval_dataset; a single file is read whole at this default (a split other than train given for it is refused)."""
    eval_steps: float = 50
    """TRL's name: evaluate every this many steps (below 1: TRL's ratio of the run's steps) and after the last,
    when --eval_dataset is given; the metrics are the training ones prefixed eval_ (eval_reward,
    eval_rewards/<fn>/mean, ...), same sinks."""
    num_generations_eval: int | None = None
    """TRL's name: completions per eval prompt (None = --num_generations)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """TRL's name: keyword arguments of the tokenizer's apply_chat_template wherever the policy's template is
    rendered (message prompts, eval prompts, the turns of tool rollouts), as JSON on the command line,
    e.g. '{"enable_thinking": false}' for Qwen3."""

    def __post_init__(self) -> None:
        if self.num_generations < 2:
            raise ValueError(f"--num_generations must be >= 2 for group-relative advantages, got {self.num_generations}")
        if self.num_prompts_per_step < 1:
            raise ValueError(f"--num_prompts_per_step must be >= 1, got {self.num_prompts_per_step}")
        self.eval_steps = steps_or_ratio("eval_steps", self.eval_steps, zero=None)
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ValueError(f"--num_generations_eval must be >= 1, got {self.num_generations_eval}")
        self.steps_per_round  # noqa: B018 (validates --steps_per_generation / --generation_batch_size)

    @property
    def steps_per_round(self) -> int:
        """Optimizer steps per generation round, from --steps_per_generation or --generation_batch_size (TRL's rules).

        Example: num_prompts_per_step 4, num_generations 8, generation_batch_size 96 -> 3
        """
        per_step = self.num_prompts_per_step * self.num_generations
        if self.steps_per_generation is not None and self.generation_batch_size is not None:
            raise ValueError("--steps_per_generation and --generation_batch_size set the same thing: give one of them")
        if self.generation_batch_size is not None:
            if self.generation_batch_size < 1 or self.generation_batch_size % per_step:
                raise ValueError(
                    f"--generation_batch_size must be a multiple of --num_prompts_per_step x --num_generations ({per_step}), "
                    f"got {self.generation_batch_size}"
                )
            return self.generation_batch_size // per_step
        if self.steps_per_generation is not None and self.steps_per_generation < 1:
            raise ValueError(f"--steps_per_generation must be >= 1, got {self.steps_per_generation}")
        return self.steps_per_generation or 1


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens", "stop", "stop_token_ids", "ignore_eos")
"""--generation_kwargs keys every generator applies (they override the sampling flags, as in TRL)."""


@dataclass(kw_only=True)
class GenerationConfig:
    """How completions are produced: backend, placement and sampling."""

    generator: Literal["engine", "hf"] = "engine"
    """Backend in colocate mode: engine (ours; other architectures fall back to hf) or hf (transformers generate)."""
    rollout_mode: Literal["colocate", "server"] = "colocate"
    """colocate (engine in the trainer's process) or server (tandem rollout servers)."""
    rollout_server_urls: tuple[str, ...] = ()
    """Server mode: rollout server URLs, e.g. http://127.0.0.1:8000 (several = data-parallel rollout)."""
    rollout_server_timeout: float = _REMOTE.rollout_server_timeout
    """Server mode: seconds to wait for the servers to be ready before one clear error."""
    rollout_server_silence_s: float = _REMOTE.rollout_server_silence_s
    """Server mode: a server that answers nothing, not even /health, this long while the trainer waits on it
    (stopped, hung, cut off) is given up: its requests go to another server, or the run ends with one line."""
    api_key: str | None = None
    """Server mode (and --reward_model_url): the servers' bearer token (default: env TANDEM_API_KEY); never
    saved or logged."""
    temperature: float = _SAMPLING.temperature
    """Sampling temperature (the trainer's logprobs use the same, --generation_kwargs' included)."""
    top_p: float = _SAMPLING.top_p
    """Nucleus sampling threshold."""
    top_k: int = _SAMPLING.top_k
    """Top-k sampling (-1 = off)."""
    min_p: float = _SAMPLING.min_p
    """Min-p sampling (0 = off)."""
    repetition_penalty: float = _SAMPLING.repetition_penalty
    """TRL's name: > 1 penalises tokens already in the prompt or completion (transformers' and vLLM's
    meaning: such a logit is divided by it where positive, multiplied where negative); 1.0 = off. The
    sampler's logprobs are of the penalised distribution, the trainer's are not: truncated IS weighs the
    difference, as for top-p/top-k."""
    generation_kwargs: dict[str, Any] = field(default_factory=dict)
    """TRL's name: sampling settings that override the flags above, as JSON on the command line
    (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens, stop, stop_token_ids, ignore_eos:
    every generator); any other key goes to transformers' generate() and needs --generator hf."""
    sleep_level: Literal[0, 1, 2] = 0
    """Colocate: during training the engine frees its KV cache (1) and also its weights (2)."""
    max_staleness: int = 0
    """Async GRPO: groups for up to this many later steps are generated while a step trains, so a trained
    token may be sampled by weights up to this many versions old (0 = synchronous, on-policy)."""
    generator_device: str = ""
    """Colocate with --generator engine: the engine's device, e.g. cuda:1 (default: the trainer's); weights
    are then copied device to device."""

    def __post_init__(self) -> None:
        if self.generator not in ("engine", "hf"):
            raise ValueError(f"--generator must be engine or hf, got {self.generator!r}")
        if self.rollout_mode not in ("colocate", "server"):
            raise ValueError(f"--rollout_mode must be colocate or server, got {self.rollout_mode!r}")
        if self.max_staleness < 0:
            raise ValueError(f"--max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_staleness > 0 and self.rollout_mode == "colocate" and self.generator == "hf":
            raise ValueError("--max_staleness > 0 needs --generator engine or --rollout_mode server: the hf generator shares the trainer's weights")
        if self.max_staleness > 0 and self.sleep_level > 0:
            raise ValueError("--max_staleness > 0 generates while training, so the engine cannot sleep then; use --sleep_level 0")
        self.hf_generation_kwargs()
        if not 0 < self.rollout_server_silence_s < float("inf"):  # NaN fails too
            raise ValueError(f"--rollout_server_silence_s must be a number of seconds > 0, got {self.rollout_server_silence_s}")
        if self.rollout_mode == "server" and not self.rollout_server_urls:
            raise ValueError("--rollout_mode server needs --rollout_server_urls http://HOST:PORT [...]")

    def hf_generation_kwargs(self) -> dict[str, Any]:
        """What only transformers' generate applies: the --generation_kwargs keys beyond SAMPLING_KEYS.

        Raises ValueError naming them unless --generator hf in colocate mode.
        Example: generation_kwargs {"top_p": 0.9, "no_repeat_ngram_size": 3} -> {"no_repeat_ngram_size": 3}
        """
        extra = {k: v for k, v in self.generation_kwargs.items() if k not in SAMPLING_KEYS}
        if extra and (self.generator != "hf" or self.rollout_mode != "colocate"):
            raise ValueError(
                f"{', '.join(sorted(extra))} (--generation_kwargs) only apply with --generator hf in colocate mode; "
                f"our engine applies {', '.join(SAMPLING_KEYS)}: drop the others or pass --generator hf"
            )
        return extra


@dataclass(kw_only=True)
class RewardConfig:
    """How completions are scored."""

    reward_funcs: tuple[str, ...] = ()
    """Reward functions: built-in names (math_accuracy, format, length), module:function or file.py:function."""
    reward_weights: tuple[float, ...] = ()
    """One weight per reward function (default 1.0 each)."""
    reward_nonfinite: Literal["error", "skip"] = "error"
    """A reward (or weighted total) that is inf or NaN: error (stop, naming the function) or skip (drop its
    group, counted in rollout/nonfinite_reward_groups)."""

    reward_timeout_s: float = 600.0
    """Deadline of one call of a reward function (async ones are cancelled, sync ones abandoned); the groups
    it was scoring are not trained, counted in rollout/reward_timeouts."""

    def __post_init__(self) -> None:
        if not self.reward_timeout_s > 0:
            raise ValueError(f"--reward_timeout_s must be > 0, got {self.reward_timeout_s}")
        if self.reward_nonfinite not in ("error", "skip"):
            raise ValueError(f"--reward_nonfinite must be error or skip, got {self.reward_nonfinite!r}")


@dataclass(kw_only=True)
class LogConfig:
    """Where metrics and samples go."""

    report_to: tuple[Literal["wandb", "trackio"], ...] = ()
    """Extra metric sinks beyond JSONL and TensorBoard: wandb, trackio."""
    logging_steps: float = 10
    """Print a full step line (reward, length, entropy, kl, grad_norm, lr, tokens/s, memory, time split) every
    this many steps (below 1: TRL's ratio of the run's steps), and on the first and last (0 = only the progress
    bar or heartbeat)."""
    log_completions_steps: int = 25
    """Print and log a few sample completions every this many steps (0 = never)."""
    run_name: str = ""
    """Name of the run in the sinks (default: the run directory's name)."""
    logprob_mismatch_warning: float = 0.02
    """Warn when the sampler's and the trainer's logprobs of the same weights (lag 0) differ by more than
    this KL (train/logprob_mismatch_kl_lag0): a weight-sync bug detector; 0 = never."""
    heartbeat_s: float = 30.0
    """Most seconds between two progress lines when stdout is not a terminal; a step running longer gets a
    line saying which phase it is in."""

    def __post_init__(self) -> None:
        self.logging_steps = steps_or_ratio("logging_steps", self.logging_steps, zero="only the progress bar or heartbeat")


SECRETS = ("api_key",)  # flags never written to the run directory, a metrics sink or --print_config

RESUME_MAY_CHANGE = frozenset({
    # how long it runs, where it logs and saves, and the resume itself
    "max_steps", "num_train_epochs", "max_skipped_steps", "output_dir", "save_steps", "save_total_limit", "resume",
    "resume_allow_changed_flags", "lora_save_merged", "report_to", "logging_steps", "log_completions_steps", "run_name",
    "logprob_mismatch_warning", "heartbeat_s", "eval_dataset", "eval_dataset_split", "eval_steps", "num_generations_eval",
    # where the rollouts and the judge run, and their deadlines
    "generator", "rollout_mode", "rollout_server_urls", "rollout_server_timeout", "rollout_server_silence_s", "generator_device",
    "reward_model_url", "reward_model_max_concurrency", "reward_timeout_s", "tool_timeout_s", "trust_remote_code", "ddp_timeout",
    # speed and memory: the same computation, placed, batched or scheduled otherwise
    "device", "sleep_level", "gpu_memory_utilization", "kv_cache_tokens", "block_size", "max_num_seqs", "max_num_batched_tokens",
    "prefill_wait_steps", "overlap_prefills", "enforce_eager", "decode_graphs", "tensor_parallel_size", "warm_up_turns",
    "max_tokens_per_microbatch", "logprob_chunk_size", "torch_compile", "triton_logprobs", "gradient_checkpointing", "lora_engine",
    "offload_optimizer", "offload_model", "cpu_optimizer", "cpu_optimizer_compute", "gc_collect_after_offload",
    "move_model_batches", "weight_sync_port", "weight_sync_bucket_mb", "weight_sync_timeout_s", "weight_sync_backend",
    "weight_sync_host", "weight_sync_ipc_reuse",
})  # fmt: skip
"""Flags a --resume may change unasked: none changes what a step computes. Every other flag (a new one too)
is checked against the checkpoint's (cli/build.py), as it changes the model, data, seed, schedule, loss,
batch shape, lengths, sampling or precision."""

RESUME_NOT_COMPARED = ("output_dir", "resume", "resume_allow_changed_flags")  # how the run is resumed, not what it ran


LEAVES = (
    RunConfig, DataConfig, GenerationConfig, EngineSettings, RewardConfig, AlgoConfig, TrainerConfig, CheckpointConfig, LogConfig,
    LocalSyncConfig, DistributedSyncConfig, ToolsConfig, JudgeConfig, OffloadConfig, LoraConfig,
)


@dataclass(kw_only=True)
class TrainConfig:
    """Everything `tandem train` needs; each leaf is handed to the part it configures."""

    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    engine: EngineSettings = field(default_factory=EngineSettings)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    local_sync: LocalSyncConfig = field(default_factory=LocalSyncConfig)
    distributed_sync: DistributedSyncConfig = field(default_factory=DistributedSyncConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        """Every rule across leaves, once: the memory levers and LoRA against the generator that shares the
        weights, the split engine against staleness, the conversation against the prompt."""
        g, t = self.generation, self.engine.tensor_parallel_size
        if t > 1 and g.rollout_mode == "colocate" and g.max_staleness > 0:
            raise ValueError(
                f"--max_staleness {g.max_staleness} with a colocated engine split over the ranks (--tensor_parallel_size {t}) is not supported: "
                "its collectives would run beside FSDP's while training; use --max_staleness 0, or rollout servers (--rollout_mode server)"
            )
        if self.tools.enabled and not self.data.max_prompt_length < self.tools.max_total_tokens:
            raise ValueError(f"--max_total_tokens {self.tools.max_total_tokens} must exceed --max_prompt_length {self.data.max_prompt_length}; change one of them")
        shares_weights = g.rollout_mode == "colocate" and g.generator == "hf"  # the hf generator runs the trainer's model
        if shares_weights and self.engine.routing_replay:
            raise ValueError("--routing_replay needs --generator engine (or rollout servers started with --routing_replay): transformers generate records no routes")
        if shares_weights and (self.offload.offload_model or self.lora.enabled):
            raise ValueError("--offload_model and --lora_r need --generator engine (or --rollout_mode server): the hf generator runs the trainer's own model")
        if self.lora.enabled and self.algo.sync_ref_model:
            raise ValueError("--sync_ref_model cannot be used with --lora_r: the reference is the base model with the adapters disabled")
        if self.lora.lora_dropout > 0 and self.trainer.disable_dropout:
            raise ValueError("--lora_dropout needs --disable_dropout false (which otherwise sets every dropout to 0)")

    def lora_engine_shares_base(self, *, num_ranks: int = 1, hf_config: Any = None) -> bool:
        """Whether the colocated engine serves the LoRA policy beside the trainer's own base (--lora_engine):
        the one rule, read by the memory plan and by the build (`hf_config`: the policy's, when known). ValueError
        (one line) where --lora_engine shared was asked for and cannot be."""
        g = self.generation
        if not self.lora.enabled or self.lora.lora_engine == "merged" or g.rollout_mode == "server":
            return False  # servers: pushes carry only the adapters where the servers apply them (cli/build.py)
        # engine code, imported late: the MoE models' classes, and the families the engine runs
        from tandemrl.generation.engine.models.family import unsupported_reason
        from tandemrl.generation.engine.models.loading import MODEL_CLASSES

        model_type = getattr(hf_config, "model_type", "")
        why = (
            "no colocated engine generates the policy" if g.generator != "engine"
            else "the engine runs on another device (--generator_device)" if g.generator_device
            else "the engine is split over ranks (--tensor_parallel_size)" if self.engine.tensor_parallel_size > 1
            else "each torchrun rank holds a shard of the base" if num_ranks > 1
            else "--offload_model moves the base off the GPU while the engine generates from it" if self.offload.offload_model
            else f"the engine serves adapters beside the base of dense models only ({model_type})" if model_type in MODEL_CLASSES
            else f"the engine does not run this model ({unsupported_reason(hf_config)})" if hf_config is not None and unsupported_reason(hf_config)
            else None
        )  # fmt: skip
        if why is not None and self.lora.lora_engine == "shared":
            raise ValueError(f"--lora_engine shared: {why}; use --lora_engine merged (or auto)")
        return why is None

    def to_dict(self) -> dict[str, Any]:
        """Flat {flag: value}, as saved in the run directory and accepted by --config; secrets left out."""
        return {k: v for leaf in asdict(self).values() for k, v in leaf.items() if k not in SECRETS}

    def resolve(self) -> Plan:
        """The run worked out once, on CPU, building nothing (plan.py). Pure: the same config, the same plan."""
        engine = _engine_sizing(self) if self.generation.rollout_mode == "colocate" and self.generation.generator == "engine" else None
        loop = _loop(self)
        sampling = _sampling(self)
        return Plan(sampling=sampling, engine=engine, generator=_generator(self, engine, sampling), judge=_judge(self), loop=loop, notes=_notes(loop))


def changed_flags(saved: dict[str, Any], config: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """{flag: (its value in `saved`, in `config`)} of the flags a resume changes; a flag `saved` lacks (added
    to tandem since) had its default. Example: saved lr 1e-3, config lr 2e-3 -> {"learning_rate": (0.001, 0.002)}"""
    defaults, now = TrainConfig().to_dict(), config.to_dict()
    old = {k: saved.get(k, defaults[k]) for k in now if k not in RESUME_NOT_COMPARED}
    return {k: (v, now[k]) for k, v in old.items() if _comparable(v) != _comparable(now[k])}


def _comparable(value: Any) -> Any:
    """A tuple and the list it reads back as from YAML are one value."""
    return list(value) if isinstance(value, tuple) else value


def _sampling(config: TrainConfig) -> SamplingParams:
    """The sampling flags, overridden by --generation_kwargs keys that SamplingParams knows (as in TRL).

    Example: --temperature 1.0 --generation_kwargs '{"temperature": 0.7}' -> SamplingParams(temperature=0.7, ...)
    """
    g = config.generation
    overrides = {k: tuple(v) if isinstance(v, list) else v for k, v in g.generation_kwargs.items() if k in SAMPLING_KEYS}
    return SamplingParams(**{
        "max_tokens": config.algo.max_completion_length, "temperature": g.temperature, "top_p": g.top_p,
        "top_k": g.top_k, "min_p": g.min_p, "repetition_penalty": g.repetition_penalty, **overrides,
    })  # fmt: skip


def _engine_sizing(config: TrainConfig) -> EngineSizing:
    """The colocated engine sized for this run: one generation round's sequences, each as long as it may get."""
    e, d = config.engine, config.data
    wanted = d.max_prompt_length + config.algo.max_completion_length
    if config.tools.enabled:
        wanted = max(wanted, config.tools.max_total_tokens)
    return EngineSizing(
        max_model_len=e.model_len(max_positions=None, wanted=wanted),
        max_num_seqs=min(e.max_num_seqs, d.num_prompts_per_step * d.num_generations * d.steps_per_round),
        gpu_memory_utilization=e.memory_fraction(colocated=True),
    )


def _generator(config: TrainConfig, sizing: EngineSizing | None, sampling: SamplingParams) -> GeneratorConfig:
    """The policy's backend, per --rollout_mode and --generator; colocated on --generator_device, else --device."""
    g = config.generation
    if g.rollout_mode == "server":
        return RemoteConfig(
            urls=tuple(g.rollout_server_urls), api_key=resolve_api_key(g.api_key), rollout_server_timeout=g.rollout_server_timeout,
            rollout_server_silence_s=g.rollout_server_silence_s,
        )
    device = g.generator_device or config.trainer.device
    if sizing is None:
        return HFConfig(device=device, generation_kwargs=g.hf_generation_kwargs())
    settings = {**dataclasses.asdict(config.engine), **dataclasses.asdict(sizing)}
    if settings["decode_graphs"] == "auto":  # the run's own sampling decides which sampler its decode graphs hold
        settings["decode_graphs"] = "filtered" if sampling.filters else "plain"
    return EngineConfig(**settings, device=device, seed=config.run.seed)


def _judge(config: TrainConfig) -> GeneratorConfig | None:
    """The LLM judge's backend: its server (with the policy servers' API key; a request's deadline is the reward
    call's, --reward_timeout_s), or its own engine beside the policy's; None without a judge model (a plugin may need none)."""
    j = config.judge
    if j.reward_model_url:
        key = resolve_api_key(config.generation.api_key)
        return RemoteConfig(
            urls=(j.reward_model_url,), api_key=key, rollout_server_timeout=config.generation.rollout_server_timeout,
            rollout_server_silence_s=config.generation.rollout_server_silence_s, request_timeout_s=config.reward.reward_timeout_s,
        )
    if j.reward_model:
        return EngineConfig(model=j.reward_model, device=config.trainer.device, seed=config.run.seed, gpu_memory_utilization=JUDGE_MEMORY_FRACTION)
    return None


def _loop(config: TrainConfig) -> LoopSettings:
    return LoopSettings(
        max_steps=config.run.max_steps,
        num_prompts_per_step=config.data.num_prompts_per_step,
        num_generations=config.data.num_generations,
        scale_rewards=config.algo.scale_rewards,
        drop_zero_variance_groups=config.algo.dynamic_sampling,
        max_dynamic_sampling_rounds=config.algo.max_dynamic_sampling_rounds,
        seed=config.run.seed,
        sleep_level=config.generation.sleep_level,
        log_completions_steps=config.log.log_completions_steps,
        save_steps=config.checkpoint.save_steps,
        save_total_limit=config.checkpoint.save_total_limit,
        max_staleness=config.generation.max_staleness,
        steps_per_generation=config.data.steps_per_round,
        logprob_mismatch_warning=config.log.logprob_mismatch_warning,
        reward_nonfinite=config.reward.reward_nonfinite,
        reward_timeout_s=config.reward.reward_timeout_s,
        save_merged=config.lora.lora_save_merged,
    )


def _notes(loop: LoopSettings) -> tuple[str, ...]:
    notes = []
    if loop.drop_zero_variance_groups and not loop.refills:
        notes.append("zero-variance groups are dropped but the batch is not refilled (dynamic sampling needs --max_staleness 0 and --steps_per_generation 1)")
    return tuple(notes)
