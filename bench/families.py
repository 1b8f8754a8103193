"""The engine on each family of README's table, at real shapes with random weights (configs written here:
nothing downloads), against transformers `generate` in the same process; and `tandem train` end to end.

generate: per family, random bf16 weights of the real shape built on the GPU; transformers `generate`
(its default attention: sdpa, eager for Gemma 2; dynamic cache) and then our engine (its model copied from
transformers') run the same workload, each after an untimed call of it (--warm full): 512 prompts x 256 new
tokens, or 128 x 1024 for the 7B (128-token prompts, ignore EOS, temperature 1). One JSON line per system,
one ratio line per family ("ours vs transformers generate", the issue's bar: >= 4x), one line with the
workload's floor (`workload_floor`) at the copy bandwidth and matmul rate measured in the run and at the GPU's
datasheet peaks (`DATASHEET`; kernels can beat the measured rates, none the peaks): how near it ours runs, and
the most a bf16 engine could beat transformers by on this workload. Then greedy
bf16 agreement: --agree_prompts prompts x --agree_tokens tokens greedy from both, how many sequences are
identical and the mean length of their common prefix (bf16 near-ties make some diverge).

train: per family, the real widths with --train_layers decoder layers (a full-depth 7B does not train
beside its engine on one GPU), tandem's tiny tokenizer, saved to a temporary directory; `tandem train`
runs --train_steps GRPO steps on it with the colocated engine and must say "generator: engine" in its
banner; prints seconds and the step's loss.

    python bench/families.py                                  # both parts, all six families (~6 min on an H200)
    python bench/families.py --parts generate --families gemma2,phi3
    python bench/families.py --parts generate --families gemma3-4b-text --fused_norms off,on   # models/llama.py's FUSED_NORMS off and on, same run
    python bench/families.py --smoke                          # tiny shapes on CPU: checks the script, measures nothing
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

SHAPES = {  # the real configs' shapes, from each model's config.json
    "mistral-7b": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=32768, rope_theta=10000.0, sliding_window=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "gemma2-2b": dict(
        model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0, max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
    ),
    "gemma3-4b-text": dict(
        model_type="gemma3_text", vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024, max_position_embeddings=131072, rms_norm_eps=1e-6,
        tie_word_embeddings=True, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
    ),
    "phi3-mini": dict(
        model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, max_position_embeddings=4096, original_max_position_embeddings=4096, sliding_window=2047, rope_theta=10000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=None,
    ),
    "olmo2-1b": dict(
        model_type="olmo2", vocab_size=100352, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "smollm3-3b": dict(
        model_type="smollm3", vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=65536, rope_theta=5000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
}  # fmt: skip
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, vocab_size=512)
NO_IDS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # smoke: the real ids lie past its vocab
REWARD = "def reward(prompts, completions, **columns):\n    return [float(len(set(c)) % 5) for c in completions]\n"
DEVICE, DTYPE = "cuda", torch.bfloat16


def config_of(name: str, smoke: bool, **overrides):
    from transformers import AutoConfig

    shape = dict(SHAPES[name])
    model_type = shape.pop("model_type")
    if smoke:
        shape.update({k: v for k, v in SMOKE.items() if k in shape or k == "head_dim"}, **NO_IDS)
        if shape.get("sliding_window"):
            shape["sliding_window"] = 8  # the smoke's prompts run past it
        if model_type == "phi3":
            shape.pop("head_dim", None)
    shape.update(overrides)
    return AutoConfig.for_model(model_type, **shape)


def build(name: str, smoke: bool):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config_of(name, smoke), dtype=DTYPE)
    return model.eval()


def shape_of(name: str, smoke: bool) -> tuple[int, int]:
    """(prompts, new tokens) of the family's workload."""
    if smoke:
        return 8, 16
    return (128, 1024) if name == "mistral-7b" else (512, 256)


def prompts_of(vocab: int, count: int, length: int = 128, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(length)] for _ in range(count)]


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def hf_generate(model, prompts: list[list[int]], new_tokens: int, *, greedy: bool) -> list[list[int]]:
    from transformers import GenerationConfig

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=DEVICE)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=DEVICE)
    model.generation_config.eos_token_id = None  # every sequence runs its new tokens (as ignore_eos), nothing else masked
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=not greedy, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    synchronize()
    return out[:, width:].tolist()


def engine_for(model, max_model_len: int, max_num_seqs: int):
    from tandemrl.generation.base import EngineConfig, describe_generator
    from tandemrl.generation.factory import build_generator

    config = EngineConfig(device=DEVICE, gpu_memory_utilization=0.6, max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=16384)
    engine = build_generator(config, model=model)
    assert describe_generator(engine) == "engine", describe_generator(engine)
    return engine


def engine_generate(engine, prompts: list[list[int]], new_tokens: int, *, greedy: bool) -> list[list[int]]:
    from tandemrl.types import SamplingParams

    async def go():
        params = [SamplingParams(max_tokens=new_tokens, temperature=0.0 if greedy else 1.0, ignore_eos=True, seed=i) for i in range(len(prompts))]
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))

    return [c.token_ids for c in asyncio.run(go())]


DATASHEET = {"H200": (989e12, 4.8e12), "H100": (989e12, 3.35e12)}  # dense bf16 FLOP/s, HBM bytes/s (SXM datasheets)


def workload_floor(model, prompts: int, prompt_len: int, new_tokens: int, bandwidth: float, flop_rate: float) -> dict:
    """The fastest any engine running a model's bf16 kernels one after another could do the workload: the prefill
    compute-bound (the head on each prompt's last token only); each decode step's matmuls at the larger of
    their FLOPs at `flop_rate` and their weights read once at `bandwidth`, plus every sequence's KV read once
    (each workload's contexts lie within its family's sliding window: at most 384 tokens at 512 x 256,
    1,152 for Mistral's window of 4,096). Returns the floor and its split
    in seconds; `transformers_s / floor_s` is the most any engine can be faster than transformers here."""
    config = model.config
    head = config.vocab_size * config.hidden_size
    body = sum(p.numel() for p in model.parameters()) - head * (1 if config.tie_word_embeddings else 2)  # the input embedding is a lookup
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2  # bf16 K and V
    prefill = 2 * (body * prompt_len + head) * prompts / flop_rate
    matmuls = new_tokens * max(2 * (body + head) * prompts / flop_rate, 2 * (body + head) / bandwidth)
    attention = sum(prompts * (prompt_len + i) * kv_per_token for i in range(new_tokens)) / bandwidth
    return {"floor_s": round(prefill + matmuls + attention, 3), "floor_prefill_s": round(prefill, 3), "floor_matmuls_s": round(matmuls, 3),
            "floor_attention_s": round(attention, 3)}  # fmt: skip


def bench_generate(name: str, args) -> None:
    model = build(name, args.smoke)
    num_prompts, new_tokens = shape_of(name, args.smoke)
    prompts = prompts_of(model.config.vocab_size, num_prompts)
    parameters_b = sum(p.numel() for p in model.parameters()) / 1e9
    # warm, as bench/engine.py's baselines: the same call untimed first (kernels picked, and the caching allocator
    # holding what a 512-row dynamic cache takes; a short warm-up left that to the timed call: Gemma-3's
    # transformers run took 26-30 s alone and 13.3 s after two other families had warmed the allocator)
    hf_generate(model, prompts, new_tokens, greedy=False) if args.warm == "full" else hf_generate(model, prompts[:2], 4, greedy=False)
    start = time.perf_counter()
    hf_generate(model, prompts, new_tokens, greedy=False)
    hf_s = time.perf_counter() - start
    hf_tps = num_prompts * new_tokens / hf_s
    print(json.dumps({"family": name, "system": "transformers generate", "parameters_b": round(parameters_b, 2), "prompts": num_prompts, "new_tokens": new_tokens, "seconds": round(hf_s, 2), "tokens_per_s": round(hf_tps, 1)}), flush=True)  # fmt: skip
    if DEVICE == "cuda":
        torch.cuda.empty_cache()  # transformers' cache memory back, before the engine sizes its KV cache from what is free
    from tandemrl.generation.engine.models import llama

    settings, timed, engine = args.fused_norms.split(","), {}, None
    device_s = {}
    for setting in settings:  # ours once per FUSED_NORMS setting (models/llama.py), a fresh engine each
        if engine is not None:
            asyncio.run(engine.close())
            del engine
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        llama.FUSED_NORMS = setting == "on"
        engine = engine_for(model, 128 + max(new_tokens, args.agree_tokens), max(num_prompts, args.agree_prompts))
        engine_generate(engine, prompts if args.warm == "full" else prompts[:64], new_tokens if args.warm == "full" else 16, greedy=False)  # warm alike
        before = engine.stats() if hasattr(engine, "stats") else {}
        start = time.perf_counter()
        out = engine_generate(engine, prompts, new_tokens, greedy=False)
        timed[setting] = time.perf_counter() - start
        assert sum(map(len, out)) == num_prompts * new_tokens
        tps = num_prompts * new_tokens / timed[setting]
        from engine import counters_since  # bench/engine.py

        stats = counters_since(engine, before) if before else {}  # the timed call's share (the warm call's taken out)
        device_s[setting] = stats.get("engine/gpu_s")
        label = {"fused_norms": setting} if len(settings) > 1 else {}
        print(json.dumps({"family": name, "system": "ours", **label, "prompts": num_prompts, "new_tokens": new_tokens, "seconds": round(timed[setting], 2), "tokens_per_s": round(tps, 1), **stats}), flush=True)  # fmt: skip
        print(f"{name}: ours{'' if not label else f' (fused norms {setting})'} vs transformers generate (output tokens/s, {num_prompts} x {new_tokens}): {tps / hf_tps:.2f}x", flush=True)
    if "off" in timed and "on" in timed:
        print(f"ratio {name} time fused norms off/on = {timed['off'] / timed['on']:.3f}", flush=True)
        if device_s["off"] and device_s["on"]:  # the engine's device time: wall time also holds the host's noise
            print(f"ratio {name} device time fused norms off/on = {device_s['off'] / device_s['on']:.3f}", flush=True)
    ours_s = timed[settings[0]]  # the floor's lines below: the first setting's
    if DEVICE == "cuda":  # how near the floor ours runs, and the most a bf16 engine could beat transformers by here
        from engine import copy_bandwidth, matmul_rate  # bench/engine.py

        bandwidth, flop_rate = copy_bandwidth(), matmul_rate()
        floor = workload_floor(model, num_prompts, len(prompts[0]), new_tokens, bandwidth, flop_rate)
        record = {"family": name, "copy_bandwidth_GBps": round(bandwidth / 1e9, 1), "matmul_TFLOPs": round(flop_rate / 1e12, 1), **floor,
                  "ours_fraction_of_floor": round(floor["floor_s"] / ours_s, 3), "most_possible_ratio": round(hf_s / floor["floor_s"], 2)}  # fmt: skip
        # kernels can beat the measured rates (the 8192^3 product and a copy): the datasheet's peaks bound every engine
        peaks = next((v for k, v in DATASHEET.items() if k in torch.cuda.get_device_name()), None)
        if peaks is not None:
            datasheet_s = workload_floor(model, num_prompts, len(prompts[0]), new_tokens, peaks[1], peaks[0])["floor_s"]
            record |= {"datasheet_floor_s": datasheet_s, "ours_fraction_of_datasheet_floor": round(datasheet_s / ours_s, 3),
                       "most_possible_ratio_at_datasheet": round(hf_s / datasheet_s, 2)}  # fmt: skip
        print(json.dumps(record), flush=True)
    if args.profile and DEVICE == "cuda":  # where ours spends its device time: the top kernels of one more call
        from engine import print_kernel_profile  # bench/engine.py

        print_kernel_profile(lambda: engine_generate(engine, prompts, new_tokens, greedy=False), top=25)
    agree = prompts_of(model.config.vocab_size, args.agree_prompts, seed=1)
    ours, theirs = engine_generate(engine, agree, args.agree_tokens, greedy=True), hf_generate(model, agree, args.agree_tokens, greedy=True)
    prefixes = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, theirs)]
    print(json.dumps({"family": name, "greedy_bf16_identical": f"{sum(x == y for x, y in zip(ours, theirs))}/{len(agree)}", "mean_common_prefix": round(sum(prefixes) / len(prefixes), 1), "tokens": args.agree_tokens}), flush=True)  # fmt: skip
    asyncio.run(engine.close())
    del engine, model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def save_for_training(name: str, path: Path, args) -> None:
    from transformers import AutoModelForCausalLM

    from tandemrl.tasks.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # the real ids lie past the tiny vocab (SmolLM3: pad 128004)
    config = config_of(name, args.smoke, num_hidden_layers=args.train_layers, **ids)
    if config.model_type == "gemma3_text":
        config.layer_types = ["sliding_attention"] * (args.train_layers - 1) + ["full_attention"]  # both kinds, as in the full depth
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def bench_train(name: str, args, work: Path) -> None:
    save_for_training(name, work / name, args)
    run_dir = work / f"{name}-run"
    command = [
        sys.executable, "-m", "tandemrl", "train", "--model", str(work / name), "--dataset", str(work / "data.jsonl"),
        "--reward_funcs", f"{work / 'reward.py'}:reward", "--output_dir", str(run_dir), "--max_steps", str(args.train_steps),
        "--num_prompts_per_step", "8", "--num_generations", "8", "--max_completion_length", str(args.completion_tokens),
        "--learning_rate", "1e-5", "--save_steps", "0", *([] if args.compile else ["--no-torch_compile"]),
        *(["--device", "cpu"] if args.smoke else []),
    ]  # fmt: skip
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, timeout=args.train_timeout_s, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if result.returncode != 0:
        print(result.stdout[-3000:], result.stderr[-3000:], sep="\n", flush=True)
        raise SystemExit(f"{name}: tandem train failed ({result.returncode})")
    generator = next((line.split("generator: ", 1)[1] for line in result.stdout.splitlines() if "generator: " in line), "(no banner line)")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [row[key] for row in rows for key in ("loss", "train/loss") if key in row]
    print(json.dumps({"family": name, "system": "tandem train", "layers": args.train_layers, "steps": args.train_steps, "generator": generator, "seconds": round(time.perf_counter() - start, 1), "loss": losses}), flush=True)  # fmt: skip
    if generator != "engine":
        raise SystemExit(f"{name}: tandem train generated with {generator}, not the engine")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="generate,train")
    parser.add_argument("--families", default=",".join(SHAPES))
    parser.add_argument("--agree_prompts", type=int, default=16)
    parser.add_argument("--agree_tokens", type=int, default=64)
    parser.add_argument("--train_layers", type=int, default=2)
    parser.add_argument("--train_steps", type=int, default=1)
    parser.add_argument("--completion_tokens", type=int, default=128)
    parser.add_argument("--compile", action="store_true", help="tandem train with its compiled decoder layers (~1 min more a family)")
    parser.add_argument("--train_timeout_s", type=float, default=300)
    parser.add_argument("--fused_norms", default="on", help="models/llama.py's FUSED_NORMS (on by default), ours timed once per setting: off, on, or off,on")
    parser.add_argument("--family_timeout_s", type=float, default=900, help="most seconds one family's generate part may take (its own process)")
    parser.add_argument("--warm", choices=("full", "short"), default="full", help="each side's untimed call first: the timed workload itself "
                        "(full), or a short one (short: how the figures before Dec 3's third session were measured)")
    parser.add_argument("--profile", action="store_true", help="after ours is timed, print its top device kernels from one more call")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: checks the script, measures nothing")
    args = parser.parse_args()
    global DEVICE, DTYPE
    DEVICE, DTYPE = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    families, parts = args.families.split(","), args.parts.split(",")
    unknown = set(families) - set(SHAPES)
    if unknown:
        raise SystemExit(f"unknown families {sorted(unknown)}; pick from {', '.join(SHAPES)}")
    start = time.perf_counter()
    if "generate" in parts:
        for name in families:
            if len(families) > 1 and not args.smoke:
                # a process per family: what one family's engine and transformers leave in the CUDA context (its
                # graphs' pools, allocator caches) must not shrink the next one's memory (an OOM on Dec 3)
                child = [sys.executable, __file__, *sys.argv[1:], "--parts", "generate", "--families", name]
                try:
                    code = subprocess.run(child, check=False, timeout=args.family_timeout_s).returncode
                except subprocess.TimeoutExpired:
                    code = "timeout"
                if code != 0:
                    print(json.dumps({"family": name, "failed": code, "timeout_s": args.family_timeout_s}), flush=True)
            else:
                bench_generate(name, args)
    if "train" in parts:
        work = Path(tempfile.mkdtemp(prefix="tandem-families-"))
        (work / "reward.py").write_text(REWARD)
        rng = random.Random(0)
        letters = "abcdefghijklmnopqrstuvwxyz "
        (work / "data.jsonl").write_text("".join(json.dumps({"prompt": "".join(rng.choice(letters) for _ in range(64))}) + "\n" for _ in range(64)))
        for name in families:
            bench_train(name, args, work)
    print(json.dumps({"bench": "families", "wall_s": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
