"""Security of a real server: with an API key every route (docs, admin and weight routes included)
answers 401 without it; a non-loopback bind without a key is refused before anything loads."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from rollout_helpers import GREEDY, start_server

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RolloutClient, ServerError

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir):
    s = start_server(tiny_model_dir, "--api_key", KEY)
    yield s
    s.stop()


def test_every_route_answers_401_without_the_key(keyed_server):
    auth = {"Authorization": f"Bearer {KEY}"}
    spec = httpx.get(keyed_server.url + "/openapi.json", headers=auth, timeout=10).json()
    routes = [(method.upper(), path) for path, item in spec["paths"].items() for method in item]
    routes += [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"), ("GET", "/no-such-route")]
    assert ("POST", "/weights/update") in routes and ("POST", "/sleep") in routes and len(routes) >= 16
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            answer = httpx.request(method, keyed_server.url + path, headers=headers, json={}, timeout=10)
            assert answer.status_code == 401, (method, path, headers, answer.status_code)
    assert httpx.get(keyed_server.url + "/ready", headers=auth, timeout=10).status_code == 200


def test_client_with_the_key_works_and_without_it_fails_clearly(keyed_server):
    good = RolloutClient(RemoteConfig(urls=(keyed_server.url,), api_key=KEY))
    assert len(good.generate([1, 2, 3], GREEDY).token_ids) == 8
    good.close()
    bad = RolloutClient(RemoteConfig(urls=(keyed_server.url,), rollout_server_timeout=5))
    with pytest.raises(ServerError, match="401.*API key"):
        bad.generate([1, 2, 3], GREEDY)
    bad.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_non_loopback_bind_without_a_key_is_refused(host):
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
    run = subprocess.run(
        [sys.executable, "-m", "tandemrl", "rollout", "--model", "unused", "--host", host, "--port", "0"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1 and "refusing to bind" in run.stderr and "--insecure" in run.stderr


def test_tandem_train_passes_its_api_key_to_the_servers_and_never_saves_it(keyed_server, tiny_model_dir, tmp_path):
    args = [
        sys.executable, "-m", "tandemrl", "train", "--model", tiny_model_dir, "--rollout_mode", "server", "--rollout_server_urls",
        keyed_server.url, "--api_key", KEY, "--weight_sync_port", "0", "--output_dir", str(tmp_path), "--max_steps", "1",
        "--num_prompts_per_step", "2", "--num_generations", "2", "--max_completion_length", "4", "--max_prompt_length", "64",
    ]
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
    result = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**env, "TOKENIZERS_PARALLELISM": "false"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert not any(KEY in p.read_text(errors="ignore") for p in tmp_path.rglob("*") if p.is_file() and p.suffix in (".yaml", ".jsonl", ".json"))
