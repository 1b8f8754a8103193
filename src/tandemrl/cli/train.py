"""`tandem train`: resolves the config (defaults < task recipe < --config yaml < flags), builds the
parts from their leaf configs, and runs the loop. The only place that picks recipes and prints."""

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

from tandemrl.cli.args import ArgumentParser, add_config_args, build_config, check_known, dump_yaml, load_yaml
from tandemrl.config import LEAVES, TrainConfig

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
        usage="tandem train [--config YAML] [--print_config] [--FLAG VALUE ...]",
        description="Train a policy by GRPO-family RL. With no arguments: the embedded default "
        "(a tiny policy built in code learns the synthetic task on a CPU in about a minute).",
    )
    parser.add_argument("--config", default=None, metavar="YAML", help="YAML file of flag: value defaults (flags override)")
    parser.add_argument("--print_config", action="store_true", help="print the resolved configuration as YAML and exit")
    notes = recipe_notes()
    for leaf in LEAVES:
        add_config_args(parser, leaf, title=TITLES.get(leaf.__name__), notes=notes)
    flags = vars(parser.parse_args(argv))
    config_path = flags.pop("config")
    values = load_yaml(config_path) if config_path else {}
    check_known(values, list(LEAVES), config_path or "", command="train")
    values = resolve(values, {k: v for k, v in flags.items() if k != "print_config"})
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    leaves = {name: build_config(leaf, values) for name, leaf in zip(fields, LEAVES)}
    return TrainConfig(**leaves), flags


def recipe_notes() -> dict[str, str]:
    """Per flag, the tasks whose recipe overrides its default, for --help.

    Example: {"learning_rate": "[task synthetic (the default): 0.001]", ...}
    """
    from tandemrl.tasks import TASKS, get_task

    defaults = TrainConfig().to_dict()
    found: dict[str, list[str]] = {}
    for name in TASKS:
        for flag, value in get_task(name).recipe.items():
            if defaults.get(flag) != value:
                label = "task synthetic (the default)" if name == "synthetic" else f"task {name}"
                found.setdefault(flag, []).append(f"{label}: {value}")
    return {flag: f"[{'; '.join(parts)}]" for flag, parts in found.items()}


def resolve(yaml_values: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """defaults < task recipe < run dir's saved config (when resuming) < yaml < flags."""
    values = {**yaml_values, **flags}
    saved: dict[str, Any] = {}
    if values.get("resume") and values.get("output_dir"):
        saved_path = Path(values["output_dir"]) / "config.yaml"
        saved = load_yaml(str(saved_path)) if saved_path.exists() else {}
    chosen = {**saved, **values}
    task = chosen.get("task") or ("" if chosen.get("dataset") else "synthetic")
    recipe: dict[str, Any] = {}
    if task:
        from tandemrl.tasks import get_task

        recipe = dict(get_task(task).recipe)
    return {**recipe, **chosen, "task": task}


def main(argv: list[str]) -> int:
    config, flags = parse(argv)
    if flags.get("print_config"):
        print(dump_yaml(config.to_dict()), end="")
        return 0
    rank = int(os.environ.get("RANK", "0"))  # under torchrun only rank 0 prints and logs
    logging.basicConfig(level=logging.WARNING if rank else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from tandemrl.cli.inputs import check_inputs

    check_inputs(config)  # before transformers is imported: it reads HF_HUB_OFFLINE once
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # per-checkpoint "Writing model shards" bars drown the heartbeat
    from tandemrl.cli.build import run

    started = time.monotonic()
    with ctrl_c_ends_the_run():
        run_dir = run(config)
    if rank:
        return 0
    from tandemrl.logging.console import summary
    from tandemrl.logging.metrics import read_metrics
    from tandemrl.train.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(run_dir)
    lines = summary(read_metrics(run_dir), wall_s=time.monotonic() - started, run_dir=str(run_dir), checkpoint=str(checkpoint) if checkpoint else None)
    print("\n".join(lines))
    return 0


@contextlib.contextmanager
def ctrl_c_ends_the_run(grace_s: float = 10.0):
    """SIGINT always ends the run within seconds. The first raises KeyboardInterrupt in the main thread,
    so the loop unwinds (exit 130, checkpoints are renamed into place whole, never half-written); a
    thread that would hold the exit (a reward that never returns, a step in flight) gets `grace_s`, then
    the process exits. A second SIGINT exits at once."""

    def exit_now() -> None:
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
