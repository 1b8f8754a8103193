"""Checkpoints: only complete ones count for resume; the oldest are pruned past the limit."""

from __future__ import annotations

import pytest
import torch

from tandemrl.tasks.tiny import build_model, build_tokenizer
from tandemrl.train.checkpoint import latest_checkpoint, load_state, rng_state, save_checkpoint, set_rng_state


def test_resume_ignores_temporary_and_incomplete_checkpoints(tmp_path):
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    save_checkpoint(tmp_path, 2, model=model, tokenizer=tokenizer, state={"x": 1}, limit=0)
    (tmp_path / ".tmp-checkpoint-9").mkdir()  # a crash mid-save
    (tmp_path / "checkpoint-7").mkdir()  # no trainer state: not complete
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert load_state(tmp_path / "checkpoint-2")["step"] == 2


def test_save_total_limit_keeps_the_newest(tmp_path):
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model=model, tokenizer=tokenizer, state={}, limit=2)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


def test_rng_state_round_trip_replays_the_same_draws():
    state = rng_state()
    first = torch.rand(3)
    set_rng_state(state)
    assert torch.equal(torch.rand(3), first)


def test_a_checkpoint_never_holds_non_finite_weights(tmp_path):
    from tandemrl.tasks.tiny import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(ValueError, match="holds inf or NaN"):
        save_checkpoint(tmp_path, 1, model=model, tokenizer=tokenizer, state={}, limit=0)
    assert latest_checkpoint(tmp_path) is None
