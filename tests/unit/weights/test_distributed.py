"""Buckets round-trip every dtype and shape; a sender and a receiver (threads, one gloo group) move a
whole update; a sender that dies mid-update makes the receiver raise with nothing handed over."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from tandemrl.weights.base import DistributedSyncConfig
from tandemrl.weights.buckets import pack_buckets, unpack_bucket
from tandemrl.weights.group import WeightReceiver, WeightSender


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("b.bias", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c.scale", torch.tensor(2.5, dtype=torch.float16)),
        ("d.big", torch.randn(300, generator=g)),
        ("e.ids", torch.arange(5, dtype=torch.int64)),
        ("f.flag", torch.tensor([True, False])),
        ("g.strided", torch.randn(4, 6, generator=g).t()),
    ]


@pytest.mark.parametrize("bucket_bytes", [1, 256, 1 << 20])
def test_buckets_round_trip_every_dtype_shape_and_layout(bucket_bytes):
    original = named_tensors()
    buckets = list(pack_buckets(original, bucket_bytes))
    assert len(buckets) == {1: len(original), 256: 3, 1 << 20: 1}[bucket_bytes]  # 256: [a b c] [d] [e f g]
    for meta, flat in buckets:
        assert flat.dtype == torch.uint8 and flat.numel() <= max(bucket_bytes, max(t.numel() * t.element_size() for _, t in original))
        assert all(m["offset"] % 64 == 0 for m in meta)
    got = [item for meta, flat in buckets for item in unpack_bucket(meta, flat)]
    assert [n for n, _ in got] == [n for n, _ in original]
    for (_, want), (_, have) in zip(original, got):
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want)


def _pair(timeout_s: float = 10.0):
    config = DistributedSyncConfig(weight_sync_port=0, weight_sync_timeout_s=timeout_s, weight_sync_bucket_mb=0.0005)
    sender, receiver = WeightSender(config), WeightReceiver(torch.device("cpu"))
    (spec,) = sender.plan(num_servers=1, transport="gloo", master_addr="127.0.0.1")
    joiner = threading.Thread(target=receiver.join, args=(spec,))
    joiner.start()
    sender.connect(torch.device("cpu"))
    joiner.join()
    assert receiver.group_id == sender.group_id
    return sender, receiver


def test_sender_to_receiver_over_gloo_moves_every_tensor_by_name():
    sender, receiver = _pair()
    out: list = []
    thread = threading.Thread(target=lambda: out.append(receiver.receive()))
    thread.start()
    num_tensors, num_bytes = sender.send(named_tensors())
    thread.join(30)
    assert num_tensors == 7 and num_bytes >= sum(t.numel() * t.element_size() for _, t in named_tensors())
    assert [n for n, _ in out[0]] == [n for n, _ in named_tensors()]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(out[0], named_tensors()))


def test_receiver_raises_and_hands_over_nothing_when_the_sender_stops_mid_update():
    sender, receiver = _pair(timeout_s=2.0)
    out: list = []

    def receive() -> None:
        try:
            out.append(receiver.receive())
        except RuntimeError as error:
            out.append(error)

    thread = threading.Thread(target=receive)
    thread.start()
    group = sender._group  # send some buckets, never the end mark: the receiver's next collective passes its deadline
    for meta, flat in pack_buckets(named_tensors()[:3], 64):
        data = json.dumps({"tensors": meta}).encode()
        group.broadcast(torch.tensor([len(data), flat.numel()], dtype=torch.int64))
        group.send_bytes(data)
        group.broadcast(flat)
    thread.join(30)
    assert not thread.is_alive() and isinstance(out[0], RuntimeError)
    assert receiver.group_id is None  # the broken group is dropped; the trainer re-forms it


@pytest.mark.parametrize("preset", [None, "3"])
def test_nccl_groups_are_built_to_survive_a_dead_peer_and_the_process_settings_are_restored(monkeypatch, preset):
    from tandemrl.weights.group import NCCL_GROUP_ENV, nccl_errors_raise

    for name in NCCL_GROUP_ENV:
        if preset is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, preset)
    with nccl_errors_raise():
        assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: raise in the waiter, keep the process
        assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"  # the heartbeat monitor would std::abort later
        assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert all(os.environ.get(name) == preset for name in NCCL_GROUP_ENV)


def test_a_failed_nccl_collective_aborts_its_communicator_then_raises():
    from tandemrl.weights.group import _Group

    class StuckPG:
        aborted = False

        def broadcast(self, tensors, options):
            raise RuntimeError("Watchdog caught collective operation timeout")

        def abort(self):
            StuckPG.aborted = True

    group = object.__new__(_Group)
    group.transport, group.timeout, group.pg = "nccl", None, StuckPG()
    with pytest.raises(RuntimeError, match="timeout"):
        group.broadcast(torch.zeros(2))
    assert StuckPG.aborted
