"""Liveness: a server that answers nothing is noticed within silence_s of its last answer; a live
server's long call is never cut."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest

from tandemrl.generation.remote.liveness import Liveness, SilentServer


def silent_server() -> tuple[str, socket.socket]:
    """A peer that accepts every connection (as a SIGSTOPped server's kernel does) and never says a word."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: [accepted.append(listener.accept()[0]) for _ in iter(int, 1)], daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", listener


def test_a_call_to_a_silent_server_fails_within_the_silence_deadline():
    url, listener = silent_server()

    async def main() -> float:
        async with httpx.AsyncClient() as http:
            liveness = Liveness(http, silence_s=0.5)
            started = time.monotonic()
            with pytest.raises(SilentServer, match=f"{url} answered nothing for 0.5 s"):
                await liveness.watch(url, http.post(url + "/generate_batch", json={}, timeout=600))
            return time.monotonic() - started

    assert 0.5 <= asyncio.run(main()) < 1.5
    listener.close()


def test_a_live_servers_long_call_is_not_cut_and_its_probes_stop_with_it():
    probes = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            probes.append(time.monotonic())
            return httpx.Response(200, json={"status": "ok"})
        await asyncio.sleep(1.0)  # four times the silence deadline: the work runs, /health answers
        return httpx.Response(200, json={"done": True})

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            liveness = Liveness(http, silence_s=0.25)
            answer = await liveness.watch("http://live", http.post("http://live/generate_batch"))
            assert answer.json() == {"done": True}
            num_probes = len(probes)
            await asyncio.sleep(0.3)
            assert len(probes) == num_probes and not liveness._probes  # nothing watched: no probing

    asyncio.run(main())
    assert len(probes) >= 3


def test_a_probe_stops_with_its_last_watch_even_as_its_answer_arrives():
    """The watch ends as the probe's /health answer arrives (work as quick as the probe, started a tick or two
    before it): the probe is cancelled and ends. On main (Python 3.11) asyncio.wait_for swallowed that cancel and
    the probe went on probing every second for the client's life, a task destroyed pending at its close."""

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "ok"})

    async def main() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            liveness, left_running = Liveness(http, silence_s=10.0), []
            for ticks in range(4):

                async def work() -> httpx.Response:
                    for _ in range(ticks):
                        await asyncio.sleep(0)
                    return await http.get("http://live/x")

                await liveness.watch("http://live", work())
                probes = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Liveness._probe"]
                await asyncio.sleep(0.05)
                left_running += [ticks for t in probes if not t.done()]
                for probe in probes:
                    probe.cancel()
            return left_running

    assert asyncio.run(main()) == []
