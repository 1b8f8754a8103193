"""Mixture-of-experts on one GPU: our engine against transformers `generate` on a Qwen3-30B-A3B-shaped model,
and `tandem train` GRPO steps on a small MoE with and without --routing_replay.

generate: 48 layers, 128 experts, top-8, hidden 2048, expert width 768 (random bf16, ~61 GB, built on the
GPU). transformers `generate` (its default experts implementation, grouped_mm; sdpa; dynamic cache; timed
warm) decodes --hf_sequences of the prompts (all 512 by default: the same batch as ours, since a launch-bound
step costs about the same for 64 rows or 512, so fewer rows would understate its tokens/s up to 8x) for
--hf_new_tokens (fewer steps bound its share of the run; shorter contexts only flatter it), then hands its weights to the engine
tensor by tensor (each freed once copied: two copies would not leave room for a KV cache), which runs the
whole workload: 64 prompts x 8 samples, 128 prompt tokens, 512 new tokens (ignore EOS, temperature 1).
Figures are output tokens/s; one ratio line.

train: a Qwen3-MoE of 16 experts, top-4 (~1.3B parameters) saved with tandem's tiny tokenizer; `tandem train`
runs --steps GRPO steps colocated, once with --routing_replay and once without; prints each run's
train/logprob_mismatch_kl_lag0 per step and their means (the sampler-vs-trainer KL on tokens sampled by the
very weights trained: numerics alone, which replay removes the routing part of).

    python bench/moe.py                       # both parts (~6 min on an H200)
    python bench/moe.py --parts generate --hf_sequences 16
    python bench/moe.py --smoke --hf_sequences 2 --hf_new_tokens 4 --new_tokens 8 --steps 2 --completion_tokens 8   # CPU, checks the script
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

A3B = dict(
    hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, vocab_size=151936,
    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
)  # fmt: skip
SMALL = dict(
    hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=64, intermediate_size=3072,
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=1024, norm_topk_prob=True, max_position_embeddings=4096,
)  # fmt: skip
SMOKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
REWARD = "def reward(prompts, completions, **columns):\n    return [float(len(set(c)) % 5) for c in completions]\n"


DEVICE, DTYPE = "cuda", torch.bfloat16  # --smoke: cpu, float32


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class Handover:
    """A transformers model as the engine's weight source, each parameter released once yielded (and copied)."""

    def __init__(self, model) -> None:
        self.config, self._model = model.config, model

    def state_dict(self):
        return self

    def items(self):
        model, self._model = self._model, None
        for prefix, module in list(model.named_modules()):
            for name, param in list(module._parameters.items()):
                if param is not None:
                    module._parameters[name] = None
                    yield f"{prefix}.{name}" if prefix else name, param.data
        del model


def build_a3b(smoke: bool):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**{**A3B, **(SMOKE if smoke else {})}), dtype=DTYPE, attn_implementation="sdpa")
    return model.eval()


def time_generate(model, prompts: list[list[int]], new_tokens: int, *, warm: str = "full") -> float:
    from transformers import GenerationConfig

    ids = torch.tensor(prompts, device=DEVICE)
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        if warm == "full":  # the timed call itself first: the caching allocator then holds what its dynamic cache grows to
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        else:  # the short warm-up the figures before Dec 3's third session had: the allocator's growth lands in the timed call
            model.generate(input_ids=ids[:, :16], generation_config=GenerationConfig(**{**config.to_dict(), "max_new_tokens": 4, "min_new_tokens": 4}))
        synchronize()
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        synchronize()
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - start


def time_engine(model, requests: list[list[int]], new_tokens: int) -> tuple[float, dict]:
    from engine import counters_since  # bench/engine.py
    from tandemrl.generation.base import EngineConfig
    from tandemrl.generation.engine import Engine
    from tandemrl.types import SamplingParams

    start = time.perf_counter()
    config = EngineConfig(device=DEVICE, gpu_memory_utilization=0.9, max_num_seqs=512, max_model_len=1024, max_num_batched_tokens=16384, kv_cache_tokens=65536)
    engine = Engine(config, model=Handover(model))
    built = time.perf_counter() - start

    async def go(reqs):
        params = [SamplingParams(max_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=i) for i in range(len(reqs))]
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(reqs, params)))

    asyncio.run(go(requests[:16]))  # warm: the kernels of prefill shapes compile
    before = engine.stats()
    start = time.perf_counter()
    completions = asyncio.run(go(requests))
    elapsed = time.perf_counter() - start
    assert sum(len(c.token_ids) for c in completions) == len(requests) * new_tokens
    stats = counters_since(engine, before)  # the timed call's share (the warm call's taken out)
    asyncio.run(engine.close())
    return elapsed, {"build_s": round(built, 1), **stats}


def bench_generate(args) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 150000) for _ in range(128)] for _ in range(64)]
    requests = [p for p in prompts for _ in range(8)]
    model = build_a3b(args.smoke)
    experts = getattr(model.config, "_experts_implementation", None)
    print(json.dumps({"model": "qwen3-30b-a3b-shape", "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2), "hf_experts": experts}), flush=True)
    hf_s = time_generate(model, requests[: args.hf_sequences], args.hf_new_tokens, warm=args.warm)
    hf_tps = args.hf_sequences * args.hf_new_tokens / hf_s
    print(json.dumps({"system": "transformers generate", "sequences": args.hf_sequences, "new_tokens": args.hf_new_tokens, "seconds": round(hf_s, 1), "tokens_per_s": round(hf_tps, 1)}), flush=True)
    ours_s, stats = time_engine(model, requests, args.new_tokens)
    ours_tps = len(requests) * args.new_tokens / ours_s
    print(json.dumps({"system": "ours", "sequences": len(requests), "new_tokens": args.new_tokens, "seconds": round(ours_s, 1), "tokens_per_s": round(ours_tps, 1), **stats}), flush=True)
    print(f"ours vs transformers generate (30B-A3B shape, output tokens/s): {ours_tps / hf_tps:.1f}x  (required >= 5x)", flush=True)


def save_small(path: str, smoke: bool) -> None:
    from tandemrl.tasks.tiny import build_tokenizer
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    tokenizer = build_tokenizer()
    config = Qwen3MoeConfig(**{**SMALL, **(SMOKE if smoke else {})}, vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # routes as decisive as a trained model's (init std 0.02 routes nearly uniformly)
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(25)
    print(json.dumps({"model": "small-moe", "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2)}), flush=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def bench_train(args) -> None:
    work = Path(tempfile.mkdtemp(prefix="tandem-moe-"))
    save_small(str(work / "model"), args.smoke)
    (work / "reward.py").write_text(REWARD)
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    (work / "data.jsonl").write_text("".join(json.dumps({"prompt": "".join(rng.choice(letters) for _ in range(64))}) + "\n" for _ in range(256)))
    means = {}
    for replay in (False, True):
        run_dir = work / ("replay" if replay else "plain")
        command = [
            sys.executable, "-m", "tandemrl", "train", "--model", str(work / "model"), "--dataset", str(work / "data.jsonl"),
            "--reward_funcs", f"{work / 'reward.py'}:reward", "--output_dir", str(run_dir), "--max_steps", str(args.steps),
            "--num_prompts_per_step", "8", "--num_generations", "8", "--max_completion_length", str(args.completion_tokens),
            "--learning_rate", "1e-5", "--no-torch_compile", "--save_steps", "0",
            *(["--routing_replay"] if replay else []),
        ]  # fmt: skip
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, timeout=args.train_timeout_s, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if result.returncode != 0:
            print(result.stdout[-3000:], result.stderr[-3000:], sep="\n", flush=True)
            raise SystemExit(f"tandem train {'--routing_replay ' if replay else ''}failed ({result.returncode})")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        kl = [row["train/logprob_mismatch_kl_lag0"] for row in rows if "train/logprob_mismatch_kl_lag0" in row]
        means[replay] = sum(kl) / len(kl)
        print(json.dumps({
            "system": "tandem train", "routing_replay": replay, "steps": len(kl), "seconds": round(time.perf_counter() - start, 1),
            "logprob_mismatch_kl_lag0": [float(f"{v:.3g}") for v in kl], "mean": float(f"{means[replay]:.3g}"),
            "router_aux_loss": [round(row["train/router_aux_loss"], 4) for row in rows if "train/router_aux_loss" in row],
            "replayed": [round(row["train/routing_replay_fraction"], 3) for row in rows if "train/routing_replay_fraction" in row],
        }), flush=True)  # fmt: skip
    print(f"routing replay vs none (small MoE, mean train/logprob_mismatch_kl_lag0): {means[True]:.3g} vs {means[False]:.3g}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="generate,train")
    parser.add_argument("--hf_sequences", type=int, default=512, help="sequences transformers generate decodes, in one batch (ours: 512)")
    parser.add_argument("--hf_new_tokens", type=int, default=64, help="tokens transformers generate decodes (its share of the time)")
    parser.add_argument("--new_tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--completion_tokens", type=int, default=256)
    parser.add_argument("--train_timeout_s", type=float, default=300)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script, measures nothing")
    parser.add_argument("--warm", choices=("full", "short"), default="full", help="transformers' untimed call first: the timed one itself (full) or 16 rows x 4 tokens (short)")
    args = parser.parse_args()
    global DEVICE, DTYPE
    DEVICE, DTYPE = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    parts = args.parts.split(",")
    if len(parts) > 1:  # each part in a fresh process, so the first leaves the GPU empty for the next
        for part in parts:
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--parts", part], check=True)
        return
    {"generate": bench_generate, "train": bench_train}[parts[0]](args)


if __name__ == "__main__":
    main()
