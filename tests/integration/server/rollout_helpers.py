"""Helpers of the rollout-server tests: real `tandem rollout` subprocesses on free ports, the trainer's
perturbed policy and its local greedy output, a weight-sync config for tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import httpx
import torch

from tandemrl.generation.base import HFConfig, RemoteConfig
from tandemrl.generation.hf import HFGenerator
from tandemrl.generation.remote import RolloutClient
from tandemrl.types import SamplingParams
from tandemrl.weights.base import DistributedSyncConfig
from tandemrl.weights.distributed import DistributedSync

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
    first_line: str = ""  # what it printed on stdout first: "tandem rollout: serving M (generator: G) on URL"

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

    def get(self, path: str, timeout: float = 30, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=timeout, **kw)

    def post(self, path: str, json: dict, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=json, timeout=60, **kw)

    def log_text(self) -> str:
        return "\n".join(self.log)

    def metrics(self) -> dict[str, float]:
        """/metrics scraped and parsed by prometheus_client, as {'name{label="v"}': value}."""
        from prometheus_client.parser import text_string_to_metric_families

        text = self.get("/metrics").text
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
        return {s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items())) + "}" if s.labels else ""): s.value for s in samples}


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
            server.url, server.first_line = match.group(1), lines[0].rstrip()
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


_SYNCS: weakref.WeakKeyDictionary[RolloutClient, dict[str, DistributedSync]] = weakref.WeakKeyDictionary()


def push(client: RolloutClient, weights: Iterable, *, version: int, config: DistributedSyncConfig) -> DistributedSync:
    """Publishes `weights` at `version` to the client's servers, as the trainer does; one DistributedSync
    per client and config, so its group lives across pushes (returned)."""
    syncs = _SYNCS.setdefault(client, {})
    sync = syncs.setdefault(repr(config), DistributedSync(config, client))
    asyncio.run(sync.publish(weights, version=version))
    return sync


TRAINER = """
import sys, time
sys.path.insert(0, {here!r})
from rollout_helpers import push, stall_at_second_bucket, sync, trainer_model
from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RolloutClient

def stall():
    print("HALF", flush=True)
    time.sleep(600)

named = [(n, p.detach().to({device!r})) for n, p in trainer_model({model!r}, 7).named_parameters()]
client = RolloutClient(RemoteConfig(urls=({url!r},)))
with stall_at_second_bucket(stall):
    push(client, named, version={version}, config=sync(backend={backend!r}))
"""


@contextlib.contextmanager
def stall_at_second_bucket(stall: Callable[[], None]) -> Iterator[None]:
    """Calls `stall` in the sender before it packs the second bucket of an update: the metadata and the
    first bucket are out, the server waits inside the payload's collectives (mid-NCCL-sync on GPUs)."""
    from tandemrl.weights import group

    real, calls = group.pack, []

    def pack(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            stall()
        return real(*args, **kwargs)

    group.pack = pack
    try:
        yield
    finally:
        group.pack = real


def kill_trainer_mid_sync_then_check_server(server: Server, tokenizer, model_dir: str, *, device: str = "cpu", backend: str = "auto",
                                            env: dict[str, str] | None = None, deadline_s: float = 10) -> None:
    """A trainer process stalls mid-update (the metadata and one bucket out) and is killed: /health and /ready answer within a
    second all along; well within the sync's deadline (30 s) the server logs it, keeps its version and
    weights (staging dropped), leaves the group and serves; then a new trainer's update goes live."""
    prompt_ids = tokenizer.encode("steady")
    body = {"prompt_ids": prompt_ids, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    version = server.get("/ready").json()["policy_version"]
    before = server.post("/generate", body).json()["results"][0]["token_ids"]
    script = TRAINER.format(here=os.path.dirname(__file__), model=model_dir, url=server.url, device=device, backend=backend, version=version + 1)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    assert trainer.stdout.readline().strip() == "HALF"
    assert server.get("/ready", timeout=1).json()["update_in_progress"]
    trainer.kill()
    trainer.wait(10)
    killed = time.monotonic()
    while server.get("/ready", timeout=1).json()["update_in_progress"] and time.monotonic() < killed + deadline_s:
        server.get("/health", timeout=1)
        time.sleep(0.1)
    assert server.proc.poll() is None, "the server died with its trainer:\n" + server.log_text()[-3000:]
    ready = server.get("/ready", timeout=1).json()
    assert not ready["update_in_progress"] and ready["policy_version"] == version and ready["weight_group"] is None, (ready, server.log_text()[-3000:])
    assert f"weight sync to version {version + 1} failed" in server.log_text() and f"keeping version {version}" in server.log_text()
    after = server.post("/generate", body).json()["results"][0]
    assert after["token_ids"] == before and after["policy_versions"] == [version] * 8
    client = RolloutClient(RemoteConfig(urls=(server.url,)))  # a new trainer: forms a new group, its update goes live
    try:
        named = [(n, p.detach().to(device)) for n, p in trainer_model(model_dir, 7).named_parameters()]
        push(client, named, version=version + 1, config=sync(backend=backend))
        assert client.readiness()[0]["policy_version"] == version + 1
    finally:
        client.close()


def kill_server_mid_sync_then_check_trainer(server: Server, model_dir: str, *, device: str = "cpu", backend: str = "auto", deadline_s: float = 10) -> None:
    """This process stalls mid-update (the metadata and one bucket out) and the server is killed: within the sync's deadline the
    push raises one clear error (and this process is still alive to see it)."""
    client = RolloutClient(RemoteConfig(urls=(server.url,), rollout_server_timeout=60, request_timeout_s=20))
    halfway, resume = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    named = [(n, p.detach().to(device)) for n, p in trainer_model(model_dir, 6).named_parameters()]

    def stall() -> None:
        halfway.set()
        resume.wait(60)

    def push_half() -> None:
        try:
            push(client, named, version=1, config=sync(backend=backend))
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            errors.append(error)

    try:
        with stall_at_second_bucket(stall):
            pusher = threading.Thread(target=push_half)
            pusher.start()
            assert halfway.wait(120)
            server.kill()
            start = time.monotonic()
            resume.set()
            pusher.join(deadline_s + 30)
        assert not pusher.is_alive() and time.monotonic() - start < deadline_s
        assert isinstance(errors[0], RuntimeError) and "weight sync of version 1 to " in str(errors[0]) and " failed: " in str(errors[0])
    finally:
        client.close()
