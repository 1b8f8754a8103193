"""Weight sync over gloo into a real server: greedy output equals the trainer's local greedy, versions
go up by one, drain keeps in-flight requests on the old version, pause switches them mid-request."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time

import pytest
from rollout_helpers import GREEDY, local_greedy, push, sync, trainer_model

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RolloutClient

LONG = {"prompt": "go", "n": 4, "is_async": True, "max_tokens": 110, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def client(server):
    c = RolloutClient(RemoteConfig(urls=(server.url,), rollout_server_timeout=60, request_timeout_s=60))
    yield c
    c.close()


def test_gloo_update_makes_server_greedy_equal_trainer_greedy_and_bumps_version(server, client, tiny_model_dir, tiny_tokenizer):
    prompt_ids = tiny_tokenizer.encode("the answer is")
    for seed in (1, 2):  # the second update reuses the group
        version = client.readiness()[0]["policy_version"]
        model = trainer_model(tiny_model_dir, seed)
        push(client, model.named_parameters(), version=version + 1, config=sync())
        assert client.readiness()[0]["policy_version"] == version + 1
        completion = client.generate(prompt_ids, GREEDY)
        assert completion.token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)
        assert completion.policy_versions == [version + 1] * len(completion.token_ids)
    assert server.metrics()['tandem_weight_syncs_total{result="ok"}'] == 2


def test_ipc_updates_laid_out_alike_are_staged_and_bytes_never_announced_change_nothing(server, client, tiny_model_dir, tiny_tokenizer):
    """CUDA IPC's protocol on CPU (the server's staging buffer a shared file): the first update goes through
    the group; the next ones are written into the server's buffer, then announced on its channel. Bytes
    written and never announced (a trainer dying mid-write) leave the served version as it was; a staged
    update the server cannot take (another trainer's group came in between) goes in full."""
    prompt_ids = tiny_tokenizer.encode("the answer is")
    config = sync(backend="ipc")
    for seed in (4, 5, 4):  # the third re-sends the first's weights: nothing of the second may remain
        version = client.readiness()[0]["policy_version"]
        model = trainer_model(tiny_model_dir, seed)
        publisher = push(client, model.named_parameters(), version=version + 1, config=config)
        assert client.readiness()[0]["policy_version"] == version + 1
        assert client.generate(prompt_ids, GREEDY).token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)
    assert "answer" in publisher.sender.phases  # staged: written, then announced on the channel
    _, _, buffers = publisher.sender._staged
    buffers[0].fill_(0xFF)  # NaN everywhere, never announced
    completion = client.generate(prompt_ids, GREEDY)
    assert completion.token_ids == local_greedy(model, tiny_tokenizer, prompt_ids) and completion.policy_versions[0] == version + 1
    model = trainer_model(tiny_model_dir, 6)
    push(client, model.named_parameters(), version=version + 2, config=config)
    assert client.generate(prompt_ids, GREEDY).token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)
    push(client, model.named_parameters(), version=version + 3, config=sync())  # another trainer's group (gloo) in between
    model = trainer_model(tiny_model_dir, 7)
    push(client, model.named_parameters(), version=version + 4, config=config)  # staged into a buffer the server dropped: refused, sent in full
    assert client.readiness()[0]["policy_version"] == version + 4
    assert client.generate(prompt_ids, GREEDY).token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)
    assert "live" not in publisher.sender.phases and publisher.sender.staged_layout is not None


@pytest.mark.parametrize("transport", ["gloo", "ipc"])
def test_a_push_holding_nan_is_refused_naming_the_tensor_and_the_server_keeps_its_weights(server, client, tiny_model_dir, tiny_tokenizer, transport):
    """It went live and every request was a 200 with null logprobs. Now a 422 naming the tensor, the version
    and weights before it kept, and the next good push goes live; over ipc both the staged update and the
    full one it falls back to are refused."""
    prompt_ids = tiny_tokenizer.encode("the answer is")
    config = sync(backend=transport)
    version = client.readiness()[0]["policy_version"] + 1
    model = trainer_model(tiny_model_dir, 21)
    push(client, model.named_parameters(), version=version, config=config)  # over ipc: the next one laid out alike is staged
    bad = [(name, p.detach().clone()) for name, p in trainer_model(tiny_model_dir, 22).named_parameters()]
    name = bad[5][0]
    bad[5][1].view(-1)[7] = float("nan")
    with pytest.raises(RuntimeError, match=rf"answered 422: weight update to version {version + 1} refused: tensor {name} holds inf or NaN; kept version {version}"):
        push(client, bad, version=version + 1, config=config)
    assert client.readiness()[0]["policy_version"] == version
    completion = client.generate(prompt_ids, GREEDY)
    assert completion.token_ids == local_greedy(model, tiny_tokenizer, prompt_ids) and all(math.isfinite(lp) for lp in completion.logprobs)
    assert server.log_text().count(f"weight update to version {version + 1} refused (tensor {name} holds inf or NaN)") == (2 if transport == "ipc" else 1)
    model = trainer_model(tiny_model_dir, 23)
    push(client, model.named_parameters(), version=version + 1, config=config)
    assert client.generate(prompt_ids, GREEDY).token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)


def test_a_push_of_a_wrong_shape_is_a_422_naming_both_shapes_before_any_tensor_is_copied(server, client, tiny_model_dir, tiny_tokenizer):
    """It was a 504 (copy_'s error), and the tensors before it in the update were already copied. The bad
    tensor comes last here: the server keeps every weight and its version, and serves."""
    prompt_ids = tiny_tokenizer.encode("the answer is")
    version = client.readiness()[0]["policy_version"]
    before = client.generate(prompt_ids, GREEDY).token_ids
    bad = [(name, p.detach()) for name, p in trainer_model(tiny_model_dir, 24).named_parameters()]
    name, last = bad[-1]
    bad[-1] = (name, last[..., :-1])
    shapes = f"tensor {name} has shape {list(bad[-1][1].shape)}; this model's is {list(last.shape)}"
    with pytest.raises(RuntimeError, match=re.escape(f"answered 422: weight update to version {version + 1} refused: {shapes}; kept version {version}")):
        push(client, bad, version=version + 1, config=sync())
    assert client.readiness()[0]["policy_version"] == version
    assert client.generate(prompt_ids, GREEDY).token_ids == before


STAGED_THEN_DIE = """
import sys, time
sys.path.insert(0, {here!r})
from rollout_helpers import push, sync, trainer_model
from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RolloutClient

client = RolloutClient(RemoteConfig(urls=({url!r},)))
publisher = push(client, trainer_model({model!r}, 8).named_parameters(), version={version}, config=sync(backend="ipc"))
assert publisher.sender.write_staged(list(trainer_model({model!r}, 9).named_parameters()))
print("WRITTEN", flush=True)
time.sleep(600)
"""


def test_a_trainer_killed_between_writing_a_staged_update_and_announcing_it_changes_nothing(server, client, tiny_model_dir, tiny_tokenizer):
    """CUDA IPC's protocol on CPU: a trainer process writes the next update into the server's buffer and
    dies before announcing it on the channel; the server keeps serving the version before, and the next
    trainer's update goes live."""
    prompt_ids = tiny_tokenizer.encode("the answer is")
    version = client.readiness()[0]["policy_version"]
    script = STAGED_THEN_DIE.format(here=os.path.dirname(__file__), model=tiny_model_dir, url=server.url, version=version + 1)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert trainer.stdout.readline().strip() == "WRITTEN"
    finally:
        trainer.kill()
        trainer.wait(10)
    time.sleep(0.5)  # the server sees its channel close
    assert client.readiness()[0]["policy_version"] == version + 1
    assert client.generate(prompt_ids, GREEDY).token_ids == local_greedy(trainer_model(tiny_model_dir, 8), tiny_tokenizer, prompt_ids)
    model = trainer_model(tiny_model_dir, 9)
    push(client, model.named_parameters(), version=version + 2, config=sync(backend="ipc"))
    assert client.generate(prompt_ids, GREEDY).token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)


def test_drain_update_waits_for_in_flight_requests_which_keep_the_old_version(server, client, tiny_model_dir):
    version = client.readiness()[0]["policy_version"]
    ids = server.post("/generate", LONG).json()["request_ids"]
    push(client, trainer_model(tiny_model_dir, 3).named_parameters(), version=version + 1, config=sync("drain"))
    results = server.post("/collect", {"request_ids": ids, "timeout_s": 0}).json()
    assert results["pending"] == []  # drain: the update went live only after they finished
    for r in results["results"]:
        assert r["policy_versions"] == [version] * 110


def test_pause_update_switches_running_requests_between_steps(server, client, tiny_model_dir, backend):
    if backend != "engine":
        pytest.skip("pause mode freezes requests between decode steps: only the engine has steps (hf finishes a batch first)")
    for attempt in range(3):
        version = client.readiness()[0]["policy_version"]
        ids = server.post("/generate", LONG).json()["request_ids"]
        while server.get("/ready").json()["num_running"] == 0:
            time.sleep(0.01)
        push(client, trainer_model(tiny_model_dir, 10 + attempt).named_parameters(), version=version + 1, config=sync("pause"))
        results = server.post("/collect", {"request_ids": ids, "timeout_s": 60}).json()["results"]
        versions = [r["policy_versions"] for r in results]
        for v in versions:
            assert len(v) == 110 and set(v) <= {version, version + 1} and v == sorted(v)  # old, then new: never back
        if any(v[0] == version and v[-1] == version + 1 for v in versions):
            return
    pytest.fail(f"no request straddled the update in 3 tries: {[sorted(set(v)) for v in versions]}")
