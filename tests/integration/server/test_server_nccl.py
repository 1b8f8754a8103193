"""Weight sync over NCCL between two GPUs: the trainer (this process, or a child) on the first GPU, a real
`tandem rollout` on the second. The same promises as over gloo: the update lands whole and bumps the
version, and a peer that dies mid-sync is an error on the other side, never a crash or a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from rollout_helpers import GREEDY, local_greedy, start_server, sync, trainer_model

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RolloutClient

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL refuses two ranks on one GPU)"),
]
SECOND_GPU = {"CUDA_VISIBLE_DEVICES": "1"}


def start_gpu_server(model_dir: str):
    return start_server(model_dir, backend="engine", device="cuda", env=SECOND_GPU, timeout_s=300)


def test_nccl_update_makes_server_greedy_equal_trainer_greedy_and_bumps_version(tiny_model_dir, tiny_tokenizer):
    server = start_gpu_server(tiny_model_dir)
    client = RolloutClient(RemoteConfig(urls=(server.url,), rollout_server_timeout=120))
    try:
        model = trainer_model(tiny_model_dir, 11)
        on_gpu = {name: p.detach().to("cuda:0") for name, p in model.named_parameters()}
        for version in (1, 2):  # the second update reuses the group
            client.update_weights(on_gpu.items(), version=version, sync=sync())  # auto: other GPU -> nccl
            assert client.readiness()[0]["policy_version"] == version
        assert "(nccl)" in server.log_text()
        prompt_ids = tiny_tokenizer.encode("hello")
        served = client.generate(prompt_ids, GREEDY)
        assert served.token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)
        assert served.policy_versions == [2] * len(served.token_ids)
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
    named = [(n, p.detach().to("cuda")) for n, p in trainer_model({model!r}, 7).named_parameters()]
    yield from named[: len(named) // 2]
    print("HALF", flush=True)
    time.sleep(600)
    yield from named[len(named) // 2 :]

client = RolloutClient(RemoteConfig(urls=({url!r},)))
client.update_weights(weights(), version=1, sync=sync(backend="nccl"))
"""


def test_kill_trainer_mid_nccl_sync_server_keeps_its_version_and_serves(tiny_model_dir, tiny_tokenizer):
    server = start_gpu_server(tiny_model_dir)
    try:
        prompt_ids = tiny_tokenizer.encode("steady")
        body = {"prompt_ids": prompt_ids, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
        before = server.post("/generate", body).json()["results"][0]["token_ids"]
        script = TRAINER.format(here=os.path.dirname(__file__), model=tiny_model_dir, url=server.url)
        trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
        assert trainer.stdout.readline().strip() == "HALF"
        assert server.get("/ready").json()["update_in_progress"]
        trainer.kill()
        trainer.wait(10)
        deadline = time.monotonic() + 45  # the sync's deadline (weight_sync_timeout_s) is 30 s
        while server.get("/ready").json()["update_in_progress"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.proc.poll() is None, "the server died with its trainer:\n" + server.log_text()[-3000:]
        ready = server.get("/ready").json()
        assert not ready["update_in_progress"] and ready["policy_version"] == 0 and ready["weight_group"] is None
        assert "weight sync to version 1 failed" in server.log_text() and "keeping version 0" in server.log_text()
        after = server.post("/generate", body).json()["results"][0]
        assert after["token_ids"] == before and after["policy_versions"] == [0] * 8
    finally:
        server.stop()


def test_kill_server_mid_nccl_sync_is_an_error_on_the_trainer_within_the_deadline(tiny_model_dir):
    server = start_gpu_server(tiny_model_dir)
    client = RolloutClient(RemoteConfig(urls=(server.url,), rollout_server_timeout=60, request_timeout_s=20))
    halfway, resume = threading.Event(), threading.Event()

    def weights():
        named = [(n, p.detach().to("cuda:0")) for n, p in trainer_model(tiny_model_dir, 6).named_parameters()]
        yield from named[: len(named) // 2]
        halfway.set()
        resume.wait(60)
        yield from named[len(named) // 2 :]

    errors: list[BaseException] = []

    def push() -> None:
        try:
            client.update_weights(weights(), version=1, sync=sync(backend="nccl"))
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            errors.append(error)

    try:
        pusher = threading.Thread(target=push)
        pusher.start()
        assert halfway.wait(120)
        server.kill()
        start = time.monotonic()
        resume.set()
        pusher.join(90)
        assert not pusher.is_alive() and time.monotonic() - start < 45  # this process is alive to check it
        assert isinstance(errors[0], RuntimeError) and "weight sync of version 1 failed" in str(errors[0])
    finally:
        client.close()
        server.stop()
