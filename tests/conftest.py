"""Shared fixtures: a tiny model + tokenizer built in code and saved locally (no hub access)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A qwen2-shaped random-init model and a byte-level BPE tokenizer, saved with save_pretrained."""
    from tandemrl.tasks.tiny import save_tiny

    return save_tiny(str(tmp_path_factory.mktemp("tiny-qwen2")))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
