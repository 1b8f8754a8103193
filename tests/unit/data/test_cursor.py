"""PromptCursor: shuffled epochs that are reproducible and resume exactly."""

from __future__ import annotations

import pytest

from tandemrl.data.cursor import PromptCursor


def test_each_epoch_is_a_permutation_reshuffled_per_epoch() -> None:
    cursor = PromptCursor(10, seed=3)
    first, second = cursor.take(10), cursor.take(10)
    assert sorted(first) == sorted(second) == list(range(10))
    assert first != second
    assert (cursor.epoch, cursor.position, cursor.num_taken) == (1, 10, 20)


def test_same_seed_same_order_other_seed_other_order() -> None:
    assert PromptCursor(50, seed=1).take(120) == PromptCursor(50, seed=1).take(120)
    assert PromptCursor(50, seed=1).take(50) != PromptCursor(50, seed=2).take(50)


def test_takes_cross_epoch_boundaries_like_one_long_take() -> None:
    cursor = PromptCursor(7, seed=0)
    pieces = [i for k in (3, 5, 1, 9, 4) for i in cursor.take(k)]
    assert pieces == PromptCursor(7, seed=0).take(22)


def test_state_round_trip_resumes_exactly() -> None:
    cursor = PromptCursor(9, seed=5)
    cursor.take(13)
    state = cursor.state_dict()
    assert state == {"epoch": 1, "position": 4, "seed": 5, "shuffle": True, "num_examples": 9}
    resumed = PromptCursor(9, seed=0)
    resumed.load_state_dict(state)
    assert resumed.take(20) == cursor.take(20)


def test_unshuffled_epochs_are_the_datasets_order_and_resume_exactly() -> None:
    """TRL's shuffle_dataset false: every epoch in the dataset's order; the order is the checkpoint's on resume
    (a cursor built shuffled goes on unshuffled, and a checkpoint from before the key was kept goes on shuffled)."""
    cursor = PromptCursor(4, seed=3, shuffle=False)
    assert cursor.take(6) == [0, 1, 2, 3, 0, 1]
    state = cursor.state_dict()
    resumed = PromptCursor(4, seed=0)
    resumed.load_state_dict(state)
    assert resumed.take(5) == cursor.take(5) == [2, 3, 0, 1, 2]
    old = {k: v for k, v in PromptCursor(4, seed=3).state_dict().items() if k != "shuffle"}
    unshuffled = PromptCursor(4, shuffle=False)
    unshuffled.load_state_dict(old)
    assert unshuffled.take(8) == PromptCursor(4, seed=3).take(8)


def test_seek_replays_from_a_count_of_taken_indices() -> None:
    cursor = PromptCursor(6, seed=2)
    cursor.take(8)
    assert cursor.num_taken == 8
    later = cursor.take(5)
    cursor.seek(8)
    assert cursor.take(5) == later


def test_errors_for_empty_dataset_and_mismatched_state() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        PromptCursor(0)
    state = PromptCursor(4).state_dict()
    with pytest.raises(ValueError, match="over 4 examples, this dataset has 5"):
        PromptCursor(5).load_state_dict(state)
