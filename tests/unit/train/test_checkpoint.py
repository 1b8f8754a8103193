"""Checkpoints: only complete ones count for resume; the oldest are pruned past the limit."""

from __future__ import annotations

import re

import pytest
import torch

from tandemrl.tasks.tiny import build_model, build_tokenizer
from tandemrl.train.checkpoint import disk_failure, latest_checkpoint, load_state, resumable_checkpoint, rng_state, save_checkpoint, set_rng_state


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


def test_resume_passes_over_a_truncated_trainer_state_to_the_intact_checkpoint_before(tmp_path, caplog):
    """A trainer_state.pt cut short (a full disk, a copy cut short) was a traceback on --resume (issue 36)."""
    tokenizer = build_tokenizer()
    model = build_model(tokenizer)
    assert resumable_checkpoint(tmp_path) is None
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model=model, tokenizer=tokenizer, state={"x": step}, limit=0)
    for step in (2, 3):
        state = tmp_path / f"checkpoint-{step}" / "trainer_state.pt"
        state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    checkpoint, state = resumable_checkpoint(tmp_path)
    assert checkpoint == tmp_path / "checkpoint-1" and state["x"] == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(r"the trainer state \(trainer_state.pt\) of checkpoint-3 \(.+\); checkpoint-2 \(.+\) cannot be read: "
                        r"resuming from checkpoint-1, the newest that reads", line), line
    state = tmp_path / "checkpoint-1" / "trainer_state.pt"
    state.write_bytes(b"")
    with pytest.raises(ValueError, match="^no checkpoint of .* can be resumed: .* cannot be read; start afresh with another --output_dir, "
                       "or move checkpoint-3 and checkpoint-2 and checkpoint-1 out of"):
        resumable_checkpoint(tmp_path)


def test_a_write_the_disk_refused_is_told_from_other_failures(tmp_path):
    """safetensors names the OS error in its text only; OSError carries it; anything else (a bug) is no disk failure."""
    from safetensors import SafetensorError

    assert disk_failure(SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"), tmp_path) == "No space left on device"
    assert disk_failure(OSError(27, "File too large"), tmp_path) == "File too large (past the file size limit, ulimit -f)"
    assert disk_failure(TypeError("cannot pickle 'generator' object"), tmp_path) is None  # this machine: no limit, disk not full
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # torch.save's writer says only "unexpected pos"
    try:
        (tmp_path / "small").write_bytes(b"x" * 100)
        assert disk_failure(RuntimeError("unexpected pos 704 vs 598"), tmp_path) is None  # a limit alone is no proof
        (tmp_path / "full").write_bytes(b"x" * 4096)
        assert disk_failure(RuntimeError("unexpected pos 704 vs 598"), tmp_path) == "a file reached the file size limit of 4096 bytes (ulimit -f)"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
