"""One engine leaf for `tandem train` and `tandem rollout`: one default each, one max_model_len derivation."""

import pytest

from tandemrl.cli.train import parse
from tandemrl.generation.base import EngineSettings


def test_gpu_memory_utilization_defaults_by_placement_unless_set():
    assert EngineSettings().memory_fraction(colocated=True) == 0.4
    assert EngineSettings().memory_fraction(colocated=False) == 0.9
    assert EngineSettings(gpu_memory_utilization=0.7).memory_fraction(colocated=True) == 0.7


def test_max_model_len_is_the_flag_else_wanted_never_past_the_positions():
    assert EngineSettings().model_len(max_positions=None) == 4096
    assert EngineSettings().model_len(max_positions=512, wanted=640) == 512
    assert EngineSettings(max_model_len=300).model_len(max_positions=512, wanted=640) == 300


def test_both_commands_take_the_engine_flags():
    from tandemrl.cli import rollout

    flags = ["--max_num_seqs", "7", "--block_size", "32", "--enforce_eager", "--kv_cache_tokens", "1024", "--max_model_len", "99"]
    config, _ = parse(flags)
    _, engine = rollout.parse(["--model", "m", *flags])
    for settings in (config.engine, engine):
        assert (settings.max_num_seqs, settings.block_size, settings.enforce_eager) == (7, 32, True)
        assert (settings.kv_cache_tokens, settings.max_model_len) == (1024, 99)


def test_rollout_takes_the_decode_graphs_sampler_and_refuses_a_mistyped_one():
    from tandemrl.cli import rollout

    assert rollout.parse(["--model", "m"])[1].decode_graphs == "auto"  # the engine reads auto as plain
    assert rollout.parse(["--model", "m", "--decode_graphs", "filtered"])[1].decode_graphs == "filtered"
    with pytest.raises(ValueError, match="'filter' is not one of auto, plain, filtered \\(did you mean filtered\\?\\)"):
        rollout.parse(["--model", "m", "--decode_graphs", "filter"])

