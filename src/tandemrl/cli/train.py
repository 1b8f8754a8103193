"""`tandem train`: resolves the config (defaults < task recipe < --config yaml < flags; a --resume's base
is its checkpoint's flags), builds the parts from their leaf configs, and runs the loop. The only place that
picks recipes and prints."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tandemrl.cli import trl
from tandemrl.cli.args import ArgumentParser, add_config_args, build_config, check_known, dump_yaml, load_yaml, to_bool
from tandemrl.cli.main import rank_zero
from tandemrl.config import LEAVES, TrainConfig

log = logging.getLogger(__name__)
RAW_FLAGS = ("scale_rewards", "logging_steps", "save_steps", "eval_steps", "report_to", "dtype", "reward_weights")
"""Flags whose values argparse keeps as text: TRL writes other forms of them (trl.finish translates)."""
PLAN_KEY = "plan"  # --print_config's key of the resolved plan

# Help-group titles by leaf class name; a leaf not named here gets one from its class name.
TITLES = {
    "RunConfig": "Task and model",
    "DataConfig": "Data",
    "GenerationConfig": "Generation",
    "EngineSettings": "Engine (--generator engine)",
    "RewardConfig": "Rewards",
    "AlgoConfig": "Algorithm",
    "TrainerConfig": "Optimizer and training",
    "CheckpointConfig": "Run directory and checkpoints",
    "LogConfig": "Logging",
    "LocalSyncConfig": "Weight sync (colocate)",
    "DistributedSyncConfig": "Weight sync (server mode)",
    "OffloadConfig": "Memory levers (colocate; with --sleep_level)",
    "LoraConfig": "LoRA (peft)",
}


def parse(argv: list[str]) -> tuple[TrainConfig, dict[str, Any]]:
    """The resolved config and the raw flag values (for logs); `--print_config` is among the flags."""
    parser = ArgumentParser(
        prog="tandem train",
        usage="tandem train [--config YAML] [--print_config] [--print_plan [GB]] [--FLAG VALUE ...]",
        description="Train a policy by GRPO-family RL. With no arguments: the embedded default "
        "(a tiny policy built in code learns the synthetic task on a CPU in about a minute).",
        epilog="TRL 1.16's GRPOConfig, ScriptArguments and ModelConfig keys are accepted too, in yaml and as flags "
        "(--model_name_or_path, --per_device_train_batch_size, --use_vllm, ...): each is a flag above, translated "
        "to one, or ignored, with one line saying which (README: Coming from TRL).",
        hints=trl.HINTS,
    )
    parser.add_argument("--config", default=None, metavar="YAML", help="YAML file of flag: value defaults (flags override)")
    parser.add_argument("--print_config", action="store_true", help="print the resolved configuration and its plan (what the run builds) as YAML, and exit")
    parser.add_argument(
        "--print_plan", nargs="?", const="auto", default=None, metavar="GB",
        help="print the memory plan (every resident of each phase, the levers it turns on, KV cache and micro-batch) "
        "for this machine's GPU, or for a GPU of GB gigabytes (e.g. 80), and exit; nothing loads but the model's config",
    )  # fmt: skip
    notes = recipe_notes()
    for leaf in LEAVES:
        add_config_args(parser, leaf, title=TITLES.get(leaf.__name__), notes=notes, raw=RAW_FLAGS)
    for key in sorted(trl.TRL_KEYS):  # TRL's names, kept out of --help (the epilog says so)
        parser.add_argument(f"--{key}", nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    flags = vars(parser.parse_args(argv))
    config_path = flags.pop("config")
    yaml_values = load_yaml(config_path) if config_path else {}
    yaml_values.pop(PLAN_KEY, None)  # --print_config's output is a --config file: the plan is derived, never read
    check_known(yaml_values, list(LEAVES), config_path or "", command="train", also=trl.TRL_KEYS, hints=trl.HINTS)
    given = {k: _unwrap(v) if k in trl.TRL_KEYS else v for k, v in flags.items() if k not in ("print_config", "print_plan")}
    values = _translated(yaml_values, given)
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    leaves = {name: build_config(leaf, values) for name, leaf in zip(fields, LEAVES)}
    return TrainConfig(**leaves), flags


def _unwrap(values: list[str]) -> Any:
    """A TRL-named flag's values: none = a bare switch (true), one = that value, several = the list."""
    return True if not values else values[0] if len(values) == 1 else values


def _translated(yaml_values: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """resolve() over the two sources with TRL's keys and value forms made tandem's, a line logged per translation."""
    notes: list[str] = []
    yaml_values, flags = trl.over_yaml(yaml_values, flags)
    yaml_values, flags = trl.translate_keys(yaml_values, notes), trl.translate_keys(flags, notes)
    user = {**yaml_values, **flags}
    full = resolve(yaml_values, flags)
    context = {**TrainConfig().to_dict(), **{k: v for k, v in full.items() if k not in user}}
    fixed = trl.finish(user, notes, defaults=context)
    for note in dict.fromkeys(notes):
        log.info("%s", note)
    return {**{k: v for k, v in full.items() if k not in user and k not in trl.TRL_BATCH}, **fixed}


def recipe_notes() -> dict[str, str]:
    """Per flag, the tasks whose recipe overrides its default, for --help.

    Example: {"learning_rate": "[task synthetic (the default): 0.001]", ...}
    """
    from tandemrl.tasks import TASKS, get_task

    defaults = TrainConfig().to_dict()
    found: dict[str, list[str]] = {}
    for name in TASKS:
        task = get_task(name)
        label = "task synthetic (the default)" if name == "synthetic" else f"task {name}"
        for flag, value in task.recipe.items():
            if defaults.get(flag) != value:
                found.setdefault(flag, []).append(f"{label}: {value}")
        for flag, value in task.lora_recipe.items():
            shown = " ".join(value) if isinstance(value, tuple) else value
            found.setdefault(flag, []).append(f"{label} with --lora_r: {shown}")
    return {flag: f"[{'; '.join(parts)}]" for flag, parts in found.items()}


def resolve(yaml_values: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """defaults < task recipe < the resumed checkpoint's flags (when resuming) < yaml < flags."""
    values = {**yaml_values, **flags}
    saved = _resumed(Path(values["output_dir"])) if _given_true(values, "resume") and values.get("output_dir") else {}
    chosen = {**saved, **values}
    task = chosen.get("task") or ("" if chosen.get("dataset") else "synthetic")
    recipe: dict[str, Any] = {}
    if task:
        from tandemrl.tasks import get_task

        found = get_task(task)
        recipe = dict(found.recipe)
        # the LoRA recipe is measured on the recipe's model (the embedded default's final norm at 1.0 would
        # wreck a pretrained one), so another --model keeps the plain recipe
        if _wants_lora(chosen) and chosen.get("model", recipe.get("model")) == recipe.get("model"):
            recipe.update(found.lora_recipe)
    return {**recipe, **chosen, "task": task}


def _resumed(run_dir: Path) -> dict[str, Any]:
    """The flags a --resume of run_dir continues: those its checkpoint kept (the state resumed is theirs), else
    (a checkpoint from before they were kept, or none yet) its config.yaml's. config.yaml holds the newest run's
    flags from its start: ahead of the checkpoint when a run with changed flags died before its next one."""
    from tandemrl.train.checkpoint import resumed_flags

    kept = resumed_flags(run_dir)
    if kept is not None:
        return kept
    path = run_dir / "config.yaml"
    return load_yaml(str(path)) if path.exists() else {}


def _given_true(values: dict[str, Any], key: str) -> bool:
    """Whether the bool `key` is given true (`resume: 'no'` in yaml is not); a bad value is reported where the flags are read."""
    try:
        return key in values and to_bool(key, values[key])
    except ValueError:
        return False


def _wants_lora(values: dict[str, Any]) -> bool:
    """Whether the flags ask for LoRA: --lora_r > 0, or TRL's --use_peft (r 16 unless given).

    Example: {"lora_r": 16} -> True; {"use_peft": "true"} -> True; {"use_peft": "false", "lora_r": 8} -> False
    """
    try:
        if "use_peft" in values and not to_bool("use_peft", values["use_peft"]):
            return False  # TRL reads the lora_* keys only with use_peft
        return "use_peft" in values and "lora_r" not in values or int(values.get("lora_r") or 0) > 0
    except (TypeError, ValueError):
        return False  # a bad value is reported where the flags are read


def main(argv: list[str]) -> int:
    rank = int(os.environ.get("RANK", "0"))  # under torchrun only rank 0 prints and logs
    logging.basicConfig(
        level=logging.WARNING if rank else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
        handlers=[LogLines()],
    )  # fmt: skip
    for noisy in ("httpx", "httpx2", "mcp", "urllib3", "filelock"):  # mcp: its client and httpx2 log each request
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config, flags = parse(argv)
    plan = config.resolve()
    if flags.get("print_config"):  # the flags (a --config file as is; its plan: key is ignored there) and what they resolve to
        print(dump_yaml({**config.to_dict(), PLAN_KEY: plan.to_dict()}), end="")
        return 0
    if flags.get("print_plan"):
        from tandemrl.cli.plan import print_plan

        print_plan(config, flags["print_plan"])
        return 0
    for note in plan.notes:
        log.warning(note)
    from tandemrl.cli.inputs import check_inputs

    if _finished(config):
        return 0
    check_inputs(config)  # before transformers is imported: it reads HF_HUB_OFFLINE once
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-checkpoint "Writing model shards" bars drown the heartbeat
    from tandemrl.cli.build import run

    started = time.monotonic()
    with ctrl_c_ends_the_run():
        run_dir = run(config, plan)
    if rank:
        return 0
    from tandemrl.logging.console import summary
    from tandemrl.logging.metrics import read_metrics
    from tandemrl.train.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(run_dir)
    lines = summary(read_metrics(run_dir), wall_s=time.monotonic() - started, run_dir=str(run_dir), checkpoint=str(checkpoint) if checkpoint else None)
    print("\n".join(lines))
    return 0


class LogLines(logging.Handler):
    """Log records as lines on stderr in step with the console: stdout is flushed first, so a log file holding
    both keeps them in the order they happened, and stderr is looked up per record, so on a terminal the
    progress bar (which redirects it while live) prints the line above itself instead of breaking it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.flush()
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 (logging's own contract: a handler never raises)
            self.handleError(record)


def _finished(config: TrainConfig) -> bool:
    """--resume of a run whose newest checkpoint is already at --max_steps: say so (nothing to train)."""
    c = config.checkpoint
    if not (c.resume and c.output_dir) or config.run.num_train_epochs is not None:
        return False
    from tandemrl.train.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(c.output_dir)
    done = int(checkpoint.name.rpartition("-")[2]) if checkpoint is not None else 0
    if done < config.run.max_steps:
        return False
    print(f"tandem train: {c.output_dir} already finished: checkpoint-{done} is step {done} of --max_steps {config.run.max_steps}; "
          f"nothing to train (pass a larger --max_steps to train on)")  # fmt: skip
    return True


@contextlib.contextmanager
def ctrl_c_ends_the_run(grace_s: float = 10.0):
    """SIGINT always ends the run within seconds. The first raises KeyboardInterrupt in the main thread,
    so the loop unwinds (exit 130, checkpoints are renamed into place whole, never half-written); a
    thread that would hold the exit (a reward that never returns, a step in flight) gets `grace_s`, then
    the process exits. A second SIGINT exits at once."""

    def exit_now() -> None:
        if rank_zero():  # torchrun sends every rank the Ctrl-C: rank 0 says it
            print("tandem train: interrupted", file=sys.stderr, flush=True)
        os._exit(130)

    def on_sigint(signum: int, frame: Any) -> None:
        if interrupted.is_set():
            exit_now()
        interrupted.set()
        timer = threading.Timer(grace_s, exit_now)
        timer.daemon = True  # never holds an exit that happens in time
        timer.start()
        raise KeyboardInterrupt

    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        if not interrupted.is_set():  # once interrupted, a second Ctrl-C during the unwinding still exits
            signal.signal(signal.SIGINT, previous)
