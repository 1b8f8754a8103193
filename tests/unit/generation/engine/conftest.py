"""Tiny random-init models of each family the engine serves, saved with save_pretrained (no hub)."""

from __future__ import annotations

import pytest

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
FAMILIES = {
    "qwen2": dict(model_type="qwen2"),
    "llama3-untied": dict(model_type="llama", rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", head_dim=32),
}


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from tandemrl.tasks.tiny import save_tiny

    return {name: save_tiny(str(tmp_path_factory.mktemp(name)), seed=1, **kw) for name, kw in FAMILIES.items()}
