"""Two real servers behind one RolloutClient: requests spread by least in-flight, and the client is
a Generator (RemoteGenerator) whose completions carry the server's versions."""

from __future__ import annotations

import asyncio

import pytest
from rollout_helpers import GREEDY, start_server

from tandemrl.generation.base import Generator, RemoteConfig

from tandemrl.generation.factory import build_generator


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir):
    servers = [start_server(tiny_model_dir) for _ in range(2)]
    yield servers
    for s in servers:
        s.stop()


def _num_requests(server) -> int:
    return int(sum(v for k, v in server.metrics().items() if k.startswith("tandem_requests_total{")))


def test_remote_generator_balances_two_servers(two_servers, tiny_tokenizer):
    generator = build_generator(RemoteConfig(urls=tuple(s.url for s in two_servers), rollout_server_timeout=60))
    assert isinstance(generator, Generator)
    prompt_ids = tiny_tokenizer.encode("balance")

    async def many():
        return await asyncio.gather(*(generator.generate(prompt_ids, GREEDY) for _ in range(16)))

    completions = asyncio.run(many())
    assert len({tuple(c.token_ids) for c in completions}) == 1  # same weights everywhere: greedy agrees
    assert all(c.policy_versions == [0] * 8 for c in completions)
    counts = [_num_requests(s) for s in two_servers]
    assert sum(counts) == 16 and min(counts) >= 4, counts
    asyncio.run(generator.close())


def test_blocking_and_future_api(two_servers, tiny_tokenizer):
    from tandemrl.generation.remote import RolloutClient

    client = RolloutClient(RemoteConfig(urls=tuple(s.url for s in two_servers)))
    futures = [client.submit(tiny_tokenizer.encode(t), GREEDY) for t in ("a", "b", "c")]
    assert [f.result(timeout=60).token_ids for f in futures] == [client.generate(tiny_tokenizer.encode(t), GREEDY).token_ids for t in "abc"]
    client.close()


def test_not_ready_is_one_clear_error_after_the_timeout():
    from tandemrl.generation.remote import RolloutClient

    client = RolloutClient(RemoteConfig(urls=("http://127.0.0.1:9",), rollout_server_timeout=1.0))
    with pytest.raises(TimeoutError, match="not ready after 1 s"):
        client.generate([1, 2], GREEDY)
    client.close()
