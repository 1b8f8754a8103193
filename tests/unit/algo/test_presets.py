import dataclasses
import logging

import pytest

from tandemrl.algo.presets import BNPO, CISPO, DAPO, DR_GRPO, GRPO, GSPO, AlgoConfig, LossConfig, loss_config
from tandemrl.cli.args import field_docs


def test_each_loss_type_picks_its_paper_preset():
    for name, preset in [("grpo", GRPO), ("dapo", DAPO), ("dr_grpo", DR_GRPO), ("gspo", GSPO), ("bnpo", BNPO), ("cispo", CISPO)]:
        config = loss_config(AlgoConfig(loss_type=name, use_bias_correction_kl=False))
        assert config == preset, name
    assert (DAPO.clip_high, DAPO.aggregation) == (0.28, "token_mean")
    assert (GSPO.clip_low, GSPO.clip_high, GSPO.ratio_level) == (3e-4, 4e-4, "sequence")


def test_epsilon_keeps_symmetric_presets_symmetric_as_trl():
    config = loss_config(AlgoConfig(loss_type="grpo", epsilon=0.1))
    assert (config.clip_low, config.clip_high) == (0.1, 0.1)


def test_epsilon_leaves_asymmetric_preset_upper_clip_alone():
    config = loss_config(AlgoConfig(loss_type="dapo", epsilon=0.1))
    assert (config.clip_low, config.clip_high) == (0.1, 0.28)


def test_epsilon_high_overrides_upper_clip_only():
    config = loss_config(AlgoConfig(loss_type="grpo", epsilon_high=0.3))
    assert (config.clip_low, config.clip_high, config.aggregation) == (0.2, 0.3, "seq_mean_token_mean")


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        ({"loss_type": "ppo"}, "--loss_type must be one of"),
        ({"scale_rewards": "std"}, "--scale_rewards must be"),
        ({"epsilon": 1.5}, "--epsilon must be in"),
        ({"epsilon_high": -0.1}, "--epsilon_high must be"),
        ({"beta": -1.0}, "--beta must be a finite number >= 0"),
        ({"num_iterations": 0}, "--num_iterations must be >= 1"),
        ({"tis_cap": 0.5}, "--tis_cap must be 0 (off) or >= 1"),
        ({"max_completion_length": 0}, "--max_completion_length must be >= 1"),
    ],
)
def test_bad_algo_config_raises_with_the_flag_to_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        AlgoConfig(**kwargs)


def test_loss_config_rejects_inverted_clip_range():
    with pytest.raises(ValueError, match="clip_low"):
        LossConfig(clip_low=1.0, clip_high=0.2, aggregation="token_mean")


def test_every_algo_flag_has_help_text():
    docs = field_docs(AlgoConfig)
    assert set(docs) == set(AlgoConfig.__dataclass_fields__)
    assert "KL coefficient" in docs["beta"]


def test_algo_flags_parse_into_a_config():
    import argparse

    from tandemrl.cli.args import add_config_args, build_config

    parser = argparse.ArgumentParser()
    add_config_args(parser, AlgoConfig)
    values = vars(parser.parse_args(["--loss_type", "dapo", "--epsilon_high", "0.3", "--beta", "0.04"]))
    config = build_config(AlgoConfig, values)
    assert (config.loss_type, config.epsilon_high, config.beta, config.epsilon) == ("dapo", 0.3, 0.04, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--loss_type", "ppo"])  # choices come from the Literal


def test_tis_mode_defaults_to_the_presets_and_can_be_chosen():
    from tandemrl.algo.presets import AlgoConfig, loss_config

    assert loss_config(AlgoConfig()).tis_mode == "token_truncate"
    assert loss_config(AlgoConfig(loss_type="gspo")).tis_mode == "sequence_truncate"
    chosen = loss_config(AlgoConfig(tis_mode="sequence_mask", tis_min=0.5))
    assert (chosen.tis_mode, chosen.tis_min) == ("sequence_mask", 0.5)


@pytest.mark.parametrize(
    "values, message",
    [({"tis_mode": "token"}, "--tis_mode must be one of"), ({"tis_mode": "token_mask", "tis_min": 2.0}, "--tis_min must be in")],
)
def test_bad_tis_settings_name_the_flag(values, message):
    from tandemrl.algo.presets import AlgoConfig

    with pytest.raises(ValueError, match=message):
        AlgoConfig(**values)


def test_bias_corrected_kl_is_on_by_default_as_trl():
    assert AlgoConfig().use_bias_correction_kl and loss_config(AlgoConfig()).kl_bias_correction
    assert "TRL's default" in field_docs(AlgoConfig)["use_bias_correction_kl"]


def test_importance_sampling_level_overrides_the_preset():
    assert loss_config(AlgoConfig(loss_type="dapo", importance_sampling_level="sequence")).ratio_level == "sequence"
    assert loss_config(AlgoConfig(loss_type="gspo", importance_sampling_level="token")).ratio_level == "token"


def test_zero_variance_groups_are_dropped_only_by_the_dapo_preset_unless_set():
    assert [AlgoConfig(loss_type=t).dynamic_sampling for t in ("grpo", "dr_grpo", "gspo", "bnpo", "cispo")] == [False] * 5
    assert AlgoConfig(loss_type="dapo").dynamic_sampling
    assert not AlgoConfig(loss_type="dapo", drop_zero_variance_groups=False).dynamic_sampling
    assert AlgoConfig(loss_type="grpo", drop_zero_variance_groups=True).dynamic_sampling


@pytest.mark.parametrize(
    "kwargs, warned",
    [
        ({"loss_type": "dapo", "epsilon": 0.1}, "keeps the preset's upper clip 0.28"),
        ({"loss_type": "gspo", "epsilon_high": 5e-4}, "keeps the preset's lower clip 0.0003"),
        ({"loss_type": "grpo", "epsilon": 0.1}, None),  # symmetric: the upper clip follows, nothing kept
        ({"loss_type": "dapo", "epsilon": 0.1, "epsilon_high": 0.3}, None),
    ],
)
def test_one_clip_bound_overridden_with_the_other_the_presets_warns(kwargs, warned, caplog):
    with caplog.at_level(logging.WARNING, logger="tandemrl.algo.presets"):
        loss_config(AlgoConfig(**kwargs))
    assert (warned in caplog.text) if warned else not caplog.text


def test_delta_must_exceed_the_upper_clip():
    with pytest.raises(ValueError, match="--delta must be > 1 \\+ epsilon_high"):
        dataclasses.replace(GRPO, delta=1.1)
