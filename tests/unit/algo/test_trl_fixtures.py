"""tandem's loss equals TRL 1.16's on fixed tensors: loss, gradient and metrics, within 1e-6.

The fixtures were computed once by TRL's own `GRPOTrainer._compute_loss` (tests/fixtures/
make_trl_loss_fixtures.py says how); this test needs no trl. Cases: loss type x importance sampling
level x beta (with and without bias-corrected KL) x truncated IS (off, or the level's truncate mode), and
every TRL importance sampling mode (token/sequence x truncate/mask, at either ratio level) with and
without a lower bound (TRL's vllm_importance_sampling_clip_min, our --tis_min).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tandemrl.algo.loss import policy_loss, token_weights
from tandemrl.algo.presets import PRESETS

FIXTURES = json.loads((Path(__file__).parents[2] / "fixtures" / "trl_loss_fixtures.json").read_text())
C = FIXTURES["constants"]


def _case_id(case: dict) -> str:
    kl = f"beta{case['beta']}" + ("" if case["use_bias_correction_kl"] else "-plainkl")
    floor = "" if case["tis_min"] is None else f"-min{case['tis_min']}"
    return f"{case['loss_type']}-{case['level']}-{kl}-tis_{case['tis']}{floor}"


def _packed() -> tuple[SimpleNamespace, torch.Tensor]:
    """The fixture's padded [B, T] tensors as one packed sequence of B * T tokens; padding untrained."""
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in FIXTURES["inputs"].items()}
    num_sequences, length = t["mask"].shape
    batch = SimpleNamespace(
        loss_mask=t["mask"].flatten().bool(),
        old_logprobs=t["old_logprobs"].flatten(),
        behaviour_logprobs=t["sampling_logprobs"].flatten(),
        advantages=t["advantages"].repeat_interleave(length),
        seq_index=torch.arange(num_sequences).repeat_interleave(length),
    )
    return batch, t


@pytest.mark.parametrize("case", FIXTURES["cases"], ids=_case_id)
def test_loss_gradient_and_metrics_equal_trl(case: dict) -> None:
    assert FIXTURES["trl_version"].startswith("1.16")
    batch, t = _packed()
    preset = PRESETS[case["loss_type"]]
    config = dataclasses.replace(
        preset, clip_low=C["epsilon"], clip_high=C["cispo_cap"] if preset.objective == "cispo" else C["epsilon_high"],
        ratio_level=case["level"], kl_bias_correction=case["use_bias_correction_kl"],
        tis_mode=case["tis"] if case["tis"] != "off" else f"{case['level']}_truncate", tis_min=case["tis_min"] or 0.0,
    )  # fmt: skip
    counts = dict(num_sequences=t["mask"].shape[0], num_tokens=int(t["mask"].sum()), max_completion_length=C["max_completion_length"])
    weights = token_weights(batch.seq_index, batch.loss_mask, aggregation=config.aggregation, **counts)
    sequence_means = token_weights(batch.seq_index, batch.loss_mask, aggregation="seq_mean_token_mean", **counts)
    logprobs = t["logprobs"].flatten().clone().requires_grad_(True)
    loss, metrics = policy_loss(
        batch, logprobs, config=config, weights=weights.double(), ref_logprobs=t["ref_logprobs"].flatten(),
        beta=case["beta"], tis_cap=0.0 if case["tis"] == "off" else C["tis_cap"],
        metric_weights=batch.loss_mask.double() / counts["num_tokens"], sequence_metric_weights=sequence_means.double(),
    )  # fmt: skip
    loss.backward()

    assert loss.item() == pytest.approx(case["loss"], abs=1e-6)
    expected_grad = torch.tensor(case["grad"], dtype=torch.float64).flatten()
    torch.testing.assert_close(logprobs.grad, expected_grad, atol=1e-6, rtol=0)
    for name, value in case["metrics"].items():
        assert metrics[name].item() == pytest.approx(value, abs=1e-6), name
