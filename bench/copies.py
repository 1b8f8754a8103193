"""Device copy speed of a staged CUDA IPC update's two copies, by method: the trainer's pack (its
parameters into one flat buffer) and the server's apply (the flat buffer's views into the engine's fused
parameters), against one flat copy of the same bytes. Qwen2.5 0.5B and 1.5B parameter shapes, random bf16,
no model and no server: it says how far each copy is from the device's copy speed, and which call is nearest.

    python bench/copies.py                              # one GPU
    python bench/copies.py --device cpu --shapes tiny   # checks the script

Prints one JSON line per shape and method: device ms (median of --repeats, CUDA events), host ms of the
call (the launch), GB/s of the payload (its bytes once).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

SHAPES = {  # hidden, intermediate, layers, kv heads x head dim, vocab
    "0.5b": (896, 4864, 24, 2 * 64, 151936),
    "1.5b": (1536, 8960, 28, 2 * 128, 151936),
    "tiny": (64, 128, 2, 2 * 16, 320),
}


def hf_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The Hugging Face parameters of a tied Qwen2 model, in named_parameters order."""
    hidden, inter, layers, kv, vocab = SHAPES[shape]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.q_proj.bias", (hidden,)),
                (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.bias", (kv,)),
                (p + "self_attn.o_proj.weight", (hidden, hidden)), (p + "mlp.gate_proj.weight", (inter, hidden)),
                (p + "mlp.up_proj.weight", (inter, hidden)), (p + "mlp.down_proj.weight", (hidden, inter)),
                (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]  # fmt: skip
    return out + [("model.norm.weight", (hidden,))]


def engine_targets(shape: str, device: torch.device) -> list[torch.Tensor]:
    """Where the server's engine copies each Hugging Face tensor: q/k/v into rows of one fused qkv
    parameter, gate/up into rows of gate_up, the rest whole (as generation/engine/models/llama.py)."""
    hidden, inter, layers, kv, vocab = SHAPES[shape]
    new = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device=device)  # noqa: E731
    out = [new(vocab, hidden)]
    for _ in range(layers):
        qkv, qkv_bias, gate_up = new(hidden + 2 * kv, hidden), new(hidden + 2 * kv), new(2 * inter, hidden)
        out += [qkv[:hidden], qkv_bias[:hidden], qkv[hidden : hidden + kv], qkv_bias[hidden : hidden + kv], qkv[hidden + kv :],
                qkv_bias[hidden + kv :], new(hidden, hidden), gate_up[:inter], gate_up[inter:], new(hidden, inter), new(hidden), new(hidden)]  # fmt: skip
    return out + [new(hidden)]


def timed(call: Callable[[], object], device: torch.device, repeats: int) -> tuple[float, float]:
    """(median device ms, median host ms of the call)."""
    call()
    device_ms, host_ms = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        call()
        host_ms.append((time.perf_counter() - t0) * 1e3)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            device_ms.append(start.elapsed_time(end))
        else:
            device_ms.append(host_ms[-1])
    return statistics.median(device_ms), statistics.median(host_ms)


def bench(shape: str, device: torch.device, repeats: int) -> None:
    shapes = hf_shapes(shape)
    params = [torch.randn(s, device=device).to(torch.bfloat16) for _, s in shapes]  # the trainer's, allocated one by one
    sizes = [p.numel() for p in params]
    total = sum(sizes)
    flat = torch.empty(total, dtype=torch.bfloat16, device=device)  # staging: gapless here (every Qwen2.5 tensor is a multiple of 64 bytes)
    other = torch.empty_like(flat)
    views = list(flat.split(sizes))
    views = [v.view(p.shape) for v, p in zip(views, params)]
    targets = engine_targets(shape, device)
    flat_targets = [t.view(-1) for t in targets]
    flat_params = [p.view(-1) for p in params]
    methods: dict[str, Callable[[], object]] = {
        "one flat copy of the bytes": lambda: other.copy_(flat),
        "pack: _foreach_copy_ (buckets.pack)": lambda: torch._foreach_copy_(views, params),
        "pack: torch.cat out=": lambda: torch.cat(flat_params, out=flat),
        "pack: _chunk_cat out=": lambda: torch._chunk_cat(params, 0, 1, out=flat.view(1, -1)),
        "pack: copy_ each": lambda: [v.copy_(p) for v, p in zip(views, params)],
        "apply: _foreach_copy_ by 64 (a plan batch)": lambda: [torch._foreach_copy_(targets[i : i + 64], views[i : i + 64]) for i in range(0, len(views), 64)],
        "apply: _foreach_copy_ all": lambda: torch._foreach_copy_(targets, views),
        "apply: split_with_sizes_copy out= (a plan run)": lambda: torch.split_with_sizes_copy(flat, sizes, out=flat_targets),
    }
    for name, call in methods.items():
        try:
            device_ms, host_ms = timed(call, device, repeats)
        except (RuntimeError, TypeError) as error:
            print(json.dumps({"bench": "copies", "shape": shape, "method": name, "error": str(error)[:200]}))
            continue
        print(json.dumps({"bench": "copies", "shape": shape, "method": name, "tensors": len(params), "GB": round(total * 2 / 1e9, 3),
                          "device_ms": round(device_ms, 3), "host_ms": round(host_ms, 3), "GB/s": round(total * 2 / device_ms / 1e6, 1)}))
    torch._foreach_copy_(views, params)
    torch.split_with_sizes_copy(flat, sizes, out=flat_targets)
    assert all(torch.equal(t, p) for t, p in zip(targets, params)), "split_with_sizes_copy put a tensor elsewhere"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0.5b,1.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        bench(shape, torch.device(args.device), args.repeats)


if __name__ == "__main__":
    main()
