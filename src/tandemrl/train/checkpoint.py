"""Checkpoints: an HF-format model + tokenizer (safetensors, loadable by transformers as is) beside the
trainer state (optimizer, scheduler, every RNG, data position, policy version). With LoRA the model is
the adapter (peft's format; the base is --model), and on request the merged model in merged/.

Invariant: a directory named checkpoint-<step> is complete and its weights are finite. It is written
under a temporary name and renamed at the end, so a crash mid-save leaves only a temporary directory
that resume ignores. Under torchrun rank 0 writes the whole model (gathered from the FSDP shards) and the
trainer state, and every rank its optimizer shard into optimizer/ (torch.distributed.checkpoint), which
loads on any rank count, one process included.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandemrl.train.distributed import SINGLE, DataParallel, full_state_dict, full_tensor, save_optimizer, untied

PATTERN = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "trainer_state.pt"
OPTIMIZER_DIR = "optimizer"  # the sharded optimizer state of a torchrun run


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
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(run_dir, limit)
    dp.barrier()
    return final


def sharded_optimizer(checkpoint: Path) -> Path | None:
    """The checkpoint's sharded optimizer state (written under torchrun), or None."""
    path = checkpoint / OPTIMIZER_DIR
    return path if path.is_dir() else None


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in run_dir, or None."""
    found = [(int(m.group(1)), p) for p in Path(run_dir).glob("checkpoint-*") if (m := PATTERN.match(p.name))]
    found = [(step, p) for step, p in found if (p / STATE_FILE).exists()]
    return max(found)[1] if found else None


def load_state(checkpoint: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint (the caller restores RNGs last, after building everything)."""
    return torch.load(checkpoint / STATE_FILE, weights_only=False)


def _prune(run_dir: Path, limit: int) -> None:
    if limit <= 0:
        return
    found = sorted((int(m.group(1)), p) for p in run_dir.glob("checkpoint-*") if (m := PATTERN.match(p.name)))
    for _, path in found[:-limit]:
        shutil.rmtree(path, ignore_errors=True)
