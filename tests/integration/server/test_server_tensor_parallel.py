"""`tandem rollout --tensor_parallel_size 2` on CPU (gloo): one command starts rank 1 itself; greedy output
equals the unsplit model's, a gloo weight update (received by rank 0, broadcast to rank 1) equals the
trainer's greedy, and a dead rank stops the server with one clear line."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from rollout_helpers import GREEDY, local_greedy, push, start_server, sync, trainer_model
from transformers import AutoModelForCausalLM

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RolloutClient


@pytest.fixture(scope="module")
def tp_server(tiny_model_dir):
    s = start_server(tiny_model_dir, "--tensor_parallel_size", "2", backend="engine")
    yield s
    s.stop()


def test_a_split_server_answers_as_the_whole_model_and_takes_weight_updates(tp_server, tiny_model_dir, tiny_tokenizer):
    client = RolloutClient(RemoteConfig(urls=(tp_server.url,), rollout_server_timeout=60, request_timeout_s=60))
    try:
        prompt_ids = tiny_tokenizer.encode("the answer is")
        served = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        assert client.generate(prompt_ids, GREEDY).token_ids == local_greedy(served, tiny_tokenizer, prompt_ids)
        model = trainer_model(tiny_model_dir, 4)
        push(client, model.named_parameters(), version=1, config=sync())
        completion = client.generate(prompt_ids, GREEDY)
        assert completion.token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)
        assert completion.policy_versions == [1] * len(completion.token_ids)
    finally:
        client.close()


def test_a_dead_rank_stops_the_server_with_one_clear_line(tp_server):
    pid = int(re.search(r"tandem-tp-rank1 started \(pid (\d+)\)", tp_server.log_text()).group(1))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while tp_server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tp_server.proc.returncode == 1
    time.sleep(0.2)  # the last stderr lines
    assert "tandem rollout: tensor-parallel rank 1 exited (code -9); stopping the server" in tp_server.log_text()
