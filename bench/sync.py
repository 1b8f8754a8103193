"""Weight-sync time and GB/s into a real `tandem rollout` server, for a Qwen2.5-0.5B-shaped model
(config written here, random weights). On a GPU the default transport is CUDA IPC (trainer and server
on the one GPU); `--server_gpu 1 --transport nccl` puts the server on a second GPU and measures NCCL;
`--device cpu --transport gloo --shape tiny` checks the script anywhere.

Prints one JSON line per sync and a summary line: `sync <transport>: <median s> s, <GB/s> GB/s`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
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
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=320)


def save_model(path: str, shape: dict, dtype: torch.dtype) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tandemrl.tasks.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = AutoConfig.for_model("qwen2", bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, **shape)
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=["0.5b", "tiny"], default="0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--transport", default="auto", help="auto (ipc on one GPU, nccl across two), ipc, gloo, nccl")
    parser.add_argument("--server_gpu", type=int, default=None, help="the server's physical GPU (1: NCCL from the trainer's GPU 0)")
    parser.add_argument("--bucket_mb", type=float, default=256)
    parser.add_argument("--num_syncs", type=int, default=5)
    parser.add_argument("--backend", default="engine")
    parser.add_argument("--server_args", default="--gpu_memory_utilization 0.3")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from tandemrl.generation.base import RemoteConfig
    from tandemrl.generation.remote import RolloutClient
    from tandemrl.types import SamplingParams
    from tandemrl.weights.base import DistributedSyncConfig
    from tandemrl.weights.distributed import DistributedSync

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(model_dir, QWEN25_05B if args.shape == "0.5b" else TINY, dtype)
        server, url = start_server(model_dir, args.device, args.backend, args.server_args.split(), gpu=args.server_gpu)
        try:
            trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device)
            num_bytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
            client = RolloutClient(RemoteConfig(urls=(url,), rollout_server_timeout=600))
            config = DistributedSyncConfig(weight_sync_port=0, weight_sync_backend=args.transport, weight_sync_bucket_mb=args.bucket_mb)
            sync = DistributedSync(config, client)  # what `tandem train --rollout_mode server` publishes through
            times = []
            for version in range(1, args.num_syncs + 1):
                with torch.no_grad():
                    trainer.model.norm.weight.add_(1.0)  # a new policy each time
                torch.cuda.synchronize() if args.device == "cuda" else None
                start = time.perf_counter()
                asyncio.run(sync.publish(trainer.named_parameters(), version=version))
                seconds = time.perf_counter() - start
                times.append(seconds)
                ready = client.readiness()[0]
                assert ready["policy_version"] == version, ready
                print(json.dumps({"bench": "sync", "shape": args.shape, "transport": args.transport, "version": version,
                                  "bytes": num_bytes, "seconds": round(seconds, 4), "GB/s": round(num_bytes / seconds / 1e9, 2)}))
            warm = sorted(times[1:] or times)[len(times[1:] or times) // 2]
            print(f"sync {args.transport} {args.shape} {num_bytes / 1e9:.2f} GB: first {times[0]:.3f} s (forms the group), "
                  f"warm median {warm:.3f} s, {num_bytes / warm / 1e9:.2f} GB/s")
            prompt_ids = list(range(100, 116))
            served = client.generate(prompt_ids, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)).token_ids
            with torch.no_grad():
                local = trainer.generate(torch.tensor([prompt_ids], device=args.device), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, 16:].tolist()
            same = next((i for i, (a, b) in enumerate(zip(served, local)) if a != b), len(local))
            print(json.dumps({"bench": "sync", "check": "server greedy vs trainer greedy after the last sync", "same_prefix_tokens": same, "of": len(local)}))
            client.close()
        finally:
            server.terminate()
            server.wait(30)


if __name__ == "__main__":
    main()
