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
WINDOW = 6  # the families' sliding window: the tests' prompts and completions run past it
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.5, 3.0, 6.0],  # head dim 16, half of it rotary: 4 frequencies
    "long_factor": [1.0, 4.0, 12.0, 32.0],
    "original_max_position_embeddings": 128,
    "rope_theta": 10000.0,
}
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
FAMILIES = {  # each a row of README's table of supported families
    "qwen2": dict(model_type="qwen2"),
    "llama3-untied": dict(model_type="llama", rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False),
    "qwen3": dict(model_type="qwen3", head_dim=32),
    "mistral": dict(model_type="mistral", sliding_window=WINDOW, tie_word_embeddings=False),
    "phi3-longrope": dict(model_type="phi3", sliding_window=WINDOW, partial_rotary_factor=0.5, rope_parameters=LONGROPE, pad_token_id=None),
    "olmo2": dict(model_type="olmo2", tie_word_embeddings=False),
    "smollm3-yarn": dict(
        model_type="smollm3", no_rope_layers=[1, 0], rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0}
    ),
    "gemma2": dict(model_type="gemma2", **GEMMA),
    "gemma3_text": dict(
        model_type="gemma3_text", **GEMMA,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}, "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
    ),  # fmt: skip
    "qwen2-dynamic-window": dict(
        model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    ),
}


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from tandemrl.tasks.tiny import save_tiny

    return {name: save_tiny(str(tmp_path_factory.mktemp(name)), seed=1, **kw) for name, kw in FAMILIES.items()}
