"""Weight sync by CUDA IPC: the trainer (this process) and a real `tandem rollout` share one GPU, and the
trainer writes each update straight into the server's staging buffer (reused across updates, so later
updates go through buffers mapped by the first). With reuse off every update goes through the group; on
(the default), the second and third are staged: written into the mapped buffer, then announced on the
server's staged-update channel (no HTTP request, no collective). The update lands whole, bumps the version,
and the server's greedy tokens equal the trainer's; bytes written and never announced (a trainer dying
mid-write) change nothing served, and a staged write into the buffer of a server that died since leaves the
trainer's CUDA context working, its announcement failing at once (the channel closed)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
from rollout_helpers import GREEDY, local_greedy, push, start_server, sync, trainer_model

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote import RolloutClient

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_ipc_updates_make_server_greedy_equal_trainer_greedy_and_bump_the_version(tiny_model_dir, tiny_tokenizer):
    server = start_server(tiny_model_dir, "--dtype", "float32", backend="engine", device="cuda", env={"CUDA_VISIBLE_DEVICES": "0"}, timeout_s=180)
    client = RolloutClient(RemoteConfig(urls=(server.url,), rollout_server_timeout=120))
    try:
        prompt_ids = tiny_tokenizer.encode("hello")
        version = 0
        for reuse in (False, True):
            config = dataclasses.replace(sync(), weight_sync_ipc_reuse=reuse)  # auto: one GPU -> ipc
            for seed in (11, 12, 11):  # the third re-sends the first's weights: nothing of the second may remain
                version += 1
                model = trainer_model(tiny_model_dir, seed)
                publisher = push(client, [(n, p.detach().to("cuda:0")) for n, p in model.named_parameters()], version=version, config=config)
                assert client.readiness()[0]["policy_version"] == version
                served = client.generate(prompt_ids, GREEDY)
                assert served.token_ids == local_greedy(model, tiny_tokenizer, prompt_ids)
                assert served.policy_versions == [version] * len(served.token_ids)
            assert ("answer" in publisher.sender.phases) == reuse  # staged: written, then announced on the channel
        _, _, buffers = publisher.sender._staged
        buffers[0].fill_(0xFF)  # NaN everywhere, never announced
        torch.cuda.synchronize()
        served = client.generate(prompt_ids, GREEDY)
        assert served.token_ids == local_greedy(model, tiny_tokenizer, prompt_ids) and served.policy_versions[0] == version
        assert "(ipc)" in server.log_text()
        server.kill()  # a server dead between updates: the next staged write lands in its mapped buffer before anything fails
        assert publisher.sender.write_staged([(n, p.detach().to("cuda:0")) for n, p in model.named_parameters()])
        start = time.monotonic()
        with pytest.raises(ConnectionError):  # the channel's far end closed with its process
            asyncio.run(publisher.sender.announce_staged(version=version + 1, mode="drain"))
        assert time.monotonic() - start < 5
        torch.cuda.synchronize()
        assert torch.ones(4, device="cuda:0").sum().item() == 4  # the trainer's CUDA context survived the write
    finally:
        client.close()
        server.stop()
