import asyncio

from tandemrl.generation.tick import TickBatcher


def test_one_tick_is_one_hand_over_and_a_discarded_item_never_leaves():
    handed: list[list[str]] = []

    async def main() -> None:
        batcher = TickBatcher(handed.append)
        batcher.add("a")
        batcher.add("b")
        batcher.add("c")
        assert batcher.discard("b") and not batcher.discard("z")
        await asyncio.sleep(0)
        batcher.add("d")  # the next tick
        await asyncio.sleep(0)
        assert not batcher.discard("d")  # already handed over

    asyncio.run(main())
    assert handed == [["a", "c"], ["d"]]
