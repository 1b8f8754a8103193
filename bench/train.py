"""The train phase of one GRPO step on a GPU: tandem's trainer against a plain transformers trainer.

Workload: 512 sequences (64 prompts x 8) of 128 prompt + 256 completion tokens, random weights of a
Qwen2.5-shaped model (float32 master weights), beta 0, one iteration. Both in one process:
- ours: `tandemrl.train.Trainer` as `tandem train` builds it (defaults: bf16 compute weights, packed
  varlen attention, compiled layers, fused logprob head, micro-batch size from free memory);
- baseline: what a generic trainer does: padded micro-batches of 64 sequences, sdpa, bfloat16 autocast
  over float32 weights, full logits -> log_softmax -> gather, AdamW.
Prints seconds per train phase (mean of the timed steps, after warm-up steps), tokens/s, MFU (model
FLOPs / 790 TFLOP/s peak bf16), peak memory and ours' compile (first-step) time; one ratio line per
model. `--full_step` also runs `tandem train` end to end on the same workload (a random model saved
to a directory, 64 prompts of ~127 tokens, 256 new tokens) and prints its step time split.

    python bench/train.py --models 0.5b,1.5b --full_step
    python bench/train.py --models 0.5b,1.5b --only '' --full_step_completions 4096,8192 --full_steps 4  # long rollouts, 16 x 8
    python bench/train.py --models 7b --only '' --full_step_completions 4096 --full_step_prompts 8 --full_steps 3 --full_step_save_dtype bfloat16 --train_flags --lora_r 16
    python bench/train.py --models 0.5b --variants ';triton_logprobs=false'  # ours twice: defaults (Triton head), torch head
    python bench/train.py --models 0.5b --only ours --liger --variants 'torch_compile=false;'  # Liger's RMSNorm/RoPE/SwiGLU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engine import SHAPE_7B, SHAPES  # noqa: E402

PEAK_FLOPS = 790e12
PROMPT, COMPLETION, PROMPTS, GENERATIONS = 128, 256, 64, 8


def qwen_config(shape: str):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=151936 if shape != "7b" else 152064, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=shape != "7b", bos_token_id=151643, eos_token_id=151645, **(SHAPE_7B if shape == "7b" else SHAPES[shape]),
    )  # fmt: skip


def build_model(shape: str, device: str = "cuda"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(qwen_config(shape), dtype=torch.float32, attn_implementation="sdpa")


def model_flops(model, num_tokens: int, seq_len: int) -> float:
    """6 x tokens x (non-embedding params + the head's V x H) + causal attention (6 x layers x H x L per token)."""
    cfg = model.config
    embed = cfg.vocab_size * cfg.hidden_size
    params = sum(p.numel() for p in model.parameters()) - embed  # tied head counted once, below
    return 6 * num_tokens * (params + embed) + 6 * num_tokens * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def make_batch(seed: int = 0):
    from tandemrl.types import Batch, Completion, Example, Group, Rollout, TokenTrace

    rng = random.Random(seed)
    groups = []
    for _ in range(PROMPTS):
        prompt = [rng.randrange(1000, 150000) for _ in range(PROMPT)]
        rollouts = []
        for _ in range(GENERATIONS):
            trace = TokenTrace()
            trace.append_context(prompt)
            ids = [rng.randrange(1000, 150000) for _ in range(COMPLETION)]
            trace.append_sampled(Completion(token_ids=ids, logprobs=[-12.0] * COMPLETION, finish_reason="length", policy_versions=[0] * COMPLETION))
            rollouts.append(Rollout(example=Example(prompt="p"), trace=trace))
        advantages = [rng.gauss(0, 1) for _ in range(GENERATIONS)]
        groups.append(Group(example=Example(prompt="p"), rollouts=rollouts, advantages=advantages))
    return Batch(groups=groups, policy_version=0)


def resident_gib() -> float:
    """GiB still allocated before a run builds its model (an earlier run's leftovers count in its peak)."""
    gc.collect()
    torch.cuda.empty_cache()
    return round(torch.cuda.memory_allocated() / 2**30, 2)


def timed(step, *, warmup: int, steps: int) -> tuple[float, float, float]:
    """(first step s, mean of timed steps s, peak GiB over the timed steps)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    for _ in range(warmup - 1):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return first, (time.perf_counter() - start) / steps, torch.cuda.max_memory_allocated() / 2**30


def parse_variant(text: str) -> dict:
    """'triton_logprobs=true,logprob_chunk_size=1024' -> {'triton_logprobs': True, 'logprob_chunk_size': 1024}."""
    options = {}
    for item in filter(None, text.split(",")):
        key, value = item.split("=", 1)
        options[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.lstrip("-").isdigit() else value)
    return options


def run_ours(shape: str, budget: int, chunk: int, args, variant: dict | None = None) -> dict | None:
    """None when this tree's TrainerConfig lacks a field of `variant` (an older tree in an A/B)."""
    from tandemrl.algo.presets import AlgoConfig
    from tandemrl.train.config import TrainerConfig
    from tandemrl.train.trainer import Trainer

    import dataclasses

    fields = {f.name for f in dataclasses.fields(TrainerConfig)}
    if not set(variant or {}) <= fields:
        return None
    resident = resident_gib()
    model = build_model(shape)
    options = {"torch_compile": not args.no_compile} if "torch_compile" in fields else {}  # older trees as they were
    options.update(variant or {})
    if chunk:
        options["logprob_chunk_size"] = chunk
    if budget or "torch_compile" in fields:
        options["max_tokens_per_microbatch"] = budget
    config = TrainerConfig(learning_rate=1e-6, device="cuda", **options)
    trainer = Trainer(config, AlgoConfig(beta=0.0), model, max_steps=100)
    batch = make_batch()
    first, seconds, peak = timed(lambda: trainer.train_step(batch), warmup=args.warmup, steps=args.steps)
    if args.profile:
        print_kernel_profile(lambda: trainer.train_step(batch))
    try:
        from tandemrl.train.forward import microbatch_budget

        chosen = microbatch_budget(config, model, torch.device("cuda"))
    except ImportError:
        chosen = config.max_tokens_per_microbatch
    del trainer, model
    torch.cuda.empty_cache()
    return {
        "first_step_s": round(first, 3), "compile_s": round(first - seconds, 3), "max_tokens_per_microbatch": chosen,
        "logprob_chunk_size": config.logprob_chunk_size, "seconds": seconds, "peak_gib": peak, "resident_at_start_gib": resident,
        **head_path(),
    }  # fmt: skip


def head_path() -> dict:
    """Which logprob head ran (trees that have the switches): Triton kernels, weight gradient summed in the matmul."""
    from tandemrl.algo import logprobs

    if not hasattr(logprobs, "_TRITON"):
        return {}
    triton = logprobs._TRITON[0] and logprobs._triton_installed()
    probe = getattr(logprobs, "_baddbmm_accumulates", None)
    return {"triton_head": triton, "weight_grad_in_matmul": bool(triton and probe and probe())}


def run_baseline(shape: str, args, micro: int = 64) -> dict:
    model = build_model(shape)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.99))
    batch = make_batch()
    rows = [r.trace for g in batch.groups for r in g.rollouts]
    advantages = torch.tensor(batch.advantages(), device="cuda")
    input_ids = torch.tensor([t.token_ids for t in rows], device="cuda")  # [512, 384], all one length: no padding
    mask = torch.tensor([t.loss_mask[1:] for t in rows], device="cuda", dtype=torch.float32)  # [512, 383]

    def step():
        optimizer.zero_grad(set_to_none=True)
        for start in range(0, len(rows), micro):
            ids, m, adv = input_ids[start : start + micro], mask[start : start + micro], advantages[start : start + micro]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits[:, :-1]  # [micro, 383, V]
            logprobs = logits.float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [micro, 383]
            ratio = torch.exp(logprobs - logprobs.detach())
            loss = -(ratio * adv[:, None] * m).sum(-1) / m.sum(-1)
            (loss.sum() / len(rows)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    first, seconds, peak = timed(step, warmup=args.warmup, steps=args.steps)
    if args.profile:
        print_kernel_profile(step)
    del model, optimizer
    torch.cuda.empty_cache()
    return {"micro_batch": micro, "first_step_s": round(first, 3), "seconds": seconds, "peak_gib": peak}


def run_baseline_that_fits(shape: str, args) -> dict:
    """Padded micro-batches of 64 sequences; where full logits of 64 do not fit (1.5B), of 32."""
    if args.baseline_micro_batch != 64:
        return run_baseline(shape, args, args.baseline_micro_batch)
    try:
        return run_baseline(shape, args, 64)
    except torch.OutOfMemoryError:
        print(json.dumps({"model": shape, "system": "baseline", "micro_batch": 64, "error": "CUDA out of memory"}), flush=True)
    gc.collect()  # outside the except block: the traceback no longer holds the first try's model
    torch.cuda.empty_cache()
    return run_baseline(shape, args, 32)


def print_kernel_profile(call, top: int = 15) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        call()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60), flush=True)


def full_step(shape: str, args, *, completion: int = COMPLETION, prompts: int = PROMPTS) -> dict:
    """`tandem train` on the same workload (or `prompts` x 8 of `completion` new tokens), from a random model
    saved to a directory (as a new user would)."""
    from tandemrl.tasks.tiny import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(shape).to(getattr(torch, args.full_step_save_dtype))
        model.save_pretrained(f"{tmp}/model")
        build_tokenizer().save_pretrained(f"{tmp}/model")
        del model
        torch.cuda.empty_cache()
        rng = random.Random(0)
        letters = "abcdefghijklmnopqrstuvwxyz0123456789"
        with open(f"{tmp}/data.jsonl", "w") as f:
            for _ in range(prompts):
                f.write(json.dumps({"prompt": "".join(rng.choice(letters) for _ in range(127))}) + "\n")
        with open(f"{tmp}/noise.py", "w") as f:
            f.write("import random\n\ndef noise(prompts, completions, **kw):\n    return [random.random() for _ in completions]\n")
        cmd = [
            sys.executable, "-m", "tandemrl", "train", "--model", f"{tmp}/model", "--dataset", f"{tmp}/data.jsonl",
            "--reward_funcs", f"{tmp}/noise.py:noise", "--num_prompts_per_step", str(prompts), "--num_generations", str(GENERATIONS),
            "--max_completion_length", str(completion), "--beta", "0", "--max_steps", str(args.full_steps),
            "--output_dir", f"{tmp}/run", "--save_steps", "0", "--device", "cuda", *args.train_flags,
        ]  # fmt: skip
        started = time.perf_counter()
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=args.full_step_timeout)
        wall = time.perf_counter() - started
        if result.returncode != 0:
            return {"error": result.stderr[-2000:]}
        rows = [json.loads(line) for line in open(f"{tmp}/run/metrics.jsonl")]
    steady = rows[2:]  # past compiles and first-shape warm-ups
    keys = ("step_time", "time/generate", "time/reward", "time/train", "time/sync")
    split = {k: round(sum(r[k] for r in steady) / len(steady), 3) for k in keys}
    extra = {k: round(sum(r[k] for r in steady) / len(steady), 4) for k in ("sampling/sampling_logp_difference/mean", "completions/mean_length") if k in rows[0]}
    # the engine logs a prefill graph it could not capture (prefill_graphs.py) and runs that size eagerly
    failures = result.stderr.count("prefill graph of")
    return {"steps": len(rows), "wall_s": round(wall, 1), "first_step_s": round(rows[0]["step_time"], 2), **split, **extra, "prefill_graph_failures": failures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="0.5b")
    parser.add_argument("--only", default="ours,baseline")
    parser.add_argument("--budgets", default="0", help="ours' --max_tokens_per_microbatch values (0 = auto)")
    parser.add_argument("--chunks", default="0", help="ours' --logprob_chunk_size values (0 = the default)")
    parser.add_argument(
        "--variants", default="", help="';'-separated TrainerConfig overrides, one run of ours each, e.g. ';triton_logprobs=false' "
        "(the defaults, then the torch head); a tree without such a field skips that run"
    )  # fmt: skip
    parser.add_argument("--baseline_micro_batch", type=int, default=64, help="sequences per baseline micro-batch (32 if 64 runs out of memory)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--no_compile", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--liger", action="store_true", help="Liger Kernel's RMSNorm, RoPE and SwiGLU patched into transformers' Qwen2 before any model "
        "is built (the whole process: run it beside a plain process for the A/B; e.g. --variants 'torch_compile=false;')"
    )  # fmt: skip
    parser.add_argument("--full_step", action="store_true")
    parser.add_argument("--full_steps", type=int, default=6, help="steps of each `tandem train`; the figures are the mean of the third on (>= 3)")
    parser.add_argument(
        "--full_step_completions", default="", help="long rollouts: `tandem train` of --full_step_prompts x 8 at each of these "
        "completion lengths (e.g. 4096,8192), after the default workload's; --only '' runs these alone"
    )  # fmt: skip
    parser.add_argument("--full_step_prompts", type=int, default=16)
    parser.add_argument("--full_step_save_dtype", choices=("float32", "bfloat16"), default="float32", help="the saved checkpoint's dtype (bfloat16: 7B's 15 GB, as released)")
    parser.add_argument("--full_step_timeout", type=int, default=540, help="seconds one `tandem train` may take")
    parser.add_argument("--train_flags", nargs=argparse.REMAINDER, default=[])
    args = parser.parse_args()
    if (args.full_step or args.full_step_completions) and args.full_steps < 3:
        parser.error(f"--full_steps {args.full_steps}: the first two steps compile and warm up, so the figures need --full_steps 3 or more")
    num_tokens = PROMPTS * GENERATIONS * (PROMPT + COMPLETION)
    if args.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen2

        apply_liger_kernel_to_qwen2(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
    for shape in args.models.split(","):
        flops = model_flops(build_model(shape, device="meta"), num_tokens, PROMPT + COMPLETION)
        results = {}
        for system in [s for s in args.only.split(",") if s]:
            configs = [(int(b), int(c), v) for b in args.budgets.split(",") for c in args.chunks.split(",") for v in args.variants.split(";")]
            for budget, chunk, variant in configs if system == "ours" else [(None, None, "")]:
                name = f"{system}{'+liger' if args.liger else ''} {variant}".strip()
                if system == "ours":
                    out = run_ours(shape, budget, chunk, args, parse_variant(variant))
                else:
                    out = run_baseline_that_fits(shape, args)
                if out is None:
                    print(json.dumps({"model": shape, "system": name, "skipped": "this tree's TrainerConfig lacks the field"}), flush=True)
                    continue
                out.update(tokens_per_s=round(num_tokens / out["seconds"]), mfu=round(flops / out["seconds"] / PEAK_FLOPS, 3))
                out["seconds"], out["peak_gib"] = round(out["seconds"], 3), round(out["peak_gib"], 2)
                print(json.dumps({"model": shape, "system": name, "budget": budget, **out}), flush=True)
                results.setdefault(name, out)
        baseline = results.pop("baseline+liger" if args.liger else "baseline", None)
        for name, out in results.items() if baseline else ():
            ratio = baseline["seconds"] / out["seconds"]
            print(f"ratio {shape} train phase: {name} {out['seconds']:.3f} s vs baseline {baseline['seconds']:.3f} s = {ratio:.2f}x", flush=True)
        if args.full_step:
            print(json.dumps({"model": shape, "system": "tandem train", **full_step(shape, args)}), flush=True)
        for completion in (int(c) for c in args.full_step_completions.split(",") if c):
            out = full_step(shape, args, completion=completion, prompts=args.full_step_prompts)
            print(json.dumps({"model": shape, "system": "tandem train", "prompts": args.full_step_prompts, "completion": completion, **out}), flush=True)


if __name__ == "__main__":
    main()
