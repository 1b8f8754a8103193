"""Builds the parts of a training run from its Plan (config.py resolves it) and leaf configs, and runs the
loop (after parsing, so the heavy imports here never slow `--help`). Nothing here derives a setting."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import datetime
import fcntl
import itertools
import json
import logging
import math
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from tandemrl.cli import frozen_heap
from tandemrl.cli.args import dump_yaml
from tandemrl.cli.plan import gpu_bytes, memory_setup, model_config, plan_run, planned_peaks_gib, with_plan
from tandemrl.cli.ranks import ServedByRankZero, Silent, one_line_when_a_rank_fails, start_ranks
from tandemrl.config import RESUME_MAY_CHANGE, DataConfig, TrainConfig, changed_flags
from tandemrl.data.cursor import PromptCursor
from tandemrl.data.load import FILE_SPLIT, is_one_file, load_examples
from tandemrl.data.prompts import check_prompt_length, encode_prompt
from tandemrl.generation.factory import build_generator
from tandemrl.generation.loading import load_model, load_tokenizer, resolve_device, resolve_dtype
from tandemrl.memory import ModelShape
from tandemrl.pipeline.loop import publish_policy, run_loop
from tandemrl.pipeline.parts import EvalSet, LoopParts
from tandemrl.pipeline.settings import LoopSettings
from tandemrl.plan import Plan
from tandemrl.rewards.base import RewardFunc, load_reward_funcs
from tandemrl.rewards.judge import build_judge
from tandemrl.rollout.chat import ChatFormat
from tandemrl.rollout.env import open_tool_env
from tandemrl.rollout.run import MultiTurn
from tandemrl.tasks import Task, get_task
from tandemrl.tasks.synthetic import TINY_MODEL
from tandemrl.train.checkpoint import how_to_continue, latest_checkpoint, resumable_checkpoint, set_rng_state, sharded_optimizer
from tandemrl.train.distributed import SINGLE, DataParallel, close_data_parallel
from tandemrl.train.forward import compute_dtype
from tandemrl.train.trainer import Trainer
from tandemrl.types import Example, every_steps
from tandemrl.weights.factory import build_weight_sync
from tandemrl.weights.sharded import ShardedSync

log = logging.getLogger(__name__)


def run(config: TrainConfig, plan: Plan | None = None) -> Path:
    """Runs the whole training (this rank's part of it under torchrun); returns the run directory.
    `plan`: config.resolve(), when the caller has it already."""
    plan = plan or config.resolve()
    device = resolve_device(config.trainer.device)
    dp = start_ranks(config, use_cuda=device.type == "cuda")
    device = dp.device(device)
    run_dir = Path(dp.broadcast(str(_run_dir(config)) if dp.is_main else None))
    checkpoint, state = _resume_point(config, run_dir)
    if state is not None:
        _check_flags(config, state, checkpoint)
    memory = _memory_plan(config, device, dp.world_size)  # before anything loads; None on a CPU
    if memory is not None:  # its levers and sizes applied, and the run resolved again with them
        config = with_plan(config, memory)
        plan = dataclasses.replace(config.resolve(), memory=memory)
    torch.manual_seed(config.run.seed)
    tokenizer, model = _policy(config, checkpoint, device)
    _check_conversation_length(config, model)
    task = _task(config)
    examples = _data(config, task)
    evals = _eval_set(config)
    plan = plan.with_max_steps(max_steps(config, len(examples)))
    _say_step_ratios(config, plan.loop.max_steps)
    judge_generator, judge = _judge(config, plan, scores=dp.scores)
    reward_funcs = _rewards(config, task) + ([judge] if judge is not None else [])
    # under torchrun each rank's engine is built from the whole policy, before FSDP shards it
    early = _rollout_side(config, plan, model, tokenizer, device=str(device), tp=_engine_ranks(dp)) if dp.enabled and not dp.rank_zero_generates else None
    trainer = _trainer(config, plan, model, dp)
    cursor = PromptCursor(len(examples), seed=config.run.seed, shuffle=config.data.shuffle_dataset)
    if state is not None:
        _resume(trainer, cursor, state, checkpoint)
    start_step = state["step"] if state is not None else 0
    generator, sync = early or _rollout_side(config, plan, model, tokenizer, dp=dp)
    trainer.engine_unshared = getattr(generator, "unshared_base", None)  # --lora_engine shared: syncs move the adapters
    device = next(model.parameters()).device
    if dp.is_main:
        _save_config(config, run_dir)
        print("\n".join(_banner(config, plan, model, device, run_dir, dp.world_size, generator) + (memory.lines() if memory else [])), flush=True)
    parts = LoopParts(
        examples=examples, prompt_ids=[], cursor=cursor, generator=generator, sync=sync, trainer=trainer,
        tokenizer=tokenizer, reward_funcs=reward_funcs, reward_weights=_reward_weights(config, task, judge), params=plan.sampling,
        logger=_logger(config, run_dir, start_step) if dp.is_main else Silent(), progress=_progress(config, plan, start_step, device) if dp.is_main else Silent(),
        evals=evals, run_dir=run_dir, dp=dp, flags=saved_flags(config),
    )  # fmt: skip
    if state is not None:
        set_rng_state(state["rng"])  # last: building the parts above must not move the RNGs
    try:
        with frozen_heap(), one_line_when_a_rank_fails(dp, run_dir, config.trainer.ddp_timeout):
            settings = dataclasses.replace(plan.loop, num_tokens_seen=_tokens_seen(run_dir, start_step), planned_peaks_gib=planned_peaks_gib(memory))
            asyncio.run(_main(parts, settings, start_step, config, judge_generator))
    except KeyboardInterrupt as interrupt:
        if dp.is_main:
            print(f"tandem train: interrupted; {how_to_continue(run_dir, dp.world_size)}", file=sys.stderr, flush=True)
            interrupt.said = True  # type: ignore[attr-defined]  (cli/main's own "interrupted" line would repeat it)
        raise
    finally:
        parts.progress.close()
        parts.logger.close()
        if dp.is_main:
            _point_latest(run_dir)
        close_data_parallel(dp)
    return run_dir


def _trainer(config: TrainConfig, plan: Plan, model: Any, dp: DataParallel) -> Trainer:
    """The trainer, scoring under the plan's sampling (its temperature; its top-k where that is the only filter)."""
    return Trainer(
        config.trainer, config.algo, model, max_steps=plan.loop.max_steps, temperature=plan.sampling.temperature,
        top_k=plan.sampling.top_k_alone, offload=config.offload, dp=dp,
        modules_to_save_lr=config.lora.lora_modules_to_save_learning_rate if config.lora.enabled else None,
    )  # fmt: skip


def _resume(trainer: Trainer, cursor: PromptCursor, state: dict[str, Any], checkpoint: Path) -> None:
    """The checkpoint's trainer (optimizer included) and prompt cursor restored."""
    trainer.load_state_dict(state["trainer"], optimizer_shards=sharded_optimizer(checkpoint))
    cursor.load_state_dict(state["cursor"])
    log.info("resuming from %s (step %d, policy version %d)", checkpoint, state["step"], trainer.policy_version)


def _check_flags(config: TrainConfig, state: dict[str, Any], checkpoint: Path) -> None:
    """--resume continues what the checkpoint computed: flags changed since that change it are refused in one
    line unless --resume_allow_changed_flags (then a warning names them); the others (config.py's
    RESUME_MAY_CHANGE: length, logging, saving, placement, memory) are named in an info line."""
    saved = state.get("flags")
    if saved is None:
        log.warning("--resume: %s records no flags (written before tandem kept them there), so this run's flags could not be checked against it", checkpoint.name)
        return
    changed = changed_flags(saved, config)
    free = {k: v for k, v in changed.items() if k in RESUME_MAY_CHANGE}
    checked = {k: v for k, v in changed.items() if k not in RESUME_MAY_CHANGE}
    if checked and not config.checkpoint.resume_allow_changed_flags:
        raise ValueError(
            f"--resume: {_changes(checked)} since {checkpoint.name} change what the run computes; to continue it as it was, "
            "leave them out (or give the old values); to continue with them, add --resume_allow_changed_flags; or start a new run in another --output_dir"
        )
    if free:
        t = config.trainer  # a schedule that decays to the last step (or warms up over a share of the steps) is stretched
        stretched = ("max_steps" in free or "num_train_epochs" in free) and (t.lr_scheduler_type != "constant" or (t.warmup_ratio and not t.warmup_steps))
        log.info("--resume: %s since %s%s", _changes(free), checkpoint.name, "; the learning-rate schedule spans the new length from here on" if stretched else "")
    if checked:
        log.warning("--resume_allow_changed_flags: %s continues with %s", checkpoint.name, _changes(checked))


def _changes(changes: dict[str, tuple[Any, Any]]) -> str:
    """Example: {"learning_rate": (0.001, 0.002), "bf16": (True, False)} -> --learning_rate 0.001 -> 0.002, --bf16 true -> false"""
    return ", ".join(f"--{flag} {_shown(old)} -> {_shown(new)}" for flag, (old, new) in changes.items())


def _shown(value: Any) -> str:
    """A flag's value as typed on the command line (a list in brackets, so the commas between flags stay clear)."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None or value == "":
        return "null" if value is None else '""'
    if isinstance(value, (list, tuple)):
        return f"[{' '.join(map(str, value))}]"
    return json.dumps(value) if isinstance(value, dict) else str(value)


def _memory_plan(config: TrainConfig, device: torch.device, num_ranks: int) -> Any:
    """The memory plan of this run on its GPU (cli/plan.py), or None on a CPU; a run that cannot fit stops
    here, in one line, before anything loads."""
    if device.type != "cuda":
        return None
    hf_config = model_config(config)
    try:
        shape = ModelShape.from_hf_config(hf_config)
    except ValueError as error:  # a family the arithmetic does not describe: the engine sizes itself as before
        log.warning("%s; the KV cache comes from --gpu_memory_utilization and no lever is turned on", error)
        return None
    return plan_run(config, shape, memory_setup(config, num_ranks=num_ranks, hf_config=hf_config), gpu_bytes(device))


def _logger(config: TrainConfig, run_dir: Path, start_step: int) -> Any:
    from tandemrl.logging.metrics import MetricsLogger

    return MetricsLogger(
        run_dir, report_to=list(config.log.report_to), config=config.to_dict(), run_name=config.log.run_name or run_dir.name,
        first_step=start_step,
    )  # fmt: skip


async def _servers_take_adapters(parts: LoopParts, settings: LoopSettings, config: TrainConfig) -> bool:
    """Whether a LoRA policy's pushes to its rollout servers may carry only the adapters: every server applies
    adapters of --lora_r beside its base (`tandem rollout --max_lora_rank`), one trainer process, no level-2
    sleep (whose refill needs the base), and --lora_engine not merged. Waits for the servers to be ready."""
    if config.generation.rollout_mode != "server" or not config.lora.enabled or config.lora.lora_engine == "merged":
        return False
    if settings.sleep_level >= 2 or parts.dp.enabled:
        return False
    servers = await parts.generator.client.servers_ready()
    return bool(servers) and all(s.get("max_lora_rank", 0) >= config.lora.lora_r for s in servers)


def _progress(config: TrainConfig, plan: Plan, start_step: int, device: torch.device) -> Any:
    from tandemrl.logging.progress import Progress

    return Progress(
        plan.loop.max_steps, start_step=start_step, logging_steps=every_steps(config.log.logging_steps, plan.loop.max_steps),
        num_rollouts=config.data.num_prompts_per_step * config.data.num_generations, memory_gb=_peak_memory_gb(device),
        heartbeat_s=config.log.heartbeat_s, watch=True,
    )  # fmt: skip


async def _main(parts: LoopParts, settings: LoopSettings, start_step: int, config: TrainConfig, judge_generator: Any) -> None:
    if await _servers_take_adapters(parts, settings, config):  # then each push after the first carries only what training changes
        from tandemrl.train.lora import frozen_base

        parts.trainer.engine_unshared = {name for name, _ in frozen_base(parts.trainer.model)}  # the first push: the base too
        parts.sync.takes_changed_only = True
    # the generator must hold the trainer's current version before the first rollout (resume, servers)
    await publish_policy(parts)
    try:
        async with open_tool_env(config.tools) as env:  # MCP sessions: opened once, closed when the run ends
            tools = env.tools if env is not None else None
            source = f"--dataset {config.data.dataset}" if config.data.dataset else f"task {config.run.task}'s data"
            parts.prompt_ids = _prompt_ids(config, parts.examples, parts.tokenizer, tools, source)
            if parts.evals is not None:
                parts.evals.prompt_ids = _prompt_ids(config, parts.evals.examples, parts.tokenizer, tools, f"--eval_dataset {config.data.eval_dataset}")
            if env is not None:
                parts.multi_turn = MultiTurn(
                    env=env, chat=ChatFormat(parts.tokenizer, tools, chat_template_kwargs=config.data.chat_template_kwargs),
                    max_turns=config.tools.max_turns, max_total_tokens=config.tools.max_total_tokens, warm_up=config.tools.warm_up_turns,
                )
            await run_loop(parts, settings, start_step=start_step)
    finally:
        await parts.sync.close()
        await parts.generator.close()
        if judge_generator is not None:
            await judge_generator.close()


def _banner(config: TrainConfig, plan: Plan, model: Any, device: torch.device, run_dir: Path, num_ranks: int, generator: Any) -> list[str]:
    from tandemrl.generation.base import describe_generator
    from tandemrl.logging.console import banner

    where = f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)
    if num_ranks > 1:
        split = config.engine.tensor_parallel_size
        if config.generation.rollout_mode == "server":
            how = "; rank 0 drives the rollout servers"
        else:
            how = f"; engines split over {split} ranks" if split > 1 else ""
        where = f"{num_ranks} ranks (FSDP2{how}), rank 0 on {where}"
    autocast = ", bfloat16 autocast" if device.type == "cuda" and config.trainer.bf16 else ""
    return banner(
        model=config.run.model, num_parameters=sum(p.numel() for p in model.parameters()), task=config.run.task,
        device=where, dtype=f"{config.trainer.dtype} weights{autocast}", num_prompts=config.data.num_prompts_per_step,
        num_generations=config.data.num_generations, loss_type=config.algo.loss_type,
        learning_rate=config.trainer.learning_rate, max_steps=plan.loop.max_steps, run_dir=str(run_dir),
        generator=describe_generator(generator),
        lora=_lora_line(config, model),
    )  # fmt: skip


def _lora_line(config: TrainConfig, model: Any) -> str:
    """The banner's LoRA line ("" without LoRA)."""
    from tandemrl.logging.console import lora_line

    lora = config.lora
    if not lora.enabled:
        return ""
    rate = lora.lora_modules_to_save_learning_rate
    return lora_line(
        r=lora.lora_r, alpha=lora.lora_alpha, targets=lora.lora_target_modules, trained=sum(p.numel() for p in model.parameters() if p.requires_grad),
        whole=lora.lora_modules_to_save, whole_lr=config.trainer.learning_rate if rate is None else rate,
    )  # fmt: skip


def _peak_memory_gb(device: torch.device) -> Any:
    """A reader of the peak GPU memory allocated so far (None on a CPU: nothing worth showing)."""
    if device.type != "cuda":
        return lambda: None
    return lambda: torch.cuda.max_memory_allocated(device) / 2**30


def _run_dir(config: TrainConfig) -> Path:
    """--output_dir (never one holding a resumable run, unless --resume), else a new runs/<date-time>[-N].
    A run that ended before its first checkpoint restarts in place: its files are moved aside first."""
    c = config.checkpoint
    if c.output_dir:
        run_dir = Path(c.output_dir)
        if run_dir.exists() and not run_dir.is_dir():
            raise ValueError(f"--output_dir {run_dir} is a file; pass a directory (it is created if missing)")
        created = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        _hold_run_lock(run_dir, created=created)  # before anything in it is read or moved: a run still writing it keeps it
        if not c.resume and latest_checkpoint(run_dir) is not None:
            raise ValueError(f"--output_dir {run_dir} already holds a run; pass --resume to continue it, or another --output_dir")
        if latest_checkpoint(run_dir) is None:
            _set_aside(run_dir, resumed=c.resume)
        return run_dir
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in itertools.count():
        run_dir = Path("runs") / (f"{stamp}-{n}" if n else stamp)
        try:
            run_dir.mkdir(parents=True)  # fails if it exists: two runs started in one second get two directories
        except FileExistsError:
            continue
        _hold_run_lock(run_dir, created=True)
        return run_dir
    raise AssertionError("unreachable")


RUN_LOCK = ".tandem-run.lock"  # in a run directory: locked (flock) by the process training into it
_held_locks: list[Any] = []  # their open files, for the process's life (the lock ends with the process)


def _hold_run_lock(run_dir: Path, *, created: bool) -> None:
    """Two runs never share a directory: this process holds its lock until it exits, or the directory
    is another live run's (a second `tandem train --output_dir` of it, or `--resume` while it runs).
    `created`: this process made run_dir, and removes it at exit if the run wrote nothing there."""
    lock = open(run_dir / RUN_LOCK, "a")  # held open for the process's life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ValueError(f"--output_dir {run_dir} is in use by a tandem train still running; wait for it to end, or pass another --output_dir") from None
    _held_locks.append(lock)
    if created:  # a run stopped before its first file (bad data, a missing model) leaves no empty directory
        atexit.register(_drop_if_unused, run_dir)


def _drop_if_unused(run_dir: Path) -> None:
    """Removes run_dir if it holds nothing but its lock file."""
    with contextlib.suppress(OSError):
        if [p.name for p in run_dir.iterdir()] == [RUN_LOCK]:
            shutil.rmtree(run_dir)


def _set_aside(run_dir: Path, *, resumed: bool) -> None:
    """A run directory without a complete checkpoint (a run that failed before its first) is reused: the files
    of that attempt move to attempt-<date-time>/ inside it, said in one line."""
    leftovers = [p for p in run_dir.iterdir() if not p.name.startswith("attempt-") and p.name != RUN_LOCK] if run_dir.is_dir() else []
    if not leftovers:
        if resumed:
            log.info("--resume: %s holds no run yet; starting it", run_dir)
        return
    aside = run_dir / f"attempt-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    for n in itertools.count(1):
        if not aside.exists():
            break
        aside = aside.with_name(f"{aside.name.split('.')[0]}.{n}")
    aside.mkdir()
    for path in leftovers:
        path.rename(aside / path.name)
    why = "--resume: no complete checkpoint, so starting afresh; " if resumed else ""
    log.info("%s%s held a run that ended before its first checkpoint: its files are now in %s", why, run_dir, aside)


def _point_latest(run_dir: Path) -> None:
    """runs/latest -> run_dir, once the run has logged a step (a run that failed before keeps the old one)."""
    metrics = run_dir / "metrics.jsonl"
    latest = run_dir.parent / "latest"
    if metrics.exists() and metrics.stat().st_size and (latest.is_symlink() or not latest.exists()):
        latest.unlink(missing_ok=True)
        latest.symlink_to(run_dir.resolve(), target_is_directory=True)


def _resume_point(config: TrainConfig, run_dir: Path) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to resume from and its trainer state: the newest that reads (a torn one is passed over)."""
    found = resumable_checkpoint(run_dir) if config.checkpoint.resume else None
    return found if found is not None else (None, None)  # None: _run_dir said so, and the run starts afresh


def _policy(config: TrainConfig, checkpoint: Path | None, device: torch.device | None = None) -> tuple[Any, Any]:
    """The tokenizer and the policy on `device` (default: --device's); with LoRA the base model wrapped with
    adapters (a resumed run's from its checkpoint, which holds the adapter only). A LoRA base in one process
    on a GPU with --bf16 is loaded in bfloat16, once: it is frozen, so no float32 master and no compute copy
    (the float32 adapters run under autocast: train/forward.py)."""
    device = device or resolve_device(config.trainer.device)
    dtype = resolve_dtype(config.trainer.dtype, device)
    lora = config.lora.enabled
    if lora and device.type == "cuda" and config.trainer.bf16 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        dtype = torch.bfloat16
    source = str(checkpoint) if checkpoint is not None and not lora else config.run.model
    if source == TINY_MODEL:
        from tandemrl.tasks.tiny import build_model, build_tokenizer

        tokenizer = build_tokenizer()
        model = build_model(tokenizer, seed=config.run.seed).to(device=device, dtype=dtype)
    else:
        trust = config.run.trust_remote_code
        model = load_model(source, dtype=dtype, device=device, trust_remote_code=trust, **config.run.model_init_kwargs)
        tokenizer = load_tokenizer(source, trust_remote_code=trust)
    if lora:
        from tandemrl.train.lora import apply_lora

        model = apply_lora(model, config.lora, adapter_dir=str(checkpoint) if checkpoint is not None else None)
    return tokenizer, model


def max_steps(config: TrainConfig, num_examples: int) -> int:
    """--max_steps, or when --num_train_epochs is set, ceil(epochs x examples / prompts per step).

    Example: 2 epochs of 100 examples at 16 prompts per step -> 13
    """
    epochs = config.run.num_train_epochs
    if epochs is None:
        return config.run.max_steps
    return max(1, math.ceil(epochs * num_examples / config.data.num_prompts_per_step))


def _say_step_ratios(config: TrainConfig, steps: int) -> None:
    """TRL's ratio forms that waited for the data (--num_train_epochs decides the steps): a line each saying
    the steps they became (trl.finish says those a --max_steps run fixes when the flags are read)."""
    ratios = {"logging_steps": config.log.logging_steps, "save_steps": config.checkpoint.save_steps, "eval_steps": config.data.eval_steps}
    for flag, value in ratios.items():
        if 0 < value < 1 and (flag != "eval_steps" or config.data.eval_dataset):
            log.info("%s %s (TRL: a ratio of the run's %d steps) -> %d", flag, value, steps, every_steps(value, steps))


def _check_conversation_length(config: TrainConfig, model: Any) -> None:
    """A tool conversation fits the model's positions (the rule against --max_prompt_length is config.py's)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if config.tools.enabled and limit and config.tools.max_total_tokens > limit:
        raise ValueError(f"--max_total_tokens {config.tools.max_total_tokens} must fit the model's {limit} positions; lower it")


def _task(config: TrainConfig) -> Task | None:
    """The built-in task, once; --dataset points it at a local or other copy of its data."""
    if not config.run.task:
        return None
    options = {"data": config.data.dataset, "split": config.data.dataset_split} if config.data.dataset else {}
    return get_task(config.run.task, **options)


def _data(config: TrainConfig, task: Task | None) -> list[Example]:
    if task is not None:  # a task reads its own data format
        return task.load()
    if config.data.dataset:
        return load_examples(config.data.dataset, split=config.data.dataset_split)
    raise ValueError("no data: pass --dataset (hub id, .jsonl/.json/.parquet/.csv file or directory) or --task")


def _eval_split(d: DataConfig) -> str:
    """--eval_dataset_split; at its default ('test') a single --eval_dataset file is read whole (its one split,
    'train'): an evaluation file is the evaluation set. Another split of a file is refused, as for --dataset."""
    given = d.eval_dataset_split != DataConfig.eval_dataset_split
    return FILE_SPLIT if not given and is_one_file(d.eval_dataset) else d.eval_dataset_split


def _eval_set(config: TrainConfig) -> EvalSet | None:
    """--eval_dataset's examples (in the task's format when there is a task; tokenized with the training
    prompts, in _main), or None without one."""
    d = config.data
    if not d.eval_dataset:
        return None
    split = _eval_split(d)
    if config.run.task:
        examples = get_task(config.run.task, data=d.eval_dataset, split=split).load()
    else:
        examples = load_examples(d.eval_dataset, split=split)
    return EvalSet(
        examples=examples, prompt_ids=[], eval_steps=d.eval_steps,
        num_generations=d.num_generations_eval or d.num_generations,
    )  # fmt: skip


def _prompt_ids(config: TrainConfig, examples: list[Example], tokenizer: Any, tools: list[dict] | None, source: str) -> list[list[int]]:
    """Every prompt in tokens, with the tools' schemas when there are tools (known once MCP servers answer); `source`
    names the data in the error of a prompt past --max_prompt_length."""
    prompt_ids = []
    for example in examples:
        ids = encode_prompt(tokenizer, example.prompt, tools=tools, **config.data.chat_template_kwargs)
        check_prompt_length(ids, config.data.max_prompt_length, example.index, source)
        prompt_ids.append(ids)
    return prompt_ids


def _rewards(config: TrainConfig, task: Task | None) -> list:
    names = list(config.reward.reward_funcs) or (task.reward_funcs if task is not None else [])
    if not names and not config.judge.enabled:
        raise ValueError("no reward functions: pass --reward_funcs (e.g. math_accuracy format, or module:function) or --reward_model")
    return load_reward_funcs(names)


def _reward_weights(config: TrainConfig, task: Task | None, judge: RewardFunc | None) -> list[float] | None:
    """--reward_weights (the judge, last, counts too); else the task's weights when its reward functions
    are used, and 1.0 for the judge; else 1.0 each."""
    if config.reward.reward_weights:
        return list(config.reward.reward_weights)
    if config.reward.reward_funcs or task is None or task.reward_weights is None:
        return None
    return task.reward_weights + ([1.0] if judge is not None else [])


def _judge(config: TrainConfig, plan: Plan, *, scores: bool = True) -> tuple[Any, RewardFunc | None]:
    """The generative reward model's Generator (None for a plugin that needs none) and its reward function.
    On a rank that scores no groups (`DataParallel.scores`) neither is built: the judge's place among the
    reward functions is kept, and calling it there is a bug."""
    j = config.judge
    if not j.enabled:
        return None, None
    if not scores:
        return None, RewardFunc(name="reward_model", fn=_judged_elsewhere)
    generator = tokenizer = None
    if plan.judge is not None:  # its server, or its own engine beside the policy's, in its own thread
        tokenizer = load_tokenizer(j.reward_model)
        generator = build_generator(plan.judge, tokenizer=tokenizer)
    judge = build_judge(j, generator=generator, tokenizer=tokenizer)
    return generator, RewardFunc(name="reward_model", fn=judge)


def _judged_elsewhere(*_: Any, **__: Any) -> list:
    raise RuntimeError("the reward model scores on the ranks that generate; this rank generates no groups")


def _engine_ranks(dp: DataParallel) -> Any:
    """This rank's tensor-parallel group of the colocated engine (None when each rank has its own engine).
    A collective: every rank calls it."""
    if dp.tensor_parallel_size == 1:
        return None
    from tandemrl.generation.engine.parallel import split_world

    return split_world(dp.tensor_parallel_size)


def _rollout_side(
    config: TrainConfig, plan: Plan, model: Any, tokenizer: Any, *, device: str = "", tp: Any = None, dp: DataParallel = SINGLE
) -> tuple[Any, Any]:
    """The Generator of `plan.generator` and the WeightSync that feeds it (colocated on `device` when given,
    this rank's under torchrun; split over the ranks of `tp` when given). Servers under torchrun: rank 0's
    client, and every rank's share of the sharded push. Under torchrun the shards are gathered in the
    trainer's 16-bit compute dtype (in one process the trainer publishes its 16-bit twin)."""
    gather_dtype = compute_dtype(config.trainer, model) if dp.enabled else None
    if config.generation.rollout_mode == "server":
        batches = config.local_sync.move_model_batches
        if dp.enabled and not dp.is_main:
            return ServedByRankZero(), ShardedSync(None, dp, move_model_batches=batches, gather_dtype=gather_dtype)
        generator = build_generator(plan.generator)
        sync = build_weight_sync(config.distributed_sync, generator)
        if dp.enabled:
            sync = ShardedSync(sync, dp, move_model_batches=batches, gather_dtype=gather_dtype)
        return generator, sync
    backend = dataclasses.replace(plan.generator, device=device) if device and not config.generation.generator_device else plan.generator
    policy = model
    shared = config.lora.enabled and config.lora_engine_shares_base(num_ranks=dp.world_size, hf_config=model.config)
    if config.lora.enabled:  # the engine reads a plain model: the base it applies the adapters beside, or the merged weights
        from tandemrl.train.lora import BaseView, MergedView

        model = BaseView(model) if shared else MergedView(model)
    generator = build_generator(backend, model=model, tokenizer=tokenizer, tp=tp, adapter_rank=config.lora.lora_r if shared else 0)
    if shared:  # the trainer's frozen base becomes the engine's tensors (Engine.share_base)
        from tandemrl.train.lora import frozen_base

        generator.share_base(frozen_base(policy))
    return generator, build_weight_sync(config.local_sync, generator, gather_dtype=gather_dtype)


def _tokens_seen(run_dir: Path, start_step: int) -> int:
    """TRL's num_tokens at `start_step` (0 for a new run): a resumed run counts on from its metrics."""
    if start_step == 0:
        return 0
    from tandemrl.logging.metrics import last_value

    return int(last_value(run_dir, "num_tokens", step=start_step) or 0)


def saved_flags(config: TrainConfig) -> dict[str, Any]:
    """The run's flags as run_dir/config.yaml and each checkpoint keep them: the next run that reads them is
    not resumed, nor allowed changed flags, unless it says so itself."""
    return {**config.to_dict(), "resume": False, "resume_allow_changed_flags": False}


def _save_config(config: TrainConfig, run_dir: Path) -> None:
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(dump_yaml(saved_flags(config)))
    os.replace(tmp, run_dir / "config.yaml")
