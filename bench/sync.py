"""Weight-sync time and GB/s into a real `tandem rollout` server, for Qwen2.5-0.5B and 1.5B shapes (configs
written here from the real models', random bf16 weights): what `tandem train --rollout_mode server`
publishes through (DistributedSync, handed the trainer's named parameters listed once and held, as the trainer's
`published_weights` holds them), from the first byte to every server's answer that the version is live.

    python bench/sync.py --transport ipc                    # one GPU: trainer and server share it (CUDA IPC)
    python bench/sync.py --transport nccl                   # two GPUs: the server on cuda:1
    python bench/sync.py --device cpu --transport gloo --shapes tiny   # anywhere: checks the script
    python bench/sync.py --device cpu --transport gloo --shapes tiny28 --server_args ""   # the per-tensor fixed cost, on CPU
    python bench/sync.py --device cpu --transport ipc --shapes tiny28 --server_args ""    # IPC's protocol on CPU (a shared file)

Prints one JSON line per sync (with the trainer's phases in ms: a full update's hello, plan, meta,
payload, end; a staged CUDA IPC update's plan, pack (copies queued), payload (until the device ran them),
answer (from the announcement on the staged-update channel to every server's answer) and live, the whole
push until every server made it live; the server's log splits its side: unpack, apply), then one per shape: warm median seconds, GB/s, the bar of issue 13 (NCCL >= 150 GB/s on two
H200s, CUDA IPC >= 300 GB/s; none for gloo) and the ratio to it, the trainer's own send time, whether the server's greedy tokens equal the trainer's after the last sync, and whether
they equal those of a fresh server loaded from disk with the trainer's final weights (same engine: must).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch

QWEN25_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
    max_position_embeddings=32768, vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
)
QWEN25_15B = {**QWEN25_05B, "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=320)
TINY28 = {**TINY, "num_hidden_layers": 28}  # the 1.5B's tensor count (339) at a tiny payload: per-tensor fixed costs show on CPU
SHAPES = {"0.5b": QWEN25_05B, "1.5b": QWEN25_15B, "tiny": TINY, "tiny28": TINY28}
BARS_GBPS = {"nccl": 150.0, "ipc": 300.0}  # issue 13, part 6


def save_model(path: str, shape: dict, dtype: torch.dtype) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandemrl.tasks.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = AutoConfig.for_model("qwen2", bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, **shape)
    torch.manual_seed(0)  # the same random model in every run (transports compared on the same weights)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def start_server(
    model_dir: str, device: str, backend: str, extra: list[str], gpu: int | None = None, cores: set[int] | None = None
) -> tuple[subprocess.Popen, str]:
    """`tandem rollout` in a child process; `gpu` pins it to that physical GPU (default: the trainer's),
    `cores` to those CPU cores."""
    args = [sys.executable, "-m", "tandemrl", "rollout", "--model", model_dir, "--device", device, "--backend", backend,
            "--port", "0", "--max_model_len", "2048", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {})}
    if cores:
        env["OMP_NUM_THREADS"] = str(len(cores))
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env, preexec_fn=pin)
    for line in proc.stdout:
        match = re.search(r"on (http://\S+)", line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, match.group(1)
    raise RuntimeError(f"server exited with {proc.wait()}")


class FullCollections:
    """While entered, the milliseconds of each full (generation 2) garbage collection in this process, in `ms`."""

    def __init__(self) -> None:
        self.ms: list[float] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                self._start = time.perf_counter()
            else:
                self.ms.append((time.perf_counter() - self._start) * 1e3)

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self._callback)


def same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def greedy_of_loaded(trainer, model_dir: str, server_device: str, prompt_ids: list[int], args: argparse.Namespace) -> list[int]:
    """The greedy tokens of a fresh server that loaded the trainer's final weights from disk: the same
    engine and kernels as the synced server, so equal weights give equal tokens (bf16 near-ties cannot
    explain a difference, as they can between the engine and transformers' generate)."""
    from tandemrl.generation.base import RemoteConfig
    from tandemrl.generation.remote import RolloutClient
    from tandemrl.types import SamplingParams

    with tempfile.TemporaryDirectory() as final_dir:
        trainer.save_pretrained(final_dir)
        for name in os.listdir(model_dir):
            if "token" in name or name.endswith(("vocab.json", "merges.txt")):
                shutil.copy(os.path.join(model_dir, name), final_dir)
        server, url = start_server(final_dir, server_device, args.backend, args.server_args.split(), gpu=args.server_gpu)
        try:
            client = RolloutClient(RemoteConfig(urls=(url,), rollout_server_timeout=600))
            tokens = client.generate(prompt_ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)).token_ids
            client.close()
            return tokens
        finally:
            server.terminate()
            server.wait(30)


def bench_shape(shape: str, args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from tandemrl.cli import frozen_heap
    from tandemrl.generation.base import RemoteConfig
    from tandemrl.generation.remote import RolloutClient
    from tandemrl.types import SamplingParams
    from tandemrl.weights.base import DistributedSyncConfig
    from tandemrl.weights.distributed import DistributedSync

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    server_device = args.server_device or ("cuda:1" if args.transport == "nccl" and args.server_gpu is None else args.device)
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(model_dir, SHAPES[shape], dtype)
        server, url = start_server(model_dir, server_device, args.backend, args.server_args.split(), gpu=args.server_gpu)
        try:
            trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device)
            num_bytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
            client = RolloutClient(RemoteConfig(urls=(url,), rollout_server_timeout=600))
            config = DistributedSyncConfig(
                weight_sync_port=0, weight_sync_backend=args.transport, weight_sync_bucket_mb=args.bucket_mb, weight_sync_ipc_reuse=not args.no_ipc_reuse
            )
            sync = DistributedSync(config, client)  # what `tandem train --rollout_mode server` publishes through
            send_s: list[float] = []
            times = []
            pauses = FullCollections()
            runner = asyncio.Runner()  # one event loop for every update, as the trainer's (pipeline/loop.py)
            named = list(trainer.named_parameters())  # listed once and held, as the trainer's published_weights does
            with frozen_heap() if not args.gc_as_is else contextlib.nullcontext(), pauses:  # as `tandem train` runs
                for version in range(1, args.num_syncs + 1):
                    with torch.no_grad():
                        trainer.model.norm.weight.add_(1.0)  # a new policy each time
                    torch.cuda.synchronize() if args.device.startswith("cuda") else None
                    pauses.ms.clear()
                    start = time.perf_counter()
                    runner.run(sync.publish(named, version=version))
                    times.append(time.perf_counter() - start)
                    send_s.append(sum(s for phase, s in sync.sender.phases.items() if phase != "live"))
                    assert client.readiness()[0]["policy_version"] == version
                    print(json.dumps({"bench": "sync", "shape": shape, "transport": args.transport, "version": version, "bytes": num_bytes,
                                      "seconds": round(times[-1], 5), "send_s": round(send_s[-1], 5), "GB/s": round(num_bytes / times[-1] / 1e9, 2),
                                      "send_ms": {k: round(v * 1e3, 2) for k, v in sync.sender.phases.items()},
                                      "full_gc_ms": [round(ms, 1) for ms in pauses.ms]}))
            prompt_ids = list(range(100, 116))
            served = client.generate(prompt_ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)).token_ids
            with torch.no_grad():
                local = trainer.generate(torch.tensor([prompt_ids], device=args.device), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, 16:].tolist()
            client.close()
            runner.close()
            server.terminate()
            server.wait(30)
            loaded = greedy_of_loaded(trainer, model_dir, server_device, prompt_ids, args)
        finally:
            server.terminate()
            server.wait(30)
    warm = sorted(times[1:] or times)
    warm_s, send = warm[len(warm) // 2], sorted(send_s[1:] or send_s)[len(send_s[1:] or send_s) // 2]
    bar = BARS_GBPS.get(args.transport)
    summary = {"bench": "sync", "shape": shape, "transport": args.transport, "GB": round(num_bytes / 1e9, 3), "first_s": round(times[0], 4),
               "warm_median_s": round(warm_s, 5), "GB/s": round(num_bytes / warm_s / 1e9, 1), "send_median_s": round(send, 5),
               "bar_GB/s": bar, "vs_bar": round(num_bytes / warm_s / 1e9 / bar, 3) if bar else None,
               "greedy_same_prefix": same_prefix(served, local), "of": len(local),
               "loaded_same_prefix": same_prefix(served, loaded)}
    print(json.dumps(summary))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="0.5b,1.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--device", default="cuda", help="the trainer's device")
    parser.add_argument("--transport", default="ipc", choices=["ipc", "nccl", "gloo", "auto"])
    parser.add_argument("--server_device", default="", help="the server's --device (default: cuda:1 for nccl, else the trainer's)")
    parser.add_argument("--server_gpu", type=int, default=None, help="instead: pin the server to this physical GPU (CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--bucket_mb", type=float, default=256)
    parser.add_argument("--gc_as_is", action="store_true", help="no frozen heap in this process (tandem train and the server run with one)")
    parser.add_argument("--no_ipc_reuse", action="store_true", help="CUDA IPC: every update through the group in full (the path before staged updates)")
    parser.add_argument("--num_syncs", type=int, default=6)
    parser.add_argument("--backend", default="engine")
    parser.add_argument("--server_args", default="--gpu_memory_utilization 0.3")
    args = parser.parse_args()
    summaries = [bench_shape(shape, args) for shape in args.shapes.split(",")]
    for s in summaries:
        print(f"sync {s['transport']} {s['shape']} {s['GB']:.2f} GB: warm median {s['warm_median_s']:.4f} s, {s['GB/s']:.1f} GB/s"
              + (f", {s['vs_bar']:.2f}x the bar of {s['bar_GB/s']:.0f} GB/s" if s["bar_GB/s"] else "")
              + f"; greedy {s['greedy_same_prefix']}/{s['of']} tokens equal the trainer's,"
              + f" {s['loaded_same_prefix']}/{s['of']} a fresh server's loaded with the same weights (must be all)")


if __name__ == "__main__":
    main()
