"""`tandem`: the command. Parses first, imports heavy modules after, so `--help` is instant.

Usage errors (bad flags, bad input files, bad values) print one line and exit with 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tandemrl.types import RunStopped

from tandemrl.cli.args import did_you_mean

RANK_EXIT_GRACE_S = 10.0
COMMANDS = {
    "train": ("tandemrl.cli.train", "train a policy by GRPO-family RL (no arguments: the embedded default)"),
    "rollout": ("tandemrl.cli.rollout", "serve a model for rollouts over HTTP, with versioned weight sync"),
    "plot": ("tandemrl.cli.plot", "write a PNG dashboard of a run directory"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="tandem", description="GRPO-family RL with generation and training in tandem.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    parser.add_argument("--version", action="store_true", help="print the version of tandem and of torch, transformers")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] == "--version" or (argv[0] in COMMANDS and "--version" in argv[1:]):  # `tandem train --version` too
        print(versions())
        return 0
    if argv[0] not in COMMANDS:
        hint = did_you_mean(argv[0], COMMANDS)
        print(f"tandem: error: unknown command {argv[0]!r}{hint}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    try:
        return module.main(argv[1:])
    except (ValueError, OSError) as error:  # OSError: a path that cannot be written, a server that cannot be reached
        if not rank_zero():  # under torchrun a bad flag is bad on every rank: rank 0 says it, and torchrun stops
            time.sleep(RANK_EXIT_GRACE_S)  # this rank once rank 0 exits; an error of this rank's own is said after
        print(f"tandem {argv[0]}: error: {error}", file=sys.stderr)
        return 2
    except RunStopped as error:
        if not rank_zero():
            # under torchrun every rank stops at the same point for the same reason, and rank 0 says it; torchrun
            # stops every rank once one exits, so the others give rank 0 time to print and exit first
            time.sleep(RANK_EXIT_GRACE_S)
            return 1
        if not getattr(error, "said", False):  # cli/ranks says a lost rank at once
            print(f"tandem {argv[0]}: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:
        # cli/build says it once, with how to continue; torchrun forwards Ctrl-C to every rank, and rank 0 says it
        if not getattr(interrupt, "said", False) and rank_zero():
            print(f"tandem {argv[0]}: interrupted", file=sys.stderr)
        return 130


def rank_zero() -> bool:
    """Whether this process says what ends a run: a lone process, or rank 0 under torchrun (which sets RANK)."""
    return os.environ.get("RANK", "0") == "0"


def versions() -> str:
    """Example: "tandem 0.1.0 (torch 2.11.0, transformers 5.17.0, Python 3.12.3)"; read from package metadata
    (nothing imported, so it is instant)."""
    from importlib.metadata import PackageNotFoundError, version

    import tandemrl

    def of(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    python = ".".join(map(str, sys.version_info[:3]))
    return f"tandem {tandemrl.__version__} (torch {of('torch')}, transformers {of('transformers')}, Python {python})"


if __name__ == "__main__":
    raise SystemExit(main())
