import asyncio
import threading

from tandemrl.generation.tick import Outbox, TickBatcher


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


def test_an_outbox_flush_is_one_wake_up_of_each_loop_and_keeps_the_order():
    outbox, wake_ups = Outbox(), []

    async def main() -> list:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in range(3)]
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: wake_ups.append(a) or real(*a)

        def backend() -> None:  # another thread, as the engine's
            outbox.put(loop, futures[0], "a")
            outbox.put(loop, futures[1], ValueError("bad request"))
            outbox.put(loop, futures[2], "c")
            outbox.flush()
            outbox.flush()  # nothing pending: no wake-up

        threading.Thread(target=backend).start()
        return await asyncio.gather(*futures, return_exceptions=True)

    first, error, last = asyncio.run(main())
    assert (first, last, type(error)) == ("a", "c", ValueError) and len(wake_ups) == 1
