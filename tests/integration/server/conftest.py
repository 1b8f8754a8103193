"""Real `tandem rollout` subprocesses on free ports, over the tiny model; one per module unless a
test needs its own (faults). Backends: hf always, engine once `tandemrl.generation.engine` imports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest


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


def start_server(model_dir: str, *extra: str, backend: str = "hf", port: int = 0, timeout_s: float = 120) -> Server:
    args = [sys.executable, "-m", "tandemrl", "rollout", "--model", model_dir, "--backend", backend, "--device", "cpu",
            "--port", str(port), "--max_model_len", "128", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
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


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, backend: str):
    s = start_server(tiny_model_dir, backend=backend)
    yield s
    s.stop()
