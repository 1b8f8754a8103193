"""The Generator over `tandem rollout` servers (RemoteGenerator).

Invariant: the generate calls made in one tick of the caller's event loop reach RolloutClient in one
submit_many, so they leave in one request per server and the servers' engines step them together,
as the in-process engine would.
"""

from __future__ import annotations

import asyncio

from tandemrl.generation.base import RemoteConfig
from tandemrl.generation.remote.client import RolloutClient
from tandemrl.generation.tick import TickBatcher
from tandemrl.types import Completion, SamplingParams


class RemoteGenerator:
    """A Generator whose tokens come from rollout servers. Its weights live on the servers: they
    arrive through weights/distributed.py (DistributedSync over `client`), never through this object."""

    def __init__(self, config: RemoteConfig):
        self.config = config
        self.client = RolloutClient(config)
        self._this_tick: TickBatcher[tuple[list[int], SamplingParams, asyncio.Future]] = TickBatcher(self._hand_over)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        handed = asyncio.get_running_loop().create_future()  # set to the client's future when this tick is handed over
        self._this_tick.add((prompt_ids, params, handed))
        return await asyncio.wrap_future(await handed)

    def _hand_over(self, calls: list[tuple[list[int], SamplingParams, asyncio.Future]]) -> None:
        calls = [c for c in calls if not c[2].cancelled()]
        try:
            futures = self.client.submit_many([(prompt_ids, params) for prompt_ids, params, _ in calls])
        except RuntimeError as error:  # the client's loop is closed
            for _, _, handed in calls:
                handed.set_exception(error)
            return
        for (_, _, handed), future in zip(calls, futures):
            handed.set_result(future)

    @property
    def version(self) -> int:
        """The version the servers last made live (announced through `client`)."""
        return self.client.version

    async def sleep(self, level: int) -> None:
        await asyncio.to_thread(self.client.post_all, "/sleep", {"level": level})

    async def wake(self) -> None:
        await asyncio.to_thread(self.client.post_all, "/wake")

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)
