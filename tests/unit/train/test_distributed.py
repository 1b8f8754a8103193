"""Data parallelism's bookkeeping in one process: who owns and trains which group, a tied weight saved
once. (Two real ranks: tests/integration/test_train_torchrun.py.)"""

from __future__ import annotations

from tandemrl.train.distributed import SINGLE, DataParallel, untied


def test_groups_are_dealt_round_robin_and_every_group_has_one_owner():
    ranks = [DataParallel(rank=r, world_size=3) for r in range(3)]
    assert [[i for i in range(6) if dp.owns(i)] for dp in ranks] == [[0, 3], [1, 4], [2, 5]]
    assert [dp.share(list("abcdef")) for dp in ranks] == [["a", "d"], ["b", "e"], ["c", "f"]]


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
