"""The `tandem` command's subcommands, and what they share."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


YOUNG_THRESHOLD = 50_000  # inside frozen_heap: container objects the young generation may gain before it is collected (Python: 700)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """For the block, every object alive now (model, tokenizer, engine, server) is out of the garbage
    collector's sight: a full collection would rescan them all each time (~400k objects). And the
    young generation is collected once it holds YOUNG_THRESHOLD more containers, not 700: a turn boundary of
    512 multi-turn rollouts leaves ~30k alive for a while (next-turn requests, their KV blocks' keys), each
    700 of them a collection that stops the event loop and the engine (bench/multiturn.py's timeline shows
    them). Garbage without cycles is freed by reference count either way; cycles wait longer."""
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()  # collectable again once the block ends (in-process callers run more after it)
