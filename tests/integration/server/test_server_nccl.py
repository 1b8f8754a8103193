"""Weight sync over NCCL between two GPUs: the trainer (this process, or a child) on the first GPU, one real
`tandem rollout` on the second, shared by the tests in order (the last one kills it). The same promises as
over gloo: the update lands whole and bumps the version; a peer that dies mid-sync is an error on the
other side within seconds (the gloo end mark sees its socket close), never a crash or a hang; the
server answers /ready within a second all along and takes a new trainer afterwards."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import (
    GREEDY,
    kill_server_mid_sync_then_check_trainer,
    kill_trainer_mid_sync_then_check_server,
    local_greedy,
    push,
    start_server,
    sync,
    trainer_model,
)

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RolloutClient

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (NCCL refuses two ranks on one GPU)"),
]


@pytest.fixture(scope="module")
def gpu_server(tiny_model_dir):
    # float32: the greedy reference is float32, and a bfloat16 server's greedy may part from it
    server = start_server(tiny_model_dir, "--dtype", "float32", backend="engine", device="cuda", env={"CUDA_VISIBLE_DEVICES": "1"}, timeout_s=180)
    yield server
    server.stop()


def test_nccl_update_makes_server_greedy_equal_trainer_greedy_and_bumps_version(gpu_server, tiny_model_dir, tiny_tokenizer):
    client = RolloutClient(RemoteConfig(urls=(gpu_server.url,), rollout_server_timeout=120))
    try:
        model = trainer_model(tiny_model_dir, 11)
        on_gpu = {name: p.detach().to("cuda:0") for name, p in model.named_parameters()}
        for version in (1, 2):  # the second update reuses the group
            push(client, on_gpu.items(), version=version, config=sync())  # auto: other GPU -> nccl
            assert client.readiness()[0]["policy_version"] == version
        assert "(nccl)" in gpu_server.log_text()
        prompt_ids = tiny_tokenizer.encode("hello")
        served = client.generate(prompt_ids, GREEDY)
        assert served.token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)
        assert served.policy_versions == [2] * len(served.token_ids)
    finally:
        client.close()


def test_kill_trainer_mid_nccl_sync_server_keeps_its_version_answers_ready_and_takes_a_new_trainer(gpu_server, tiny_model_dir, tiny_tokenizer):
    kill_trainer_mid_sync_then_check_server(
        gpu_server, tiny_tokenizer, tiny_model_dir, device="cuda", backend="nccl", env={"CUDA_VISIBLE_DEVICES": "0"}, deadline_s=10
    )


def test_kill_server_mid_nccl_sync_is_an_error_on_the_trainer_within_the_deadline(gpu_server, tiny_model_dir):
    kill_server_mid_sync_then_check_trainer(gpu_server, tiny_model_dir, device="cuda:0", backend="nccl", deadline_s=10)
