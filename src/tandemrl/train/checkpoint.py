"""Checkpoints: an HF-format model + tokenizer (safetensors, loadable by transformers as is) beside the
trainer state (optimizer, scheduler, every RNG, data position, policy version, the run's flags: --resume
checks a new run's against them). With LoRA the model is
the adapter (peft's format; the base is --model), and on request the merged model in merged/.

Invariant: a directory named checkpoint-<step> is complete and its weights are finite. It is written
under a temporary name and renamed at the end, so a crash mid-save leaves only a temporary directory
that resume ignores; a write the disk refuses (full, or past `ulimit -f`) removes it and stops the run in
one line (exit 1), the checkpoints before it untouched. Under torchrun rank 0 writes the whole model (gathered from the FSDP shards) and the
trainer state, and every rank its optimizer shard into optimizer/ (torch.distributed.checkpoint), which
loads on any rank count, one process included.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandemrl.train.distributed import SINGLE, DataParallel, full_state_dict, full_tensor, save_optimizer, untied
from tandemrl.types import RunStopped

log = logging.getLogger(__name__)
PATTERN = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.pt"
OPTIMIZER_DIR = "optimizer"  # the sharded optimizer state of a torchrun run
DISK_FULL_BYTES = 1 << 20  # a write that failed with less free than this failed for want of space


def rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: str | Path, step: int, *, model: Any, tokenizer: Any, state: dict[str, Any], limit: int, save_merged: bool = False,
    dp: DataParallel = SINGLE, optimizer: Any = None,
) -> Path:  # fmt: skip
    """Writes run_dir/checkpoint-<step> atomically and prunes the oldest beyond `limit` (0 = keep all).
    Under torchrun every rank calls it (the model is gathered; `optimizer`'s shards are written)."""
    whole = full_state_dict(model, dp) if dp.enabled else None  # rank 0's; None elsewhere
    weights = (whole or {}).items() if dp.enabled else model.named_parameters()
    bad = next((name for name, p in weights if not torch.isfinite(p).all()), None)
    if bad is not None:  # the trainer never applies a non-finite step; this is the last line of defence
        raise ValueError(f"refusing to save checkpoint-{step}: weight {bad} holds inf or NaN")
    run_dir = Path(run_dir)
    final = run_dir / f"checkpoint-{step}"
    tmp = run_dir / f".tmp-checkpoint-{step}"
    try:
        if dp.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        if dp.enabled:
            dp.barrier()
            save_optimizer(model, optimizer, tmp / OPTIMIZER_DIR)
        if save_merged:  # under torchrun every rank gathers the merged weights; rank 0 writes them
            from tandemrl.train.lora import save_merged as write_merged

            write_merged(model, tmp / "merged" if dp.is_main else None, gather=full_tensor if dp.enabled else None)
        if dp.is_main:
            # a peft model writes its adapter; a sharded one its gathered weights
            model.save_pretrained(tmp, safe_serialization=True, **({"state_dict": untied(model, whole)} if dp.enabled else {}))
            tokenizer.save_pretrained(tmp)
            if save_merged:
                tokenizer.save_pretrained(tmp / "merged")
            torch.save({**state, "rng": rng_state(), "step": step}, tmp / STATE_FILE)
    except Exception as error:
        reason = disk_failure(error, tmp)
        if reason is None:  # not the disk: a bug, raised as is
            raise
        if dp.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # frees what it took; the checkpoints before it are untouched
        raise RunStopped(f"cannot write checkpoint-{step} in {run_dir}: {reason}; make room (disk space, ulimit -f), then {how_to_continue(run_dir, dp.world_size)}") from None
    if dp.is_main:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(run_dir, limit)
    dp.barrier()
    return final


def disk_failure(error: BaseException, directory: Path) -> str | None:
    """Why writing into `directory` failed when the disk is why (it is full, or a file there reached the
    file size limit, `ulimit -f`), else None. safetensors and torch.save's zip writer do not raise OSError:
    the former names the OS error in its text, the latter only "unexpected pos", so the disk and the files
    written are looked at (a limit alone proves nothing: many machines set one).

    Example: SafetensorError("... I/O error: No space left on device (os error 28)") -> "No space left on device"
    """
    code = getattr(error, "errno", None)
    if code is None and (found := re.search(r"os error (\d+)", str(error))):
        code = int(found.group(1))
    if code in (errno.ENOSPC, errno.EDQUOT):
        return os.strerror(code)
    if code == errno.EFBIG:
        return f"{os.strerror(code)} (past the file size limit, ulimit -f)"
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    if shutil.disk_usage(existing).free < DISK_FULL_BYTES:
        return f"{os.strerror(errno.ENOSPC)} ({existing})"
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and any(p.is_file() and p.stat().st_size >= limit for p in directory.rglob("*")):
        return f"a file reached the file size limit of {limit} bytes (ulimit -f)"
    return None


def how_to_continue(run_dir: Path, ranks: int = 1) -> str:
    """The command that continues a stopped run of `ranks` processes (its flags are in its checkpoint), or
    says none is needed. Example (ranks 2): "continue from checkpoint-4 with: torchrun --nproc_per_node 2
    -m tandemrl train --output_dir runs/x --resume"."""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        return f"no checkpoint yet in {run_dir}: run the same command with --output_dir {run_dir} to start it again in place"
    command = f"torchrun --nproc_per_node {ranks} -m tandemrl train" if ranks > 1 else "tandem train"
    return f"continue from {checkpoint.name} with: {command} --output_dir {run_dir} --resume"


def sharded_optimizer(checkpoint: Path) -> Path | None:
    """The checkpoint's sharded optimizer state (written under torchrun), or None."""
    path = checkpoint / OPTIMIZER_DIR
    return path if path.is_dir() else None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in run_dir, or None."""
    found = _complete(run_dir)
    return found[0] if found else None


def _complete(run_dir: str | Path) -> list[Path]:
    """The complete checkpoints of run_dir, newest first."""
    found = [(int(m.group(1)), p) for p in Path(run_dir).glob("checkpoint-*") if (m := PATTERN.match(p.name))]
    return [p for _, p in sorted(found, reverse=True) if (p / STATE_FILE).exists()]


def load_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint (the caller restores RNGs last, after building everything)."""
    return torch.load(checkpoint / STATE_FILE, weights_only=False)


def resumed_flags(run_dir: str | Path) -> dict[str, Any] | None:
    """The flags kept by the checkpoint --resume continues (the newest whose trainer state reads), or None when
    it records none (written before checkpoints kept them) or run_dir has none. Its tensors are mapped, not read."""
    for checkpoint in _complete(run_dir):
        try:
            state = torch.load(checkpoint / STATE_FILE, weights_only=False, mmap=True)
        except Exception:  # noqa: BLE001 (a torn state: resumable_checkpoint passes over it and says so)
            continue
        return state.get("flags")
    return None


def resumable_checkpoint(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint whose trainer state loads, with that state, or None when run_dir has none.

    A newer one whose trainer_state.pt cannot be read (truncated: a disk that filled, a copy cut short; it
    was a traceback, issue 36) is passed over, and one warning line names it and the one resumed from instead;
    when none can be read, a one-line ValueError says what to run."""
    broken: list[str] = []  # "checkpoint-N (why)", newest first
    for checkpoint in _complete(run_dir):
        try:
            state = load_state(checkpoint)
        except Exception as error:  # noqa: BLE001 (torch.load raises RuntimeError, EOFError, UnpicklingError, ... on a bad file)
            reason = " ".join(str(error).split()).split(". ")[0][:120] or type(error).__name__
            broken.append(f"{checkpoint.name} ({reason})")
            continue
        if broken:
            log.warning("the trainer state (%s) of %s cannot be read: resuming from %s, the newest that reads", STATE_FILE, "; ".join(broken), checkpoint.name)
        return checkpoint, state
    if broken:
        names = " and ".join(b.split(" ")[0] for b in broken)
        raise ValueError(
            f"no checkpoint of {run_dir} can be resumed: the trainer state ({STATE_FILE}) of {'; '.join(broken)} cannot be read; "
            f"start afresh with another --output_dir, or move {names} out of {run_dir} and run the same command"
        )
    return None


def _prune(run_dir: Path, limit: int) -> None:
    if limit <= 0:
        return
    found = sorted((int(m.group(1)), p) for p in run_dir.glob("checkpoint-*") if (m := PATTERN.match(p.name)))
    for _, path in found[:-limit]:
        shutil.rmtree(path, ignore_errors=True)
