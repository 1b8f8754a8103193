"""The engine's RoPE tables against transformers' rotary embeddings, for every scaling type: row p of the
table is what transformers rotates a token at position p by when that token is the last of its sequence
(a decoded token), which for the length-dependent types (dynamic, longrope) past the pretraining length
is the documented choice of layers/rope.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tandemrl.generation.engine.layers.rope import apply_rope, rope_table

CASES = {
    "default": ("llama", {}),
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "yarn-mscale": ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16}),
    "dynamic": ("llama", {"rope_type": "dynamic", "factor": 2.0}),
    "longrope-partial": (
        "phi3", {"rope_type": "longrope", "short_factor": [1.0, 1.5, 3.0, 6.0], "long_factor": [1.0, 4.0, 12.0, 32.0], "original_max_position_embeddings": 16}
    ),
}
MAX_POSITIONS = 48  # past every case's pretraining length (16, or max_position_embeddings 24 for dynamic)


def _config(model_type: str, rope: dict):
    extra = {"partial_rotary_factor": 0.5} if model_type == "phi3" else {}
    return AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=32, pad_token_id=None, eos_token_id=None, bos_token_id=None, max_position_embeddings=24, rope_parameters={"rope_theta": 10000.0, **rope}, **extra,
    )  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_each_row_is_what_transformers_rotates_the_last_token_by(case):
    config = _config(*CASES[case])
    rotary = AutoModelForCausalLM.from_config(config).model.rotary_emb
    table = rope_table(config, MAX_POSITIONS)  # [P, 2, R]
    x = torch.zeros(1, dtype=torch.float32)
    for p in range(MAX_POSITIONS):
        cos, sin = rotary(x, torch.arange(p + 1)[None])  # [1, p + 1, R]
        torch.testing.assert_close(table[p, 0], cos[0, -1], atol=2e-6, rtol=1e-5, msg=f"cos at {p}")
        torch.testing.assert_close(table[p, 1], sin[0, -1], atol=2e-6, rtol=1e-5, msg=f"sin at {p}")


def test_a_scaled_table_differs_from_the_plain_one():
    plain = rope_table(_config("llama", {}), MAX_POSITIONS)
    for case in ("linear", "yarn", "dynamic"):
        assert not torch.allclose(rope_table(_config(*CASES[case]), MAX_POSITIONS), plain), case


def test_partial_rotary_leaves_the_tail_of_each_head_as_it_was():
    config = _config(*CASES["longrope-partial"])
    table = rope_table(config, 8)  # [P, 2, 8]: half of a 16-dim head
    x = torch.randn(8, 3, 16)
    cos_sin = table[torch.arange(8)]
    out = apply_rope(x, cos_sin[:, :1], cos_sin[:, 1:])
    assert torch.equal(out[..., 8:], x[..., 8:]) and not torch.allclose(out[1:, :, :8], x[1:, :, :8])
