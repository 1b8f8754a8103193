"""Output tokens/s of our engine against transformers on random-weight Qwen2.5-shaped models (GPU).

In one process: ours, `generate` (padded batch, dynamic cache), `generate` with a static cache
(compiled), and transformers continuous batching (`generate_batch`, paged|sdpa; on mixed, the manager
it wraps, so each request gets its own length). Workloads: GRPO (64 prompts x 8 samples, 128 prompt
tokens, 256 or 1024 new, ignore EOS, temperature 1) and mixed (256 requests, prompt and output lengths
uniform in [100, 1024]). Baselines are timed warm (after one
untimed call of the same shape). Prints one JSON line per figure and one ratio line per comparison,
and ours as a fraction of a decode roofline (weights + KV bytes per step over measured copy bandwidth).

    python bench/engine.py --models 0.5b --workloads grpo256 --only ours,generate,static,cb
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
SYSTEMS = ("ours", "generate", "static", "cb")


def build_model(shape: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645, **SHAPES[shape],
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def workload(name: str) -> list[tuple[list[int], int]]:
    """(prompt_ids, new tokens) per request."""
    rng = random.Random(0)
    if name.startswith("grpo"):
        new = int(name[4:])
        prompts = [[rng.randrange(1000, 150000) for _ in range(128)] for _ in range(64)]
        return [(p, new) for p in prompts for _ in range(8)]
    return [([rng.randrange(1000, 150000) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024)) for _ in range(256)]


def run_ours(model, requests, *, max_model_len: int, profile: bool = False) -> tuple[float, dict]:
    from tandemrl.generation.base import EngineConfig
    from tandemrl.generation.engine import Engine
    from tandemrl.types import SamplingParams

    config = EngineConfig(device="cuda", gpu_memory_utilization=0.6, max_num_seqs=512, max_model_len=max_model_len, max_num_batched_tokens=16384)
    engine = Engine(config, model=model)

    async def go(reqs):
        params = [SamplingParams(max_tokens=n, temperature=1.0, ignore_eos=True, seed=i) for i, (_, n) in enumerate(reqs)]
        return await asyncio.gather(*(engine.generate(p, s) for (p, _), s in zip(reqs, params)))

    asyncio.run(go(requests[:64]))  # warm: Triton kernels compile (graphs were captured at start)
    before = engine.stats()
    start = time.perf_counter()
    completions = asyncio.run(go(requests))
    elapsed = time.perf_counter() - start
    after = engine.stats()
    assert sum(len(c.token_ids) for c in completions) == sum(n for _, n in requests)
    split = {k.split("/")[1]: round(after[k] - before[k], 3) for k in after if k.endswith("_s") or k.endswith("steps")}
    if profile:  # one more call under the profiler, after the timed one: the profiler slows what it watches
        print_kernel_profile(lambda: asyncio.run(go(requests)))
    asyncio.run(engine.close())
    del engine
    torch.cuda.empty_cache()
    return elapsed, split


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


def decode_roofline(model, requests, bandwidth: float) -> float:
    """Tokens/s if every decode step only read the weights once and each sequence's KV once."""
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * (config.hidden_size // config.num_attention_heads) * 2
    seconds = 0.0  # simulate the decode steps of a perfect continuous batcher at batch <= 512
    remaining = sorted(((len(p), n) for p, n in requests), key=lambda r: r[1])
    batch, queue, step = [], list(remaining), 0
    lens: list[list[int]] = []
    while queue or lens:
        while queue and len(lens) < 512:
            p, n = queue.pop()
            lens.append([p, n])
        kv = sum(c for c, _ in lens) * kv_per_token
        seconds += (weight_bytes + kv) / bandwidth
        lens = [[c + 1, n - 1] for c, n in lens if n > 1]
        step += 1
    return sum(n for _, n in requests) / seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="0.5b,1.5b")
    parser.add_argument("--workloads", default="grpo256,grpo1024,mixed")
    parser.add_argument("--only", default=",".join(SYSTEMS), help="systems to run: ours,generate,static,cb")
    parser.add_argument("--profile", action="store_true", help="after ours is timed, print its top device kernels from one more call")
    args = parser.parse_args()
    systems = args.only.split(",")
    bandwidth = copy_bandwidth()
    print(json.dumps({"copy_bandwidth_GBps": round(bandwidth / 1e9, 1), "device": torch.cuda.get_device_name()}), flush=True)
    for shape in args.models.split(","):
        model = build_model(shape)
        for name in args.workloads.split(","):
            requests = workload(name)
            num_tokens = sum(n for _, n in requests)
            max_len = max(len(p) + n for p, n in requests)
            figures = {}
            for system in systems:
                try:
                    if system == "ours":
                        elapsed, split = run_ours(model, requests, max_model_len=max_len, profile=args.profile)
                    elif system == "cb":
                        elapsed, split = run_cb(model, requests), {}
                    else:
                        elapsed, split = run_generate(model, requests, static=system == "static"), {}
                except Exception as error:  # noqa: BLE001 - a failing baseline is reported, the rest still runs
                    print(json.dumps({"model": shape, "workload": name, "system": system, "error": repr(error)[:300]}), flush=True)
                    continue
                figures[system] = num_tokens / elapsed
                record = {"model": shape, "workload": name, "system": system, "tokens_per_s": round(figures[system]), "seconds": round(elapsed, 2)}
                if system == "ours":
                    record["roofline_tokens_per_s"] = round(decode_roofline(model, requests, bandwidth))
                    record["fraction_of_roofline"] = round(figures[system] / record["roofline_tokens_per_s"], 3)
                    record["step_split_s"] = split
                print(json.dumps(record), flush=True)
                if system != "ours" and "ours" in figures:  # at once: a run cut short keeps its ratios
                    print(f"ratio {shape} {name} ours/{system} = {figures['ours'] / figures[system]:.2f}", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
