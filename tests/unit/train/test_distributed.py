"""Data parallelism's bookkeeping in one process: who owns and trains which group, a tied weight saved
once. (Two real ranks: tests/integration/test_train_torchrun.py.)"""

from __future__ import annotations

import torch

from tandemrl.train.distributed import SINGLE, DataParallel, full_tensor, untied


def test_groups_are_dealt_round_robin_and_every_group_has_one_owner():
    ranks = [DataParallel(rank=r, world_size=3) for r in range(3)]
    assert [[i for i in range(6) if dp.owns(i)] for dp in ranks] == [[0, 3], [1, 4], [2, 5]]
    assert [dp.share(list("abcdef")) for dp in ranks] == [["a", "d"], ["b", "e"], ["c", "f"]]
    assert all(dp.scores for dp in ranks)


def test_an_engine_split_over_ranks_is_driven_by_its_first_rank():
    ranks = [DataParallel(rank=r, world_size=4, tensor_parallel_size=2) for r in range(4)]
    assert [[i for i in range(6) if dp.owns(i)] for dp in ranks] == [[0, 2, 4], [], [1, 3, 5], []]
    assert [dp.share(list("abcd")) for dp in ranks] == [["a"], ["b"], ["c"], ["d"]]  # every rank trains
    assert [dp.scores for dp in ranks] == [True, False, True, False]  # a judge is built where groups are scored


def test_with_rollout_servers_rank_zero_generates_every_group_and_every_rank_trains():
    ranks = [DataParallel(rank=r, world_size=2, rank_zero_generates=True) for r in range(2)]
    assert [[i for i in range(4) if dp.owns(i)] for dp in ranks] == [[0, 1, 2, 3], []]
    assert [dp.share(list("abcd")) for dp in ranks] == [["a", "c"], ["b", "d"]]
    assert [dp.scores for dp in ranks] == [True, False]


def test_a_colocated_engine_split_over_ranks_refuses_staleness():
    import pytest

    from tandemrl.config import GenerationConfig, TrainConfig
    from tandemrl.generation.base import EngineSettings

    with pytest.raises(ValueError, match="--max_staleness 1 with a colocated engine split over the ranks"):  # the config's rule
        TrainConfig(engine=EngineSettings(tensor_parallel_size=2), generation=GenerationConfig(max_staleness=1))


def test_a_split_colocated_engine_needs_torchrun_ranks(monkeypatch):
    import pytest

    from tandemrl.cli.ranks import start_ranks
    from tandemrl.config import TrainConfig
    from tandemrl.generation.base import EngineSettings

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="launch with torchrun --nproc_per_node a multiple of 2"):
        start_ranks(TrainConfig(engine=EngineSettings(tensor_parallel_size=2)), use_cuda=False)


def test_one_process_is_the_identity():
    groups = ["g0", "g1"]
    assert SINGLE.gather_groups(groups) is groups and SINGLE.share(groups) == groups
    assert SINGLE.sum(5) == 5 and SINGLE.max(5) == 5 and SINGLE.broadcast("x") == "x"
    assert SINGLE.combine_metrics({"loss": 1.0}) == {"loss": 1.0} and all(SINGLE.owns(i) for i in range(4))


def test_a_tied_head_is_saved_under_one_name():
    from tandemrl.tasks.tiny import build_model, build_tokenizer

    model = build_model(build_tokenizer(), seed=0)
    assert model.config.tie_word_embeddings and "lm_head.weight" in model.state_dict()
    assert set(untied(model, model.state_dict())) == set(model.state_dict()) - {"lm_head.weight"}


def test_a_shard_is_gathered_in_the_compute_dtype(tmp_path):
    """A sync under FSDP2 gathers bf16 (half the bytes of the float32 masters): the shard is cast first."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        full = torch.randn(6, 4)
        shard = distribute_tensor(full, init_device_mesh("cpu", (1,)), [Shard(0)])
        whole = full_tensor(shard, torch.bfloat16)
        assert type(whole) is torch.Tensor and whole.dtype == torch.bfloat16 and torch.equal(whole, full.to(torch.bfloat16))
        assert full_tensor(shard).dtype == torch.float32
    finally:
        dist.destroy_process_group()
