"""Faults with real processes: kill -9 the server mid-request and mid-sync, restart it, kill the
trainer mid-sync. Nothing hangs; errors are clear; a server keeps its version and keeps serving."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import pytest
from rollout_helpers import GREEDY, local_greedy, start_server, sync, trainer_model

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RolloutClient



def test_kill_server_mid_request_raises_within_timeout_then_restart_reconnects_and_full_sync_restores_version(tiny_model_dir, tiny_tokenizer):
    server = start_server(tiny_model_dir)
    client = RolloutClient(RemoteConfig(urls=(server.url,), rollout_server_timeout=60, request_timeout_s=20, max_retries=3))
    try:
        model = trainer_model(tiny_model_dir, 5)
        client.update_weights(model.named_parameters(), version=7, sync=sync())
        server.post("/sleep", {"level": 1})  # requests now wait at the gate: the kill lands mid-request
        future = client.submit([5, 6, 7], GREEDY)
        time.sleep(0.5)
        start = time.monotonic()
        server.kill()
        with pytest.raises(ConnectionError, match="cannot reach rollout server"):
            future.result(timeout=30)
        assert time.monotonic() - start < 20
        with pytest.raises(RuntimeError, match="weight sync of version 8 failed"):
            client.update_weights(model.named_parameters(), version=8, sync=sync())

        server = start_server(tiny_model_dir, port=urlparse(server.url).port)
        assert client.readiness()[0]["policy_version"] == 0  # a fresh server: base weights
        client.update_weights(model.named_parameters(), version=7, sync=sync())  # re-forms the group
        assert client.readiness()[0]["policy_version"] == 7
        prompt_ids = tiny_tokenizer.encode("hello")
        assert client.generate(prompt_ids, GREEDY).token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)
    finally:
        client.close()
        server.stop()


def test_kill_server_mid_sync_is_a_clear_error_on_the_trainer_within_the_deadline(tiny_model_dir):
    server = start_server(tiny_model_dir)
    client = RolloutClient(RemoteConfig(urls=(server.url,), rollout_server_timeout=60, request_timeout_s=20))
    halfway, resume = threading.Event(), threading.Event()

    def weights():
        named = list(trainer_model(tiny_model_dir, 6).named_parameters())
        yield from named[: len(named) // 2]
        halfway.set()
        resume.wait(30)
        yield from named[len(named) // 2 :]

    try:
        result: list[BaseException] = []
        pusher = threading.Thread(target=lambda: _capture(result, client.update_weights, weights(), version=1, sync=sync()))
        pusher.start()
        assert halfway.wait(60)
        server.kill()
        start = time.monotonic()
        resume.set()
        pusher.join(60)
        assert not pusher.is_alive() and time.monotonic() - start < 30
        assert isinstance(result[0], RuntimeError) and "weight sync of version 1 failed" in str(result[0])
    finally:
        client.close()
        server.stop()


TRAINER = """
import sys, time
sys.path.insert(0, {here!r})
from rollout_helpers import trainer_model, sync
from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RolloutClient

def weights():
    named = list(trainer_model({model!r}, 7).named_parameters())
    yield from named[: len(named) // 2]
    print("HALF", flush=True)
    time.sleep(600)
    yield from named[len(named) // 2 :]

client = RolloutClient(RemoteConfig(urls=({url!r},)))
client.update_weights(weights(), version=1, sync=sync())
"""


def test_kill_trainer_mid_sync_server_logs_it_keeps_its_version_and_serves(tiny_model_dir, tiny_tokenizer):
    server = start_server(tiny_model_dir)
    try:
        prompt_ids = tiny_tokenizer.encode("steady")
        body = {"prompt_ids": prompt_ids, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
        before = server.post("/generate", body).json()["results"][0]["token_ids"]
        script = TRAINER.format(here=os.path.dirname(__file__), model=tiny_model_dir, url=server.url)
        trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert trainer.stdout.readline().strip() == "HALF"
        assert server.get("/ready").json()["update_in_progress"]
        trainer.kill()
        trainer.wait(10)
        deadline = time.monotonic() + 30  # the sync's deadline (weight_sync_timeout_s) is 30 s
        while server.get("/ready").json()["update_in_progress"] and time.monotonic() < deadline:
            time.sleep(0.1)
        ready = server.get("/ready").json()
        assert not ready["update_in_progress"] and ready["policy_version"] == 0 and ready["weight_group"] is None
        assert "weight sync to version 1 failed" in server.log_text() and "keeping version 0" in server.log_text()
        after = server.post("/generate", body).json()["results"][0]
        assert after["token_ids"] == before and after["policy_versions"] == [0] * 8  # staging was dropped
    finally:
        server.stop()


def _capture(out: list, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except BaseException as error:  # noqa: BLE001 - handed to the test thread
        out.append(error)
