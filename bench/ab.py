"""Before and after, in one run: the same benchmark command on several source trees, alternating.

Each tree is a `src` directory (export one with `python bench/ab.py --export REV DIR`, which writes
git revision REV's `src` and `tests` under DIR, so its GPU tests can run there too). Rounds alternate the trees (A B A B ...), so drift of the
machine lands on both. Every JSON line the command prints with a `tokens_per_s` is kept, with the tree
it came from; at the end one line per tree and figure (the mean over rounds) and one ratio line per
tree against the first:

    python bench/ab.py --export main _ab/main
    python bench/ab.py --trees base=_ab/main/src,new=src --rounds 2 -- \\
        python bench/engine.py --models 0.5b --workloads grpo256 --only ours

`_ab/` is git-ignored: on the device machine, carry it with the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict


def export(rev: str, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev, "src", "tests"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
    print(json.dumps({"exported": rev, "src": os.path.join(directory, "src")}), flush=True)


def run_tree(name: str, src: str, command: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.abspath(src), os.environ.get("PYTHONPATH", "")) if p))
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    figures = []
    for line in process.stdout:
        print(f"[{name}] {line}", end="", flush=True)
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and "tokens_per_s" in record:
            figures.append(record)
    if process.wait() != 0:
        print(json.dumps({"tree": name, "exit_code": process.returncode}), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", nargs=2, metavar=("REV", "DIR"), help="write git revision REV's src and tests under DIR, then stop")
    parser.add_argument("--trees", help="name=src_dir,... ; the first is the baseline of the ratios")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark command")
    args = parser.parse_args()
    if args.export:
        return export(*args.export)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.trees or not command:
        parser.error("give --trees name=src,... and, after --, the benchmark command")
    trees = [item.split("=", 1) for item in args.trees.split(",")]
    for name, src in trees:
        if not os.path.isdir(os.path.join(src, "tandemrl")):
            parser.error(f"tree {name!r}: {src} has no tandemrl package (export one with --export REV DIR)")
    seen: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(args.rounds):
        for name, src in trees:
            for record in run_tree(name, src, command):
                key = (record.get("model"), record.get("workload"), record.get("system") or record.get("mode"))  # mode: bench/multiturn.py
                seen[key][name].append(record["tokens_per_s"])
    base = trees[0][0]
    for (model, workload, system), by_tree in seen.items():
        means = {name: sum(v) / len(v) for name, v in by_tree.items()}
        print(json.dumps({"model": model, "workload": workload, "system": system, "tokens_per_s": {n: round(m) for n, m in means.items()}, "runs": dict(by_tree)}), flush=True)
        for name, _ in trees[1:]:
            if name in means and base in means:
                print(f"ratio {model} {workload} {system} {name}/{base} = {means[name] / means[base]:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
