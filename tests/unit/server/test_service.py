"""The server's admission and update rules, with a scripted generator and an ordered event log:
drain finishes running requests before the update and holds new ones until after; pause updates while
they run; a failed transfer keeps the version and hands nothing to the generator."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import torch

from tandemrl.server.gate import Undrained
from tandemrl.server.service import Busy, RolloutService
from tandemrl.types import Completion, SamplingParams
from tandemrl.weights import channel
from tandemrl.weights.group import NotStaged

PARAMS = SamplingParams(max_tokens=1)


class ScriptedGenerator:
    def __init__(self, log: list[str]):
        self.version, self.log = 0, log
        self.release: dict[str, asyncio.Event] = {}

    async def generate(self, prompt_ids, params):
        name = f"r{prompt_ids[0]}"
        self.release[name] = asyncio.Event()
        self.log.append(f"start {name}")
        await self.release[name].wait()
        self.log.append(f"end {name}")
        return Completion(token_ids=[1], logprobs=[0.0], finish_reason="length", policy_versions=[self.version])

    async def update_weights(self, weights, *, version):
        self.log.append(f"update {[n for n, _ in weights]} -> {version}")
        self.version = version

    async def sleep(self, level): ...
    async def wake(self): ...
    async def close(self): ...


class FakeReceiver:
    group_id = "g"
    timeout_s = 30.0
    phases: dict[str, float] = {}

    def __init__(self, fail: bool = False):
        self.fail = fail

    def receive(self):
        if self.fail:
            raise RuntimeError("Connection closed by peer")
        return [("w", torch.ones(2))]

    def stalled_s(self) -> float:
        return 0.0

    def take_staged(self, layout: str):
        if layout != "abc":
            raise NotStaged(f"no staged update laid out as {layout}")
        return [("w", torch.full((2,), 2.0))]

    def settle(self) -> None:
        self.settled = getattr(self, "settled", 0) + 1

    def close(self) -> None:
        self.group_id = None


class StuckReceiver(FakeReceiver):
    """A receive whose thread never returns, closed or not (an NCCL collective whose peer died), and whose
    group completed nothing for `stalled_for` seconds; the next receive works."""

    def __init__(self, stalled_for: float = 0.0, timeout_s: float = 30.0):
        super().__init__()
        self.stalled_for, self.timeout_s, self.release, self.stuck = stalled_for, timeout_s, threading.Event(), True
        self.start = time.monotonic()

    def receive(self):
        if self.stuck:
            self.stuck, self.start = False, time.monotonic()
            self.release.wait(30)
            return [("half", torch.ones(2))]  # late: must never go live
        return super().receive()

    def stalled_s(self) -> float:
        return self.stalled_for + time.monotonic() - self.start


def make(log, receiver=None, max_pending=100, drain_timeout_s=30.0):
    gen = ScriptedGenerator(log)
    service = RolloutService(
        gen, model_name="m", max_model_len=8, max_pending_requests=max_pending, result_ttl_s=60, drain_timeout_s=drain_timeout_s,
        receiver=receiver or FakeReceiver(), device_uuid=None,
    )  # fmt: skip
    return gen, service


async def until(cond):
    while not cond():
        await asyncio.sleep(0)


def test_drain_waits_for_running_requests_and_holds_new_ones_until_after_the_update():
    async def scenario():
        log: list[str] = []
        gen, service = make(log)
        a = service.start([([1], PARAMS)])[0]
        await until(lambda: "start r1" in log)
        update = asyncio.create_task(service.update_weights(version=1, mode="drain"))
        await until(lambda: service.gate._closers == 1)
        b = service.start([([2], PARAMS)])[0]
        await asyncio.sleep(0.01)
        assert service.gate.num_queued == 1 and "start r2" not in log
        gen.release["r1"].set()
        await update
        await until(lambda: "start r2" in log)
        gen.release["r2"].set()
        assert (await a).policy_versions == [0] and (await b).policy_versions == [1]
        return log

    assert asyncio.run(scenario()) == ["start r1", "end r1", "update ['w'] -> 1", "start r2", "end r2"]


def test_a_drain_past_its_deadline_reopens_the_gate_keeps_the_version_and_says_how_many_still_ran():
    """/sleep and a drain-mode update waited for a request that never ends with no deadline (failed on main:
    no deadline to give); now each gives up after drain_timeout_s, admits what it held, and changes nothing."""

    async def scenario():
        log: list[str] = []
        gen, service = make(log, drain_timeout_s=0.2)
        stuck = service.start([([1], PARAMS)])[0]  # never released: a generation that never ends
        await until(lambda: "start r1" in log)
        for drain in (lambda: service.update_weights(version=1, mode="drain"), lambda: service.sleep(1)):
            started = time.monotonic()
            attempt = asyncio.create_task(drain())
            await until(lambda: service.gate._closers == 1)
            held = service.start([([2], PARAMS)])[0]
            with pytest.raises(Undrained, match=r"1 request\(s\) still running after 0.2 s \(--drain_timeout_s\)"):
                await asyncio.wait_for(attempt, 5)
            assert time.monotonic() - started < 1.0 and service.gate._closers == 0
            await until(lambda: "start r2" in log)  # held at the gate meanwhile, admitted now
            gen.release["r2"].set()
            await held
            log.remove("start r2"), log.remove("end r2")
        assert gen.version == 0 and not service.asleep and service.counters.weight_syncs == {"ok": 0, "failed": 1}
        assert log == ["start r1"]  # nothing reached the generator's update or sleep
        gen.release["r1"].set()
        await stuck
        await service.sleep(1)  # nothing runs now: it sleeps
        assert service.asleep

    asyncio.run(scenario())


def test_a_cancelled_drain_reopens_the_gate():
    async def scenario():
        gen, service = make([])
        stuck = service.start([([1], PARAMS)])[0]
        await until(lambda: "r1" in gen.release)
        closing = asyncio.create_task(service.gate.close(30))  # e.g. a weight update given up mid-drain
        await until(lambda: service.gate._closers == 1)
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        admitted = service.start([([2], PARAMS)])[0]
        await asyncio.wait_for(until(lambda: "r2" in gen.release), 1)  # the gate stayed closed for good (on main)
        for event in gen.release.values():
            event.set()
        await asyncio.gather(stuck, admitted)

    asyncio.run(scenario())


def test_pause_updates_while_requests_run():
    async def scenario():
        log: list[str] = []
        gen, service = make(log)
        a = service.start([([1], PARAMS)])[0]
        await until(lambda: "start r1" in log)
        await service.update_weights(version=1, mode="pause")
        gen.release["r1"].set()
        await a
        return log

    assert asyncio.run(scenario()) == ["start r1", "update ['w'] -> 1", "end r1"]


def test_failed_transfer_keeps_the_version_and_hands_nothing_over():
    async def scenario():
        log: list[str] = []
        gen, service = make(log, FakeReceiver(fail=True))
        with pytest.raises(RuntimeError, match="closed by peer"):
            await service.update_weights(version=1, mode="drain")
        assert gen.version == 0 and not service.update_in_progress and service.counters.weight_syncs["failed"] == 1
        a = service.start([([3], PARAMS)])[0]
        await until(lambda: "start r3" in log)
        gen.release["r3"].set()
        assert (await a).policy_versions == [0]
        return log

    assert asyncio.run(scenario()) == ["start r3", "end r3"]


def test_a_staged_update_goes_live_without_a_receive_and_an_unknown_layout_changes_nothing():
    async def scenario():
        receiver = FakeReceiver(fail=True)  # a receive would fail: the staged update must not run one
        gen, service = make([], receiver)
        with pytest.raises(NotStaged):
            await service.update_weights(version=1, mode="drain", staged="other")
        assert gen.version == 0 and not service.update_in_progress and service.counters.weight_syncs == {"ok": 0, "failed": 0}
        assert await service.update_weights(version=1, mode="drain", staged="abc") == (1, 8, pytest.approx(0, abs=1))
        assert gen.version == 1 and receiver.settled == 1  # the buffer was read out before the answer

    asyncio.run(scenario())


def test_the_staged_update_channel_answers_each_announcement_and_a_trainer_gone_changes_nothing():
    """CUDA IPC's channel (a real socket pair): an announcement goes live through update_weights and is
    answered on the channel; an unknown layout or another group is refused (not staged) with the version
    kept; the trainer closing its end (it died before announcing) ends the serving and changes nothing."""

    async def scenario():
        receiver = FakeReceiver(fail=True)
        gen, service = make([], receiver)
        trainer, server = socket.socketpair()
        serving = asyncio.create_task(service.serve_staged_updates("g", server))
        reader, writer = await asyncio.open_connection(sock=trainer)

        async def announce(group_version: int, layout: str) -> dict:
            writer.write(channel.encode({"version": group_version, "mode": "drain", "layout": layout}))
            return json.loads(await reader.readline())

        assert await announce(1, "abc") == {"policy_version": 1, "num_tensors": 1, "num_bytes": 8, "seconds": pytest.approx(0, abs=1)}
        refused = await announce(2, "other")
        assert refused["not_staged"] and gen.version == 1 and receiver.settled == 1
        receiver.group_id = "h"  # the server joined another group since
        assert (await announce(2, "abc"))["not_staged"] and gen.version == 1
        writer.close()
        await asyncio.wait_for(serving, 5)
        assert gen.version == 1 and service.counters.weight_syncs == {"ok": 1, "failed": 0}

    asyncio.run(scenario())


def test_a_receive_stuck_in_a_collective_is_given_up_when_the_trainer_hangs_up_and_the_version_stays():
    async def scenario():
        log: list[str] = []
        receiver = StuckReceiver()
        gen, service = make(log, receiver)
        hung_up = asyncio.Event()
        update = asyncio.create_task(service.update_weights(version=1, mode="drain", hangup=hung_up.wait()))
        await asyncio.sleep(0.2)
        assert service.update_in_progress
        start = time.monotonic()
        hung_up.set()  # the trainer's process died: its HTTP request is gone, its NCCL op never completes
        with pytest.raises(ConnectionError, match="hung up"):
            await asyncio.wait_for(update, 5)
        assert time.monotonic() - start < 1
        assert gen.version == 0 and not service.update_in_progress and receiver.group_id is None
        assert service.counters.weight_syncs["failed"] == 1
        receiver.release.set()  # the stuck thread returns at last: its tensors are dropped
        await asyncio.sleep(0.1)
        receiver.group_id = "g2"  # a new trainer's group; its update goes live
        await asyncio.wait_for(service.update_weights(version=1, mode="drain"), 5)
        return log

    assert asyncio.run(scenario()) == ["update ['w'] -> 1"]


def test_a_receive_that_makes_no_progress_past_the_groups_timeout_is_given_up(monkeypatch):
    import tandemrl.weights.inbox as inbox

    monkeypatch.setattr(inbox, "RECEIVE_SLACK_S", 0.0)

    async def scenario():
        receiver = StuckReceiver(timeout_s=0.3)  # a stalled trainer: alive, connected, sending nothing
        gen, service = make([], receiver)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="no progress"):
            await asyncio.wait_for(service.update_weights(version=1, mode="drain"), 5)
        assert 0.3 <= time.monotonic() - start < 1.5
        assert gen.version == 0 and not service.update_in_progress and receiver.group_id is None
        receiver.release.set()

    asyncio.run(scenario())


def test_full_queue_is_busy_not_unbounded_and_slots_are_taken_as_the_check_passes():
    async def scenario():
        gen, service = make([], max_pending=3)
        tasks = service.start([([1], PARAMS), ([2], PARAMS)])
        with pytest.raises(Busy, match="2 more do not fit"):  # in the same tick: none of the two has run yet
            service.start([([3], PARAMS), ([4], PARAMS)])
        await until(lambda: len(gen.release) == 2)
        assert sorted(gen.release) == ["r1", "r2"]  # nothing of the refused request started
        for event in gen.release.values():
            event.set()
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_async_results_are_collected_once_and_aborts_finish_with_abort():
    async def scenario():
        gen, service = make([])
        done_id, abort_id = service.submit([1], PARAMS, 1) + service.submit([2], PARAMS, 1)
        await until(lambda: len(gen.release) == 2)
        gen.release["r1"].set()
        service.abort([abort_id])
        results, pending = await service.collect([done_id, abort_id], timeout_s=5)
        assert pending == [] and [r.finish_reason for r in results] == ["length", "abort"]
        assert service.known([done_id, abort_id]) == [done_id, abort_id]  # collected: forgotten

    asyncio.run(scenario())


def test_an_abort_that_comes_after_the_request_finished_returns_it_and_its_result_stands():
    async def scenario():
        log: list[str] = []
        gen, service = make(log)
        done_id, running_id = service.submit([1], PARAMS, 1) + service.submit([2], PARAMS, 1)
        await until(lambda: len(gen.release) == 2)
        gen.release["r1"].set()
        await until(lambda: "end r1" in log)
        assert service.abort([done_id, running_id]) == [done_id]
        results, _ = await service.collect([done_id, running_id], timeout_s=5)
        assert [r.finish_reason for r in results] == ["length", "abort"]

    asyncio.run(scenario())


def test_a_batch_starts_whole_or_not_at_all():
    async def scenario():
        gen, service = make([], max_pending=3)
        with pytest.raises(Busy):
            service.start_batch([(f"id{i}", [i], PARAMS) for i in range(4)])
        assert service.gate.num_running == 0 and service.known(["id0"]) == ["id0"]  # nothing started
        tasks = service.start_batch([(f"id{i}", [i], PARAMS) for i in range(3)])
        await until(lambda: len(gen.release) == 3)
        for event in gen.release.values():
            event.set()
        await asyncio.gather(*tasks.values())
        service.forget(tasks)
        assert service.known(list(tasks)) == list(tasks)

    asyncio.run(scenario())


def test_a_retried_batch_item_supersedes_its_earlier_run():
    async def scenario():
        log: list[str] = []
        gen, service = make(log)
        first = service.start_batch([("same", [1], PARAMS)])
        await until(lambda: "start r1" in log)
        retried = service.start_batch([("same", [2], PARAMS)])
        await until(lambda: "start r2" in log)
        assert first["same"].cancelled() or first["same"].cancelling()
        service.forget(first)  # the earlier batch ends: it must not drop the retried run's id
        assert service.known(["same"]) == []
        gen.release["r2"].set()
        await retried["same"]
        assert log == ["start r1", "start r2", "end r2"]  # r1 never ran to its end

    asyncio.run(scenario())
