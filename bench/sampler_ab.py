"""The filtered sampler kernel of two source trees, in one process on a GPU, alternating: before and after.

Loads `tandemrl/generation/engine/layers/sampler_kernel.py` from each tree by path and times each tree's
`sample_filtered` and `sample_unfiltered` (the bar) on the same random bf16 logits of the
Qwen2.5 vocab, at 128, 256 and 512 rows, flat and peaked, under each filter setting; the trees take turns
round by round, so the machine's drift lands on both. Prints a JSON line a case (milliseconds, medians of
`triton.testing.do_bench`; the share of rows whose ids and floors equal the torch sampler's) and ratio lines:

    python bench/ab.py --export main _ab/main
    python bench/sampler_ab.py _ab/main/src src
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics

import torch

SETTINGS = {"top_p=0.9": dict(top_p=0.9), "top_k=50": dict(top_k=50), "top_k=50,top_p=0.9": dict(top_k=50, top_p=0.9),
            "min_p=0.05": dict(min_p=0.05), "top_p=0.5": dict(top_p=0.5)}  # fmt: skip


def load(src: str, name: str):
    path = os.path.join(src, "tandemrl", "generation", "engine", "layers", "sampler_kernel.py")
    spec = importlib.util.spec_from_file_location(f"sampler_kernel_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", help="the first tree's src directory (the baseline)")
    parser.add_argument("new", help="the second tree's src directory")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="128,256,512")
    args = parser.parse_args()
    from triton.testing import do_bench

    from decode import sampler_problem, same_as_torch

    trees = {"base": load(args.base, "base"), "new": load(args.new, "new")}
    for rows, scale in itertools.product([int(r) for r in args.rows.split(",")], (0.5, 3.0)):
        logits, temps, keys, settings = sampler_problem(rows, scale, SETTINGS)
        for setting, params in settings.items():
            row = {"rows": rows, "logit_scale": scale, "setting": setting}
            calls = {name: (lambda m=m: m.sample_filtered(logits, temps, params["top_k"], params["top_p"], params["min_p"], keys)) for name, m in trees.items()}
            calls |= {f"{name}_unfiltered": (lambda m=m: m.sample_unfiltered(logits, temps, keys)) for name, m in trees.items()}
            for name in trees:
                ids, _, floors = calls[name]()
                row[f"{name}_same_ids"], row[f"{name}_same_floors"] = same_as_torch(ids, floors, logits, temps, keys, params)
            times = {name: [] for name in calls}
            for _ in range(args.rounds):
                for name, call in calls.items():
                    times[name].append(do_bench(call, warmup=10, rep=100, return_mode="median"))
            for name, values in times.items():
                row[f"{name}_ms"] = round(statistics.median(values), 4)
            print(json.dumps(row), flush=True)
            print(f"ratio sampler_ab rows={rows} scale={scale} {setting}: base / new time = {row['base_ms'] / row['new_ms']:.3f}x; "
                  f"new / unfiltered = {row['new_ms'] / row['new_unfiltered_ms']:.2f}x (base {row['base_ms'] / row['base_unfiltered_ms']:.2f}x); "
                  f"unfiltered base / new time = {row['base_unfiltered_ms'] / row['new_unfiltered_ms']:.3f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
