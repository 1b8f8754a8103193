"""The engine's two decode-step kernels alone on a GPU: split-KV paged decode attention and the sampler.

Attention: one layer's paged KV cache (bf16, blocks of 16 in random order) for B sequences of C positions,
Qwen2.5 0.5B / 1.5B / 7B head shapes; prints the time of one decode_attention call, the KV bytes it must
read, and their ratio to the measured copy bandwidth. `--sweep` first times every launch setting (tile,
warps, stages, programs per SM -> splits) at two sizes, then the best few and the old kernel's setting
(one program per sequence and KV head: splits 1, tile 64, 4 warps, 3 stages) at every size, each
checked against the old setting's output. Sampler: B rows of 151,936 bf16 logits; unfiltered (the fused
Gumbel-max kernel), filtered (the threshold-search kernel, checked against the torch sampler; with `--sweep`
also its tile, warps and list capacity at 256 rows) with top_p / top_k / min_p, and the
torch reference (a full sort), with the filtered/unfiltered ratio. Matmul (`--only matmul`): each layer
projection of the decode step at 128 and 512 rows (Qwen2.5 0.5B / 1.5B / 7B widths, and Mistral-7B's with
--models mistral-7b), as the engine calls it (F.linear on a [out, in] weight) and on the same weight stored
[in, out] (x @ w), which cuBLAS serves with other kernels: the weight bytes each moves per second against the
copy bandwidth, and the ratio of the two layouts (where the 128-row matmuls lose to the bandwidth limit:
bench/RESULTS.md, Mistral-7B's profile).

    python bench/decode.py --sweep
    python bench/decode.py --only sampler
    python bench/decode.py --only matmul --models 0.5b,7b,mistral-7b
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
from triton.testing import do_bench

# query heads, key/value heads, head dim
HEADS = {"0.5b": (14, 2, 64), "1.5b": (12, 2, 128), "7b": (28, 4, 128)}
OLD = dict(splits=1, tile=64, num_warps=4, num_stages=3)
# hidden size, query heads x head dim, key/value heads x head dim, MLP width: the decode step's four projections
WIDTHS = {"0.5b": (896, 896, 128, 4864), "1.5b": (1536, 1536, 256, 8960), "7b": (3584, 3584, 512, 18944), "mistral-7b": (4096, 4096, 1024, 14336)}


def copy_bandwidth() -> float:
    src = torch.randn(256 * 2**20, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * 4 / (ms / 1e3)


def attention_problem(shape: str, batch: int, context: int, block: int = 16):
    heads, kv_heads, dim = HEADS[shape]
    per_seq = math.ceil(context / block)
    num_blocks = batch * per_seq + 1
    k_cache = torch.randn(num_blocks * block, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = (torch.randperm(num_blocks - 1, device="cuda")[: batch * per_seq] + 1).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    kv_bytes = 2 * batch * context * kv_heads * dim * 2
    return (q, k_cache, v_cache, tables, lens, block), kv_bytes


def time_attention(args, setting: dict, reference) -> tuple[float, float]:
    """(median ms, relative error against the reference output)."""
    from tandemrl.generation.engine.layers.attention_kernel import decode_attention

    out = decode_attention(*args, **setting).float()
    error = ((out - reference).norm() / reference.norm()).item() if reference is not None else 0.0
    ms = do_bench(lambda: decode_attention(*args, **setting), warmup=10, rep=60, return_mode="median")
    return ms, error


def settings_grid() -> list[dict]:
    grid = []
    for tile, warps, stages, per_sm in itertools.product((32, 64, 128), (4, 8), (1, 2, 3), (2, 4, 8, 16)):
        grid.append(dict(tile=tile, num_warps=warps, num_stages=stages, programs_per_sm=per_sm, min_chunk=max(256, tile)))
    return grid


def attention(args, bandwidth: float) -> None:
    candidates = [{}]  # the defaults
    if args.sweep:
        for shape, batch, context in (("0.5b", 128, 4096), ("1.5b", 128, 8192)):
            problem, kv_bytes = attention_problem(shape, batch, context)
            from tandemrl.generation.engine.layers.attention_kernel import decode_attention

            reference = decode_attention(*problem, **OLD).float()
            timed = []
            for setting in settings_grid():
                try:
                    ms, error = time_attention(problem, setting, reference)
                except Exception as exc:  # noqa: BLE001 - a setting that does not compile (shared memory) is skipped
                    print(json.dumps({"sweep": shape, "setting": setting, "error": repr(exc)[:120]}), flush=True)
                    continue
                timed.append((ms, setting))
                print(json.dumps({"sweep": shape, "batch": batch, "context": context, **setting, "ms": round(ms, 4), "error": round(error, 5),
                                  "fraction_of_bandwidth": round(kv_bytes / (ms / 1e3) / bandwidth, 3)}), flush=True)  # fmt: skip
            timed.sort(key=lambda t: t[0])
            candidates += [s for _, s in timed[:2] if s not in candidates]
            del problem, reference
            torch.cuda.empty_cache()
    print(json.dumps({"candidates": candidates}), flush=True)
    for shape, batch, context in itertools.product(args.models.split(","), (64, 128, 512), (1024, 4096, 8192, 16384)):
        problem, kv_bytes = attention_problem(shape, batch, context)
        from tandemrl.generation.engine.layers.attention_kernel import decode_attention

        reference = decode_attention(*problem, **OLD).float()
        old_ms, _ = time_attention(problem, OLD, None)
        row = {"shape": shape, "batch": batch, "context": context, "kv_MB": round(kv_bytes / 1e6, 1), "old_ms": round(old_ms, 4),
               "old_fraction": round(kv_bytes / (old_ms / 1e3) / bandwidth, 3)}  # fmt: skip
        for i, setting in enumerate(candidates):
            ms, error = time_attention(problem, setting, reference)
            row[f"c{i}_ms"], row[f"c{i}_fraction"], row[f"c{i}_error"] = round(ms, 4), round(kv_bytes / (ms / 1e3) / bandwidth, 3), round(error, 5)
        print(json.dumps(row), flush=True)
        print(f"ratio attention {shape} B={batch} C={context}: old/default = {old_ms / row['c0_ms']:.2f}x, default at {row['c0_fraction']:.2f} of copy bandwidth", flush=True)
        del problem, reference
        torch.cuda.empty_cache()


SAMPLER_SETTINGS = {"none": {}, "top_p=0.9": dict(top_p=0.9), "top_k=50": dict(top_k=50), "min_p=0.05": dict(min_p=0.05),
                    "top_k=50,top_p=0.9": dict(top_k=50, top_p=0.9)}  # fmt: skip


def sampler_problem(rows: int, scale: float, settings: dict[str, dict], device: str = "cuda"):
    """(logits, temperatures, keys, {setting: its top_k / top_p / min_p tensors}): random bf16 logits of the
    Qwen2.5 vocab (scale 0.5: flat, as random weights give; 3.0: peaked), temperature 1, one key a row; the
    sampler kernels' problem here and in bench/sampler_ab.py."""
    from tandemrl.generation.engine.layers.sampler import row_keys

    vocab = 151936
    logits = (torch.randn(rows, vocab, device=device) * scale).to(torch.bfloat16)
    temps = torch.ones(rows, device=device)
    keys = row_keys(torch.arange(rows, device=device), torch.full((rows,), 5, device=device))
    plain = dict(top_k=torch.full((rows,), vocab, device=device), top_p=torch.ones(rows, device=device), min_p=torch.zeros(rows, device=device))
    params = {name: {k: (torch.full_like(v, change[k]) if k in change else v) for k, v in plain.items()} for name, change in settings.items()}
    return logits, temps, keys, params


def same_as_torch(ids, floors, logits, temps, keys, params: dict) -> tuple[float, float]:
    """The shares of rows whose token and floor equal the torch sampler's (the same keys: the same noise)."""
    from tandemrl.generation.engine.layers.sampler import SamplingTensors, sample

    ref_ids, _, ref_floors = sample(logits, SamplingTensors(temperatures=temps, keys=keys, needs_filter=True, **params))
    return round((ids == ref_ids).float().mean().item(), 4), round(torch.isclose(floors, ref_floors, atol=1e-4).float().mean().item(), 4)


def sampler(args) -> None:
    from tandemrl.generation.engine.layers.sampler import SamplingTensors, sample
    from tandemrl.generation.engine.layers.sampler_kernel import sample_filtered, sample_unfiltered

    for rows, scale in itertools.product((128, 256, 512), (0.5, 3.0)):  # flat logits (random weights) and peaked ones
        logits, temps, keys, settings = sampler_problem(rows, scale, SAMPLER_SETTINGS)
        unfiltered = do_bench(lambda: sample_unfiltered(logits, temps, keys), warmup=10, rep=100, return_mode="median")
        row = {"rows": rows, "logit_scale": scale, "unfiltered_ms": round(unfiltered, 4)}
        for name, params in settings.items():
            call = lambda: sample_filtered(logits, temps, params["top_k"], params["top_p"], params["min_p"], keys)  # noqa: E731
            ids, _, floors = call()
            ms = do_bench(call, warmup=10, rep=100, return_mode="median")
            row[f"{name}_ms"] = round(ms, 4)
            row[f"{name}_same_ids"], row[f"{name}_same_floors"] = same_as_torch(ids, floors, logits, temps, keys, params)
            if name == "top_p=0.9":
                sampling = SamplingTensors(temperatures=temps, keys=keys, needs_filter=True, **params)
                row["torch_sort_top_p_ms"] = round(do_bench(lambda: sample(logits, sampling), warmup=5, rep=30, return_mode="median"), 4)
        print(json.dumps(row), flush=True)
        for name in settings:
            print(f"ratio sampler rows={rows} scale={scale} {name}: filtered / unfiltered = {row[f'{name}_ms'] / unfiltered:.2f}x", flush=True)
        print(f"ratio sampler rows={rows} scale={scale}: torch sort top_p=0.9 / unfiltered = {row['torch_sort_top_p_ms'] / unfiltered:.1f}x", flush=True)
    if args.sweep:  # the filtered kernel's tile, warps and list capacity at 256 flat rows, top_p 0.9 and top_k 50
        logits, ones, keys, settings = sampler_problem(256, 0.5, {"top_p=0.9": dict(top_p=0.9), "top_k=50": dict(top_k=50)})
        for name, params in settings.items():
            for tile, warps, capacity in itertools.product((1024, 2048, 4096), (8, 16, 32), (4096, 16384)):
                call = lambda: sample_filtered(logits, ones, params["top_k"], params["top_p"], params["min_p"], keys, capacity=capacity, tile=tile, num_warps=warps)  # noqa: E731
                ms = do_bench(call, warmup=5, rep=50, return_mode="median")
                print(json.dumps({"sampler_sweep": name, "tile": tile, "num_warps": warps, "capacity": capacity, "ms": round(ms, 4)}), flush=True)


def matmul(args, bandwidth: float) -> None:
    import torch.nn.functional as F

    for shape, rows in itertools.product([m for m in args.models.split(",") if m in WIDTHS], (128, 512)):
        hidden, q, kv, inner = WIDTHS[shape]
        for name, (n_in, n_out) in {"qkv": (hidden, q + 2 * kv), "o": (q, hidden), "gate_up": (hidden, 2 * inner), "down": (inner, hidden)}.items():
            x = torch.randn(rows, n_in, device="cuda", dtype=torch.bfloat16)
            weight = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16) * n_in**-0.5  # [out, in], as the engine holds it
            stored_in_out = weight.t().contiguous()  # [in, out]
            linear = do_bench(lambda: F.linear(x, weight), warmup=25, rep=200, return_mode="median")
            in_out = do_bench(lambda: x @ stored_in_out, warmup=25, rep=200, return_mode="median")
            same = torch.allclose(F.linear(x, weight).float(), (x @ stored_in_out).float(), atol=2e-2, rtol=2e-2)
            weight_bytes = weight.numel() * 2
            row = {"model": shape, "rows": rows, "projection": name, "in": n_in, "out": n_out, "weight_MB": round(weight_bytes / 1e6, 1),
                   "linear_ms": round(linear, 4), "in_out_ms": round(in_out, 4), "same_within_bf16": same}  # fmt: skip
            row["linear_fraction_of_copy"] = round(weight_bytes / (linear / 1e3) / bandwidth, 3)
            row["in_out_fraction_of_copy"] = round(weight_bytes / (in_out / 1e3) / bandwidth, 3)
            print(json.dumps(row), flush=True)
            print(f"ratio matmul {shape} {name} rows={rows}: F.linear [out, in] / x @ [in, out] time = {linear / in_out:.2f}x", flush=True)
            del x, weight, stored_in_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="attention,sampler", help="attention, sampler, matmul")
    parser.add_argument("--models", default="0.5b,1.5b,7b")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(json.dumps({"copy_bandwidth_GBps": round(bandwidth / 1e9, 1), "device": torch.cuda.get_device_name()}), flush=True)
    if "attention" in args.only:
        attention(args, bandwidth)
    if "sampler" in args.only:
        sampler(args)
    if "matmul" in args.only:
        matmul(args, bandwidth)


if __name__ == "__main__":
    main()
