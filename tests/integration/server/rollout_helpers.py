"""Helpers of the rollout-server tests: real `tandem rollout` subprocesses on free ports, the trainer's
perturbed policy and its local greedy output, a weight-sync config for tests."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import torch

from tandemrl.generation.base import HFConfig
from tandemrl.generation.hf import HFGenerator
from tandemrl.types import SamplingParams
from tandemrl.weights.base import DistributedSyncConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine_importable() -> bool:
    try:
        from tandemrl.generation.engine import Engine  # noqa: F401
    except ImportError:
        return False
    return True


BACKENDS = ["hf", *(["engine"] if _engine_importable() else [])]


@dataclass
class Server:
    """A `tandem rollout` subprocess; `log` collects its stderr lines."""

    proc: subprocess.Popen
    url: str
    args: list[str]
    log: list[str] = field(default_factory=list)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, json: dict, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=json, timeout=60, **kw)

    def log_text(self) -> str:
        return "\n".join(self.log)


def start_server(
    model_dir: str, *extra: str, backend: str = "hf", port: int = 0, timeout_s: float = 120, device: str = "cpu", env: dict[str, str] | None = None
) -> Server:
    args = [sys.executable, "-m", "tandemrl", "rollout", "--model", model_dir, "--backend", backend, "--device", device,
            "--port", str(port), "--max_model_len", "128", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    env.pop("TANDEM_API_KEY", None)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    server = Server(proc=proc, url="", args=args)
    threading.Thread(target=lambda: server.log.extend(line.rstrip() for line in proc.stderr), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []

    def read_stdout() -> None:
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read_stdout, daemon=True).start()
    while time.monotonic() < deadline:
        match = next((re.search(r"on (http://\S+)", line) for line in lines if "serving" in line), None)
        if match:
            server.url = match.group(1)
            return server
        if proc.poll() is not None:
            time.sleep(0.2)
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_text()[-3000:]}")
        time.sleep(0.1)
    server.kill()
    raise TimeoutError(f"server did not start within {timeout_s} s:\n{server.log_text()[-3000:]}")


def trainer_model(model_dir: str, seed: int):
    """The trainer's policy after some steps: the served model with seeded noise added."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def local_greedy(model, tokenizer, prompt_ids: list[int]) -> list[int]:
    gen = HFGenerator(HFConfig(device="cpu"), model=model, tokenizer=tokenizer)
    return asyncio.run(gen.generate(prompt_ids, GREEDY)).token_ids


def sync(mode: str = "drain", backend: str = "auto") -> DistributedSyncConfig:
    return DistributedSyncConfig(weight_sync_port=0, weight_sync_timeout_s=30, weight_sync_bucket_mb=0.1, update_mode=mode, weight_sync_backend=backend)
