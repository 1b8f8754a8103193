"""Faults with real processes: kill -9 the server mid-request and mid-sync, restart it, kill the
trainer mid-sync. Nothing hangs; errors are clear; a server keeps its version and keeps serving."""

from __future__ import annotations

import time
from urllib.parse import urlparse

import pytest
from rollout_helpers import (
    GREEDY,
    kill_server_mid_sync_then_check_trainer,
    kill_trainer_mid_sync_then_check_server,
    local_greedy,
    start_server,
    push,
    sync,
    trainer_model,
)

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RolloutClient


def test_kill_server_mid_request_raises_within_timeout_then_restart_reconnects_and_full_sync_restores_version(tiny_model_dir, tiny_tokenizer):
    server = start_server(tiny_model_dir)
    client = RolloutClient(RemoteConfig(urls=(server.url,), rollout_server_timeout=60, request_timeout_s=20, max_retries=3))
    try:
        model = trainer_model(tiny_model_dir, 5)
        push(client, model.named_parameters(), version=7, config=sync())
        server.post("/sleep", {"level": 1})  # requests now wait at the gate: the kill lands mid-request
        future = client.submit([5, 6, 7], GREEDY)
        time.sleep(0.5)
        start = time.monotonic()
        server.kill()
        with pytest.raises(ConnectionError, match="cannot reach rollout server"):
            future.result(timeout=30)
        assert time.monotonic() - start < 20
        with pytest.raises(RuntimeError, match="weight sync of version 8 failed"):
            push(client, model.named_parameters(), version=8, config=sync())

        server = start_server(tiny_model_dir, port=urlparse(server.url).port)
        assert client.readiness()[0]["policy_version"] == 0  # a fresh server: base weights
        push(client, model.named_parameters(), version=7, config=sync())  # re-forms the group
        assert client.readiness()[0]["policy_version"] == 7
        prompt_ids = tiny_tokenizer.encode("hello")
        assert client.generate(prompt_ids, GREEDY).token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)
    finally:
        client.close()
        server.stop()


def test_kill_server_mid_sync_is_a_clear_error_on_the_trainer_within_the_deadline(tiny_model_dir):
    server = start_server(tiny_model_dir)
    try:
        kill_server_mid_sync_then_check_trainer(server, tiny_model_dir)
    finally:
        server.stop()


def test_kill_trainer_mid_sync_server_logs_it_keeps_its_version_and_serves(tiny_model_dir, tiny_tokenizer):
    server = start_server(tiny_model_dir)
    try:
        kill_trainer_mid_sync_then_check_server(server, tiny_tokenizer, tiny_model_dir)  # deadline: weight_sync_timeout_s, 30 s
    finally:
        server.stop()
