"""The `tandem` command's subcommands, and what they share."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """For the block, every object alive now (model, tokenizer, engine, server) is out of the garbage
    collector's sight: a full collection would rescan them all each time (~400k objects, ~0.2 s)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()  # collectable again once the block ends (in-process callers run more after it)
