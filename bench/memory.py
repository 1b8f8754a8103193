"""The memory plan on one GPU: `tandem train` with only --model and the workload flags, for full fine-tuning
and LoRA of large shapes; the plan's peak of each phase against the measured one, and the step time.

Each run is `tandem train`'s own build (cli/build.py: the plan made before anything loads, its levers and
sizes applied, the banner, the loop) on a random-weight Qwen2.5-shaped model whose weights are built on
the GPU in code (the model directory holds its config.json and a tiny tokenizer: the plan reads the
config, nothing is downloaded or written to disk); no checkpoints. The workload is issue 30's: 16 prompts
x 8 samples, 128 prompt + 256 new tokens (EOS ignored, noise rewards), --beta 0. Each run is a subprocess
(a clean allocator), stopped after --steps steps; one JSON line each: the levers the plan chose, KV cache
and micro-batch, per phase (generation, training, sync) the plan's peak and the measured one
(torch.cuda.max_memory_allocated, the max over the steps after the first) and their ratio, the step time
and its split (generate, train, of it the optimizer step, sync; means over the steps after the first).
Then one line per run:

    RUN: peak P GiB (plan Q), within 10%: yes/no; step S s (gen G, train T, optimizer O, sync Y)
    LoRA 7B: S s a step (required <= 4.0), peak P GiB (required <= 60)

    python bench/memory.py                                   # H200: full 7B, LoRA r16 7B, LoRA r16 14B, ~8 min
    python bench/memory.py --runs lora7b --steps 3           # one of them
    python bench/memory.py --runs full7b,full7bcpuadam       # full 7B with --cpu_optimizer's math on the GPU (the default), then on the CPU
    python bench/memory.py --runs tiny,tinylora --device cpu --prompts 2 --generations 2 --prompt_len 32 --completion_len 8
                                                             # CPU: a check that it runs (no allocator counts)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

SHAPES = {
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=320, tie_word_embeddings=True),
}  # fmt: skip
RUNS = {"full7b": ("7b", 0), "full7bcpuadam": ("7b", 0), "lora7b": ("7b", 16), "lora7bmerged": ("7b", 16), "lora7bshared": ("7b", 16), "lora14b": ("14b", 16),
        "tiny": ("tiny", 0), "tinylora": ("tiny", 4), "tinyloramerged": ("tiny", 4)}  # fmt: skip
# beside the workload flags; full7bcpuadam: --cpu_optimizer (which the plan turns on) with its math on the CPU, not its default
# form's (the moments streamed to the GPU's fused kernel)
EXTRA = {"lora7bmerged": ["--lora_engine", "merged"], "lora7bshared": ["--lora_engine", "shared"], "tinyloramerged": ["--lora_engine", "merged"], "full7bcpuadam": ["--cpu_optimizer_compute", "cpu"]}
PHASES = ("generation", "training", "sync")


def write_inputs(tmp: str, shape: str, prompt_len: int) -> None:
    """config.json + a tiny tokenizer (no weights), prompts of about `prompt_len` tokens, a noise reward."""
    from transformers import Qwen2Config

    from tandemrl.tasks.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    dims = SHAPES[shape]
    Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=tokenizer.eos_token_id,
                eos_token_id=tokenizer.eos_token_id, **dims).save_pretrained(f"{tmp}/model")  # fmt: skip
    tokenizer.save_pretrained(f"{tmp}/model")
    with open(f"{tmp}/data.jsonl", "w") as f:
        for i in range(256):
            f.write(json.dumps({"prompt": f"{i:04d} " + "abcdefghij" * (prompt_len // 12)}) + "\n")
    with open(f"{tmp}/noise.py", "w") as f:
        f.write("import random\n\ndef noise(prompts, completions, **kw):\n    return [random.random() for _ in completions]\n")


def flags(tmp: str, args, lora_r: int) -> list[str]:
    """Only --model and the workload (plus what makes it a benchmark: no KL, EOS ignored, logging each step)."""
    return [
        "--model", f"{tmp}/model", "--dataset", f"{tmp}/data.jsonl", "--reward_funcs", f"{tmp}/noise.py:noise",
        "--num_prompts_per_step", str(args.prompts), "--num_generations", str(args.generations),
        "--max_prompt_length", str(args.prompt_len), "--max_completion_length", str(args.completion_len),
        "--generation_kwargs", '{"ignore_eos": true}', "--beta", "0", "--max_steps", str(args.steps), "--logging_steps", "1",
        "--output_dir", f"{tmp}/run", "--device", args.device, *(["--lora_r", str(lora_r)] if lora_r else []),
    ]  # fmt: skip


def random_weights(source: str, *, dtype, device, **_) -> object:
    """What build.load_model returns, but random weights of the directory's config, made on `device`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=dtype, attn_implementation="sdpa")


def one(args) -> None:
    """This process: one run through cli/build.py; prints its JSON line."""
    import torch

    from tandemrl.cli import build
    from tandemrl.cli.plan import gpu_bytes, plan_for
    from tandemrl.cli.train import parse
    from tandemrl.pipeline import loop

    shape, lora_r = RUNS[args.one]
    tmp = tempfile.mkdtemp()
    write_inputs(tmp, shape, args.prompt_len)
    config, _ = parse(flags(tmp, args, lora_r) + EXTRA.get(args.one, []))
    out: dict = {"bench": "memory", "run": args.one, "shape": shape, "lora_r": lora_r}
    cuda = args.device == "cuda"
    if cuda:
        plan = plan_for(config, gpu_bytes(torch.device("cuda")))
        out.update(levers=plan.levers.names(), kv_tokens=plan.kv_tokens, microbatch_tokens=plan.microbatch_tokens,
                   **{f"plan_{p}_gib": round(plan.peak(p) / 2**30, 2) for p in PHASES})  # fmt: skip
    build.load_model = random_weights  # weights built on the GPU, not read from disk
    loop._should_save = lambda settings, step: False  # a benchmark writes no checkpoints
    started = time.perf_counter()
    try:
        run_dir = build.run(config)
    except Exception as error:  # noqa: BLE001 - the line says why the run did not train
        out["error"] = f"{type(error).__name__}: {error}"[:2000]
        out["where"] = traceback.format_exc()[-3000:]  # the frames that raised, for a failure seen only on a GPU
        print(json.dumps(out), flush=True)
        return
    out["wall_s"] = round(time.perf_counter() - started, 1)
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steady = rows[1:] or rows
    out["steps"] = len(rows)
    for key in ("step_time", "time/generate", "time/train", "train/optimizer_step_s", "time/sync"):
        if key in steady[0]:
            out[key] = round(sum(r[key] for r in steady) / len(steady), 3)
    for phase in PHASES:
        values = [r[f"memory/{phase}_peak_gib"] for r in steady if f"memory/{phase}_peak_gib" in r]
        if values:
            out[f"measured_{phase}_gib"] = round(max(values), 2)
            if out.get(f"plan_{phase}_gib"):
                out[f"{phase}_measured_over_plan"] = round(out[f"measured_{phase}_gib"] / out[f"plan_{phase}_gib"], 3)
    out["grad_norm"] = [r.get("grad_norm") for r in rows]  # NaN here: the steps did not train, whatever the times say
    print(json.dumps(out), flush=True)


def report(results: list[dict]) -> None:
    for r in results:
        if "error" in r:
            print(f"{r['run']}: did not train: {r['error'][:300]}")
            continue
        ratios = [r.get(f"{p}_measured_over_plan") for p in PHASES]
        within = all(x is not None and abs(x - 1) <= 0.10 for x in ratios)
        peak = max((r.get(f"measured_{p}_gib", 0.0) for p in PHASES), default=0.0)
        plan = max((r.get(f"plan_{p}_gib", 0.0) for p in PHASES), default=0.0)
        split = ", ".join(f"{k.split('/')[1]} {r[k]:.2f}" for k in ("time/generate", "time/train", "train/optimizer_step_s", "time/sync") if k in r)
        print(f"{r['run']}: levers {' '.join(r.get('levers', [])) or 'none'}; peak {peak:.1f} GiB (plan {plan:.1f}), every phase within 10%: "
              f"{'yes' if within else 'no'} {ratios}; step {r.get('step_time', float('nan')):.2f} s ({split})")  # fmt: skip
        if r["run"] in ("lora7b", "lora7bmerged"):
            print(f"LoRA 7B: {r.get('step_time', float('nan')):.2f} s a step (required <= 4.0; issue 30: 4.04 with --gpu_memory_utilization 0.6), "
                  f"peak {peak:.1f} GiB (required <= 60; issue 30: 86)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=lambda s: s.split(","), default=["full7b", "lora7b", "lora14b"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--completion_len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout_s", type=float, default=420.0, help="most seconds one run may take")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a run of this process (a child)
    args = parser.parse_args()
    if args.one:
        return one(args)
    results = []
    for name in args.runs:
        cmd = [sys.executable, __file__, "--one", name, *sys.argv[1:]]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            lines = [line for line in done.stdout.splitlines() if line.startswith('{"bench"')]
            result = json.loads(lines[-1]) if lines else {"run": name, "error": (done.stdout + done.stderr)[-2000:]}
        except subprocess.TimeoutExpired as error:
            result = {"run": name, "error": f"timed out after {args.timeout_s} s: {str(error.stdout or '')[-1000:]}"}
        print(json.dumps(result), flush=True)
        results.append(result)
    report(results)


if __name__ == "__main__":
    main()
