import pytest

from tandemrl.algo.presets import DAPO, DR_GRPO, GRPO, GSPO, AlgoConfig, LossConfig, loss_config
from tandemrl.cli.args import field_docs


def test_each_loss_type_picks_its_paper_preset():
    assert loss_config(AlgoConfig(loss_type="grpo")) == GRPO
    assert loss_config(AlgoConfig(loss_type="dapo")) == DAPO
    assert loss_config(AlgoConfig(loss_type="dr_grpo")) == DR_GRPO
    assert loss_config(AlgoConfig(loss_type="gspo")) == GSPO
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
        ({"beta": -1.0}, "--beta must be >= 0"),
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
