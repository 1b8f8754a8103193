"""Output tokens/s of our engine against transformers on random-weight Qwen2.5-shaped models (GPU).

In one process: ours, `generate` (padded batch, dynamic cache), `generate` with a static cache
(compiled), and transformers continuous batching (`generate_batch`, paged|sdpa; on mixed, the manager
it wraps, so each request gets its own length). Workloads: GRPO (64 prompts x 8 samples, 128 prompt
tokens, 256 or 1024 new, ignore EOS, temperature 1), mixed (256 requests, prompt and output lengths
uniform in [100, 1024]), long rollouts `new{N}x{B}` (B prompts of 128 tokens, N new tokens each: 1k-16k)
and decode at a context `ctx{C}x{B}` (B prompts of C tokens; two calls of 16 and 80 new tokens, their
difference is 64 decode steps at context ~C, so prefill is left out). Baselines are timed warm (after one
untimed call of the same shape). Prints one JSON line per figure and one ratio line per comparison,
ours as a fraction of a decode roofline (weights + KV bytes per step over measured copy bandwidth), and
per decode step: device time, bytes read (weights + KV), the fraction of the memory-bandwidth limit and
of the compute limit (2 x params x rows + attention FLOPs over the measured bf16 matrix rate), and which
binds. `--sampling top_p=0.9` (or top_k=50, min_p=0.05, comma-joined) filters every request.

    python bench/engine.py --models 0.5b --workloads grpo256 --only ours,generate,static,cb
    python bench/engine.py --models 0.5b,1.5b --workloads ctx4096x128,ctx8192x128 --only ours --profile
    python bench/engine.py --models 0.5b --workloads new4096x128 --only ours,static
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import torch

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2),
}
SHAPE_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4)  # untied head
SYSTEMS = ("ours", "generate", "static", "cb")


def build_model(shape: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=151936 if shape != "7b" else 152064, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=shape != "7b", bos_token_id=151643, eos_token_id=151645, **(SHAPE_7B if shape == "7b" else SHAPES[shape]),
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def workload(name: str, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt_ids, new tokens) per request."""
    rng = random.Random(seed)
    if name.startswith(("new", "ctx")):
        length, batch = (int(x) for x in name[3:].split("x"))
        prompt, new = (128, length) if name.startswith("new") else (length, 16)
        return [([rng.randrange(1000, 150000) for _ in range(prompt)], new) for _ in range(batch)]
    if name.startswith("grpo"):
        new = int(name[4:])
        prompts = [[rng.randrange(1000, 150000) for _ in range(128)] for _ in range(64)]
        return [(p, new) for p in prompts for _ in range(8)]
    return [([rng.randrange(1000, 150000) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024)) for _ in range(256)]


def run_ours(
    model, calls: list[list[tuple[list[int], int]]], *, max_model_len: int, profile: bool = False, sampling: dict | None = None, memory: float = 0.6,
    decode_graphs: str = "plain",
) -> list[tuple[float, dict]]:
    """(seconds, step split) of each call (a list of requests), timed in turn on one engine after a warm call."""
    from tandemrl.generation.base import EngineConfig
    from tandemrl.generation.engine import Engine
    from tandemrl.types import SamplingParams

    config = EngineConfig(device="cuda", gpu_memory_utilization=memory, max_num_seqs=512, max_model_len=max_model_len, max_num_batched_tokens=16384)
    config.decode_graphs = decode_graphs
    engine = Engine(config, model=model)

    async def go(reqs):
        params = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True, seed=i, **(sampling or {})) for i, (_, n) in enumerate(reqs)]
        return await asyncio.gather(*(engine.generate(p, s) for (p, _), s in zip(reqs, params)))

    asyncio.run(go([(p[:128], min(n, 64)) for p, n in calls[0][:64]]))  # warm: Triton kernels compile (graphs were captured at start)
    results = []
    for requests in calls:
        before = engine.stats()
        start = time.perf_counter()
        completions = asyncio.run(go(requests))
        elapsed = time.perf_counter() - start
        after = engine.stats()
        assert sum(len(c.token_ids) for c in completions) == sum(n for _, n in requests)
        results.append((elapsed, {k.split("/")[1]: round(after[k] - before[k], 4) for k in after if k.endswith(("_s", "steps", "preemptions"))}))
    if profile:  # one more call under the profiler, after the timed ones: the profiler slows what it watches
        print_kernel_profile(lambda: asyncio.run(go(calls[-1])))
    asyncio.run(engine.close())
    del engine
    torch.cuda.empty_cache()
    return results


def counters_since(engine, before: dict) -> dict:
    """The engine's time and step counters (engine.stats()) since `before`, a stats() taken earlier: they
    count from the engine's start, so a warm call's share is subtracted."""
    return {k: round(v - before.get(k, 0), 3) for k, v in engine.stats().items() if k.endswith(("_s", "steps"))}


def print_kernel_profile(call, top: int = 20) -> None:
    """One JSON line per device kernel (or op) with the most device time in `call`, and their share of it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]:
        share = e.self_device_time_total / total
        print(json.dumps({"kernel": e.key[:120], "calls": e.count, "device_ms": round(e.self_device_time_total / 1e3, 1), "share": round(share, 3)}), flush=True)
    print(json.dumps({"kernel_total_device_ms": round(total / 1e3, 1), "kernels": len(events)}), flush=True)


def run_generate(model, requests, *, static: bool) -> float:
    from transformers import GenerationConfig

    width = max(len(p) for p, _ in requests)
    new = max(n for _, n in requests)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in requests], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in requests], device="cuda")
    config = GenerationConfig(
        max_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        pad_token_id=0, eos_token_id=None,
        cache_implementation="static" if static else None,
    )  # fmt: skip

    def call():
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        torch.cuda.synchronize()

    call()  # warm, same shape
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def run_cb(model, requests) -> float:
    """transformers continuous batching, paged|sdpa. `generate_batch` takes one `max_new_tokens` for the
    whole batch, so requests of different lengths (mixed) go through the manager it wraps, each with its own."""
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    new = max(n for _, n in requests)
    model.set_attn_implementation("paged|sdpa")
    config = GenerationConfig(max_new_tokens=new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=-1, pad_token_id=0)
    inputs = [p for p, _ in requests]
    hints = WorkloadHints(max_prompt_length=max(map(len, inputs)), max_generated_length=new, num_requests=len(requests))

    def per_request_lengths():
        with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5, workload_hints=hints) as manager:
            for prompt, n in sorted(requests, reverse=True):  # as generate_batch orders them, for prefix sharing
                manager.add_request(prompt, max_new_tokens=n, eos_token_id=-1)
            generated = 0
            for _ in requests:
                result = None
                while result is None or not result.is_finished():
                    result = manager.get_result(timeout=1)
                    if result is None and not manager.is_running():
                        raise RuntimeError("transformers' continuous batching manager stopped before finishing")
                generated += len(result.generated_tokens)
        if generated != sum(n for _, n in requests):
            raise RuntimeError(f"continuous batching generated {generated} tokens, the workload asked for {sum(n for _, n in requests)}")

    def call():
        if len({n for _, n in requests}) == 1:
            model.generate_batch(inputs=inputs, generation_config=config)
        else:
            per_request_lengths()
        torch.cuda.synchronize()

    try:
        call()  # warm, same shape
        start = time.perf_counter()
        call()
        return time.perf_counter() - start
    finally:
        model.set_attn_implementation("sdpa")


def copy_bandwidth() -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 4 * 20 / (time.perf_counter() - start)


def matmul_rate() -> float:
    """FLOP/s of a bf16 8192^3 matrix product on random data (the compute ceiling)."""
    a, b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16), torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192**3 * 10 / (time.perf_counter() - start)


def step_cost(model, rows: int, mean_context: float) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step of `rows` sequences at `mean_context` positions: the weights read
    once and every sequence's KV once; 2 x params x rows (the input embedding is a lookup) plus the
    attention's 4 x context x heads x head dim per layer and row."""
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = config.hidden_size // config.num_attention_heads
    kv_bytes = rows * mean_context * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2
    matmul_params = sum(p.numel() for p in model.parameters()) - (0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size)
    flops = 2 * matmul_params * rows + 4 * rows * mean_context * config.num_attention_heads * head_dim * config.num_hidden_layers
    return weight_bytes + kv_bytes, flops


def limits(model, rows: int, mean_context: float, step_s: float, bandwidth: float, flop_rate: float) -> dict:
    """One decode step's device time against its two floors: the fraction of each limit it reaches, and
    the binding one (the larger fraction: the floor nearer to the time taken)."""
    num_bytes, flops = step_cost(model, rows, mean_context)
    memory, compute = num_bytes / bandwidth / step_s, flops / flop_rate / step_s
    return {
        "step_device_ms": round(step_s * 1e3, 3), "bytes_read_GB": round(num_bytes / 1e9, 3), "fraction_of_bandwidth_limit": round(memory, 3),
        "fraction_of_compute_limit": round(compute, 3), "binding": "memory" if memory >= compute else "compute",
    }  # fmt: skip


def decode_roofline(model, requests, bandwidth: float) -> float:
    """Tokens/s if every decode step only read the weights once and each sequence's KV once."""
    seconds = 0.0  # simulate the decode steps of a perfect continuous batcher at batch <= 512
    queue = sorted(((len(p), n) for p, n in requests), key=lambda r: r[1])
    lens: list[list[int]] = []
    while queue or lens:
        while queue and len(lens) < 512:
            p, n = queue.pop()
            lens.append([p, n])
        num_bytes, _ = step_cost(model, len(lens), sum(c for c, _ in lens) / len(lens))
        seconds += num_bytes / bandwidth
        lens = [[c + 1, n - 1] for c, n in lens if n > 1]
    return sum(n for _, n in requests) / seconds


def run_at_context(model, name: str, args, bandwidth: float, flop_rate: float) -> None:
    """Decode steps at a context of C positions: a call of 16 new tokens and one of 80 (other prompts, so no
    prefix is cached), both with the same prefill; their difference is 64 decode steps."""
    short, long = workload(name, seed=1), [(p, 80) for p, _ in workload(name, seed=2)]
    context = len(short[0][0])
    (short_s, short_split), (long_s, long_split) = run_ours(
        model, [short, long], max_model_len=context + 96, profile=args.profile, sampling=args.sampling, memory=args.gpu_memory_utilization
    )  # fmt: skip
    steps = long_split["num_steps"] - short_split["num_steps"]
    decode_gpu_s = [split.get("decode_gpu_s", split["gpu_s"] - split["prefill_gpu_s"]) for split in (short_split, long_split)]  # a tree before it
    device_s = (decode_gpu_s[1] - decode_gpu_s[0]) / steps
    record = {"model": model.shape_name, "workload": name, "system": "ours", "rows": len(short), "context": context + 48, "decode_steps": steps,
              "preemptions": [short_split["num_preemptions"], long_split["num_preemptions"]]}  # fmt: skip
    record |= limits(model, len(short), context + 48, device_s, bandwidth, flop_rate)
    record["step_wall_ms"] = round((long_s - short_s) / steps * 1e3, 3)
    if steps != 64:  # the two calls were scheduled differently (a preemption, prefills interleaved otherwise)
        record["invalid"] = f"{steps} decode steps apart, not 64: not one steady decode step; run again or with fewer rows"
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="0.5b,1.5b", help="0.5b, 1.5b, 7b")
    parser.add_argument("--workloads", default="grpo256,grpo1024,mixed", help="grpo256, grpo1024, mixed, new{N}x{B}, ctx{C}x{B}")
    parser.add_argument("--only", default=",".join(SYSTEMS), help="systems to run: ours,generate,static,cb")
    parser.add_argument("--profile", action="store_true", help="after ours is timed, print its top device kernels from one more call")
    parser.add_argument(
        "--sampling", default="", help="';'-separated filters of every request, ours run once each, e.g. ';top_p=0.9;top_k=50' (none, then two)"
    )  # fmt: skip
    parser.add_argument("--gpu_memory_utilization", type=float, default=0.6, help="ours' share of the GPU (KV cache room)")
    parser.add_argument("--decode_graphs", default="filtered", help="each filtered --sampling variant's decode graphs: filtered (what tandem train's auto picks for it), plain, or plain,filtered (EngineSettings.decode_graphs); the unfiltered run's are plain")
    args = parser.parse_args()
    variants = [{k: (int(v) if k == "top_k" else float(v)) for k, v in (kv.split("=") for kv in variant.split(",") if kv)} for variant in args.sampling.split(";")]
    args.sampling = variants[0]  # of the ctx workloads (decode steps at a context)
    systems = args.only.split(",")
    bandwidth, flop_rate = copy_bandwidth(), matmul_rate()
    print(json.dumps({"copy_bandwidth_GBps": round(bandwidth / 1e9, 1), "bf16_matmul_TFLOPs": round(flop_rate / 1e12, 1), "device": torch.cuda.get_device_name()}), flush=True)
    for shape in args.models.split(","):
        model = build_model(shape)
        model.shape_name = shape
        for name in args.workloads.split(","):
            if name.startswith("ctx"):
                run_at_context(model, name, args, bandwidth, flop_rate)
                continue
            requests = workload(name)
            num_tokens = sum(n for _, n in requests)
            max_len = max(len(p) + n for p, n in requests)
            figures = {}
            graphed = args.decode_graphs.split(",")
            runs = [("ours", v, g) for v in variants if "ours" in systems for g in (graphed if v else ["plain"])]
            runs += [(s, {}, None) for s in systems if s != "ours"]
            for system, sampling, graphs in runs:
                if system == "ours":  # named first, so that a failing variant's error line names it
                    system += "".join(f",{k}={v}" for k, v in sampling.items()) + (f",graphs={graphs}" if sampling and len(graphed) > 1 else "")
                try:
                    if system.startswith("ours"):
                        [(elapsed, split)] = run_ours(
                            model, [requests], max_model_len=max_len, profile=args.profile, sampling=sampling, memory=args.gpu_memory_utilization,
                            decode_graphs=graphs,
                        )  # fmt: skip
                    elif system == "cb":
                        elapsed, split = run_cb(model, requests), {}
                    else:
                        elapsed, split = run_generate(model, requests, static=system == "static"), {}
                except Exception as error:  # noqa: BLE001 - a failing baseline is reported, the rest still runs
                    print(json.dumps({"model": shape, "workload": name, "system": system, "error": repr(error)[:300]}), flush=True)
                    continue
                figures[system] = num_tokens / elapsed
                record = {"model": shape, "workload": name, "system": system, "tokens_per_s": round(figures[system]), "seconds": round(elapsed, 2)}
                if system.startswith("ours"):
                    record["roofline_tokens_per_s"] = round(decode_roofline(model, requests, bandwidth))
                    record["fraction_of_roofline"] = round(figures[system] / record["roofline_tokens_per_s"], 3)
                    record["step_split_s"] = split
                    decode_steps = split["num_steps"] - split["num_prefill_steps"]
                    if decode_steps:  # the mean decode step: rows and context of the workload's middle
                        rows, middle = min(512, len(requests)), sum(len(p) + n / 2 for p, n in requests) / len(requests)
                        record["mean_decode_step"] = limits(model, rows, middle, split.get("decode_gpu_s", split["gpu_s"] - split["prefill_gpu_s"]) / decode_steps, bandwidth, flop_rate)
                print(json.dumps(record), flush=True)
                if system != "ours" and "ours" in figures:  # at once: a run cut short keeps its ratios
                    if system.startswith("ours,"):  # a filtered run against the unfiltered one
                        print(f"ratio {shape} {name} time {system}/ours = {figures['ours'] / figures[system]:.2f}", flush=True)
                        base = system.replace("graphs=filtered", "graphs=plain")  # the filtered graphs against the plain ones
                        if base != system and base in figures:
                            print(f"ratio {shape} {name} time {base}/{system} = {figures[system] / figures[base]:.2f}", flush=True)
                    else:
                        print(f"ratio {shape} {name} ours/{system} = {figures['ours'] / figures[system]:.2f}", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
