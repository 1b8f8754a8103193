"""Load: 32 concurrent clients for 30 s against one real server (blocking, async + collect, and
OpenAI requests): zero errors, and the server's memory stays bounded (no per-request leak)."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from rollout_helpers import BACKENDS, start_server

NUM_CLIENTS, DURATION_S = 32, 30.0


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


async def _client(url: str, seed: int, deadline: float, errors: list[str]) -> int:
    rng = random.Random(seed)
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while time.monotonic() < deadline:
            kind = rng.choice(["blocking", "async", "openai"])
            prompt = "".join(rng.choice("abcdef xyz") for _ in range(rng.randint(1, 20)))
            sampling = {"max_tokens": rng.randint(1, 12), "temperature": rng.choice([0, 0.7, 1.0])}
            if kind == "blocking":
                r = await http.post("/generate", json={"prompt": prompt, "n": rng.randint(1, 3), **sampling})
            elif kind == "async":
                ids = (await http.post("/generate", json={"prompt": prompt, "is_async": True, **sampling})).json()["request_ids"]
                r = await http.post("/collect", json={"request_ids": ids, "timeout_s": 60})
                if r.status_code == 200 and r.json()["pending"]:
                    errors.append(f"still pending after 60 s: {ids}")
            else:
                r = await http.post("/v1/completions", json={"prompt": prompt, **sampling})
            if r.status_code != 200:
                errors.append(f"{kind}: {r.status_code} {r.text[:200]}")
            done += 1
    return done


@pytest.mark.slow
def test_32_clients_for_30_s_zero_errors_and_bounded_memory(tiny_model_dir):
    server = start_server(tiny_model_dir, backend=BACKENDS[-1])
    try:
        errors: list[str] = []
        samples: list[float] = []

        async def run() -> list[int]:
            deadline = time.monotonic() + DURATION_S

            async def sample_memory() -> None:
                while time.monotonic() < deadline:
                    samples.append(_rss_mb(server.proc.pid))
                    await asyncio.sleep(1.0)

            sampler = asyncio.create_task(sample_memory())
            counts = await asyncio.gather(*(_client(server.url, i, deadline, errors) for i in range(NUM_CLIENTS)))
            await sampler
            return counts

        counts = asyncio.run(run())
        assert errors == [], errors[:5]
        assert min(counts) > 0 and sum(counts) >= 100, counts
        warm, last = max(samples[5:10]), max(samples[-5:])
        assert last - warm < 150, f"server RSS grew from {warm:.0f} MB to {last:.0f} MB under steady load"
        metrics = server.metrics()
        assert metrics["tandem_async_results_held"] == 0 and metrics["tandem_requests_running"] == 0
        print(f"{sum(counts)} requests in {DURATION_S:.0f} s from {NUM_CLIENTS} clients; RSS {warm:.0f} -> {last:.0f} MB")
    finally:
        server.stop()
