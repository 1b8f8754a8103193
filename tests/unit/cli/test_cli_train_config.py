"""Config resolution of `tandem train`: defaults < task recipe < --config yaml < flags."""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

import pytest

from tandemrl.cli.args import field_docs, load_yaml
from tandemrl.cli.train import parse
from tandemrl.config import LEAVES


def test_no_arguments_is_the_synthetic_task_with_its_recipe():
    config, _ = parse([])
    assert config.run.task == "synthetic" and config.run.model == "tandem:tiny"
    assert config.trainer.learning_rate == 1e-3 and config.algo.max_completion_length == 8


def test_yaml_overrides_recipe_and_flags_override_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 0.5\nnum_generations: 4\nreward_funcs: [length]\n")
    config, _ = parse(["--config", str(path), "--num_generations", "6"])
    assert config.trainer.learning_rate == 0.5 and config.data.num_generations == 6
    assert config.reward.reward_funcs == ("length",)


def test_unknown_yaml_setting_is_an_error(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rat: 0.5\n")
    with pytest.raises(ValueError, match="unknown setting.*learning_rat"):
        parse(["--config", str(path)])


def test_bad_value_is_a_one_line_error_naming_the_flag():
    with pytest.raises(ValueError, match="--num_generations must be >= 2"):
        parse(["--num_generations", "1"])


def test_every_flag_has_help_and_flag_names_are_unique():
    names = [f for leaf in LEAVES for f in leaf.__dataclass_fields__]
    assert len(names) == len(set(names))
    for leaf in LEAVES:
        docs = field_docs(leaf)
        assert all(docs.get(name) for name in leaf.__dataclass_fields__), leaf.__name__


def test_a_field_added_later_gets_its_flag_group_and_help_without_edits():
    from tandemrl.cli.args import ArgumentParser, add_config_args

    @dataclasses.dataclass(kw_only=True)
    class NewThingConfig:
        """A leaf someone adds later."""

        mode: Literal["a", "b"] = "a"
        """Which mode."""
        enabled: bool = False
        """Whether it is on."""

    parser = ArgumentParser(prog="t")
    add_config_args(parser, NewThingConfig)
    text = parser.format_help()
    assert "New thing:" in text and "--mode {a,b}" in text and "--enabled [true|false], --no-enabled" in text
    assert vars(parser.parse_args(["--mode", "b", "--enabled"])) == {"mode": "b", "enabled": True}
    assert vars(parser.parse_args(["--enabled", "false"])) == vars(parser.parse_args(["--no-enabled"])) == {"enabled": False}


def test_yaml_values_are_coerced_by_the_field_type_and_wrong_ones_named(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("learning_rate: 1e-6\nmax_steps: '3'\nreward_weights: [1, '0.5']\nmodel_init_kwargs: '{\"revision\": \"main\"}'\n")
    config, _ = parse(["--config", str(good)])
    assert config.trainer.learning_rate == 1e-6 and config.run.max_steps == 3 and config.reward.reward_weights == (1.0, 0.5)
    assert config.run.model_init_kwargs == {"revision": "main"}  # a JSON object's text, as the flag takes it
    for text, message in [
        ("learning_rate: fast\n", "setting learning_rate: 'fast' is not a number"),
        ("max_steps: 2.5\n", "setting max_steps: 2.5 is not an integer"),
        ("max_steps: many\n", "setting max_steps: 'many' is not a number"),  # was float()'s own words, naming no setting
        ("max_steps: 5\nnum_train_epochs: x\n", "setting num_train_epochs: 'x' is not a number"),
        ("bf16: maybe\n", "setting bf16: 'maybe' is not true or false"),
        ("model: [a, b]\n", "setting model: ['a', 'b'] is not text"),
        ("generation_kwargs: x\n", "setting generation_kwargs: 'x' is not a mapping"),  # an AttributeError's traceback
        ("chat_template_kwargs: [1]\n", "setting chat_template_kwargs: [1] is not a mapping"),  # taken as is
        ("learning_rate: [1\n", "is not plain YAML (line 2, column 1)"),
        ("model: !!python/object/apply:os.system [echo]\n", "is not plain YAML"),
    ]:
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            parse(["--config", str(bad)])


def test_a_key_set_twice_in_yaml_is_refused_naming_both_lines(tmp_path):
    """PyYAML keeps the last of a key set twice, silently (so does TRL); a config naming one twice is refused."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: 1e-6\nbeta: 0.04\n# a comment\nlearning_rate: 3e-6\n")
    with pytest.raises(ValueError, match=re.escape(f"config file {str(bad)!r}: key learning_rate is set twice (lines 1 and 4); keep one of them")):
        parse(["--config", str(bad)])
    bad.write_text("generation_kwargs: {top_p: 0.9, top_p: 0.8}\n")
    with pytest.raises(ValueError, match=re.escape("key top_p is set twice (lines 1 and 1)")):
        parse(["--config", str(bad)])
    good = tmp_path / "good.yaml"  # a merge key's keys may be overridden (yaml's rule, not a repeat)
    good.write_text("a: &b {top_p: 0.9, top_k: 5}\nb: {<<: *b, top_p: 0.8}\n")
    assert load_yaml(str(good))["b"] == {"top_p": 0.8, "top_k": 5}


TRL_YAML = """
loss_type: dapo
beta: 0.04
epsilon: 0.2
epsilon_high: 0.28
delta: 1.5
importance_sampling_level: sequence
use_bias_correction_kl: false
top_entropy_quantile: 0.2
num_generations: 4
generation_batch_size: 192
max_completion_length: 64
learning_rate: 1.0e-6
warmup_ratio: 0.1
num_train_epochs: 2
disable_dropout: true
sync_ref_model: true
ref_model_mixup_alpha: 0.9
ref_model_sync_steps: 64
trust_remote_code: false
model_init_kwargs: {revision: main}
chat_template_kwargs: {enable_thinking: false}
"""


def test_a_yaml_written_for_trl_grpo_config_runs_unchanged(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(TRL_YAML)
    config, _ = parse(["--config", str(path)])
    assert (config.algo.loss_type, config.algo.delta, config.algo.importance_sampling_level) == ("dapo", 1.5, "sequence")
    assert config.data.chat_template_kwargs == {"enable_thinking": False}
    assert config.run.model_init_kwargs == {"revision": "main"} and config.run.num_train_epochs == 2
    assert (config.trainer.warmup_ratio, config.algo.ref_model_sync_steps) == (0.1, 64)
    assert config.data.steps_per_round == 192 // (config.data.num_prompts_per_step * 4)


@pytest.mark.parametrize(
    "flags, steps, error",
    [
        ([], 1, None),
        (["--steps_per_generation", "4"], 4, None),
        (["--generation_batch_size", "96"], 3, None),  # 96 completions = 3 steps of 4 prompts x 8
        (["--generation_batch_size", "40"], None, "multiple of --num_prompts_per_step x --num_generations \\(32\\)"),
        (["--steps_per_generation", "2", "--generation_batch_size", "64"], None, "give one of them"),
        (["--steps_per_generation", "0"], None, "must be >= 1"),
    ],
)
def test_steps_per_generation_and_generation_batch_size_follow_trls_rules(flags, steps, error):
    args = ["--num_prompts_per_step", "4", "--num_generations", "8", *flags]
    if error:
        with pytest.raises(ValueError, match=error):
            parse(args)
    else:
        assert parse(args)[0].data.steps_per_round == steps


def test_keys_neither_tandems_nor_trls_are_one_error_naming_each(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(TRL_YAML + "use_liger_kernel: true\nuse_vllm_engine: true\nzzz: 1\n")
    with pytest.raises(ValueError, match="unknown setting\\(s\\) use_vllm_engine, zzz \\(did you mean use_vllm\\?\\)"):
        parse(["--config", str(path)])


def test_dict_flags_take_json_objects():
    config, _ = parse(["--chat_template_kwargs", '{"enable_thinking": false}'])
    assert config.data.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match="expected a JSON object"):
        parse(["--chat_template_kwargs", "enable_thinking=false"])


def test_num_train_epochs_decides_the_steps():
    from tandemrl.cli.build import max_steps

    config, _ = parse(["--num_train_epochs", "2", "--num_prompts_per_step", "16"])
    assert max_steps(config, 100) == 13
    assert max_steps(parse([])[0], 100) == parse([])[0].run.max_steps


def test_generation_kwargs_override_sampling_flags_and_the_rest_need_hf():
    config, _ = parse(["--top_p", "0.5", "--generation_kwargs", '{"top_p": 0.9, "stop": ["\\n"]}'])
    params = config.resolve().sampling
    assert (params.top_p, params.stop) == (0.9, ("\n",))
    with pytest.raises(ValueError, match="no_repeat_ngram_size .* only apply with --generator hf"):
        parse(["--generation_kwargs", '{"no_repeat_ngram_size": 3}'])
    config, _ = parse(["--generator", "hf", "--generation_kwargs", '{"no_repeat_ngram_size": 3}'])
    assert config.generation.hf_generation_kwargs() == {"no_repeat_ngram_size": 3}
    # a repetition penalty is a sampling setting: every generator applies it, from the flag or the kwargs
    assert parse(["--repetition_penalty", "1.1"])[0].resolve().sampling.repetition_penalty == 1.1
    assert parse(["--generation_kwargs", '{"repetition_penalty": 1.3}'])[0].resolve().sampling.repetition_penalty == 1.3


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--beta", "nan"], "--beta must be a finite number >= 0"),  # passed, and step 1 crashed
        (["--max_grad_norm", "nan"], "--max_grad_norm must be a finite number >= 0"),  # silently meant no clipping
        (["--learning_rate", "inf"], "--learning_rate must be a finite number > 0"),  # caught only by the checkpoint guard
        (["--seed", "-1"], r"--seed must be in \[0, 16777215\], got -1$"),  # said "got -100003300009"
        (["--rollout_server_silence_s", "0"], "--rollout_server_silence_s must be a number of seconds > 0"),
        (["--logprob_chunk_size", "0"], "--logprob_chunk_size must be >= 1"),  # was "range() arg 3 must not be zero"
        (["--adam_beta1", "1"], r"--adam_beta1 must be in \[0, 1\), got 1.0"),  # torch's "Invalid beta parameter at index 0"
        (["--warmup_steps", "-1"], "--warmup_steps >= 0"),  # taken
        (["--num_train_epochs", "0"], "--num_train_epochs must be > 0"),  # trained a step
    ],
)
def test_non_finite_and_out_of_range_values_are_one_line_naming_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        parse(flags)


def test_a_null_in_yaml_is_a_key_not_set_for_every_key(tmp_path):
    """`max_steps: null` was a TypeError traceback, `optim: null` (TRL's unset) refused, `learning_rate: null`
    the dataclass default instead of the task recipe's (issue 36). Every flag and TRL key, set to null, is now
    the run without that line."""
    from tandemrl.cli import trl

    path = tmp_path / "run.yaml"
    names = [f.name for leaf in LEAVES for f in dataclasses.fields(leaf)] + sorted(trl.TRL_KEYS)
    path.write_text("".join(f"{name}: null\n" for name in names))
    assert parse(["--config", str(path)])[0] == parse([])[0]
    path.write_text("learning_rate: null\nmax_steps: null\n")
    config, _ = parse(["--config", str(path)])
    assert config.trainer.learning_rate == 1e-3 and config.run.max_steps == parse([])[0].run.max_steps  # the recipe's


def test_rollout_yaml_null_is_the_default(tmp_path):
    from tandemrl.cli.rollout import parse as parse_rollout

    path = tmp_path / "serve.yaml"
    path.write_text("model: tandem:tiny\nport: null\nmax_num_seqs: null\n")
    assert parse_rollout(["--config", str(path)]) == parse_rollout(["--model", "tandem:tiny"])


def test_lora_on_the_embedded_default_takes_its_lora_recipe():
    """--lora_r (or TRL's --use_peft) on the synthetic task's own model adds its LoRA recipe (the final norm
    trained whole at 1.0: README, "LoRA"); flags override it; another --model keeps the plain recipe."""
    config, _ = parse(["--lora_r", "16"])
    assert config.lora.lora_modules_to_save == ("model.norm",) and config.lora.lora_modules_to_save_learning_rate == 1.0
    assert config.trainer.learning_rate == 1e-3  # the adapters train at the full fine-tuning's rate
    assert parse(["--use_peft"])[0].lora.lora_modules_to_save == ("model.norm",)
    assert parse(["--lora_r", "16", "--lora_modules_to_save"])[0].lora.lora_modules_to_save == ()  # adapters alone
    assert parse(["--lora_r", "16", "--lora_modules_to_save_learning_rate", "0.1"])[0].lora.lora_modules_to_save_learning_rate == 0.1
    for argv in ([], ["--lora_r", "16", "--model", "Qwen/Qwen2.5-0.5B"], ["--use_peft", "false"]):
        lora = parse(argv)[0].lora
        assert lora.lora_modules_to_save == () and lora.lora_modules_to_save_learning_rate is None, argv
    with pytest.raises(ValueError, match="--lora_modules_to_save_learning_rate must be a finite number > 0"):
        parse(["--lora_r", "16", "--lora_modules_to_save_learning_rate", "inf"])


def test_resume_compares_every_flag_but_the_allowed_ones_against_the_checkpoints(tmp_path):
    """changed_flags over the flags a checkpoint recorded: a list read back from YAML equals the tuple, a flag
    the record lacks (added to tandem since) had its default, and the allow-list names only real flags."""
    from tandemrl.cli.build import saved_flags
    from tandemrl.config import RESUME_MAY_CHANGE, TrainConfig, changed_flags

    config, _ = parse(["--reward_funcs", "format", "length"])
    saved = saved_flags(config)
    assert changed_flags({**saved, "reward_funcs": ["format", "length"]}, config) == {}
    later, _ = parse(["--reward_funcs", "format", "length", "--learning_rate", "0.5", "--max_steps", "7", "--resume", "--output_dir", str(tmp_path)])
    assert changed_flags(saved, later) == {"max_steps": (150, 7), "learning_rate": (1e-3, 0.5)}
    older = {k: v for k, v in saved.items() if k != "tis_cap"}
    assert changed_flags(older, dataclasses.replace(config, algo=dataclasses.replace(config.algo, tis_cap=9.0))) == {"tis_cap": (2.0, 9.0)}
    assert RESUME_MAY_CHANGE <= TrainConfig().to_dict().keys()
    assert {"model", "seed", "learning_rate", "num_generations", "temperature", "dtype", "lora_r", "loss_type"}.isdisjoint(RESUME_MAY_CHANGE)


def test_a_refused_resume_says_only_its_error_and_a_longer_decaying_schedule_is_said_to_stretch(caplog):
    import logging
    from pathlib import Path

    from tandemrl.cli.build import _check_flags, saved_flags

    config, _ = parse(["--lr_scheduler_type", "linear", "--max_steps", "4"])
    state = {"flags": saved_flags(config)}
    longer, _ = parse(["--lr_scheduler_type", "linear", "--max_steps", "8", "--seed", "3"])
    with caplog.at_level(logging.INFO), pytest.raises(ValueError, match=r"^--resume: --seed 0 -> 3 since checkpoint-4 change what the run computes;"):
        _check_flags(longer, state, Path("checkpoint-4"))
    assert not caplog.records  # the error is the one line
    longer, _ = parse(["--lr_scheduler_type", "linear", "--max_steps", "8"])
    with caplog.at_level(logging.INFO):
        _check_flags(longer, state, Path("checkpoint-4"))
    assert caplog.messages == ["--resume: --max_steps 4 -> 8 since checkpoint-4; the learning-rate schedule spans the new length from here on"]


def test_a_resume_starts_from_the_flags_of_the_checkpoint_it_continues(tmp_path):
    """The newest checkpoint whose state reads gives a resume's flags (config.yaml may be a newer run's that
    died before its first checkpoint); a checkpoint that kept none leaves them to config.yaml."""
    import torch

    from tandemrl.cli.args import dump_yaml
    from tandemrl.cli.build import saved_flags

    (tmp_path / "config.yaml").write_text(dump_yaml(saved_flags(parse(["--learning_rate", "0.3", "--seed", "5"])[0])))
    for step, state in ((1, {"flags": saved_flags(parse(["--learning_rate", "0.1"])[0])}), (2, {"flags": saved_flags(parse(["--learning_rate", "0.2"])[0])})):
        (tmp_path / f"checkpoint-{step}").mkdir()
        torch.save(state, tmp_path / f"checkpoint-{step}" / "trainer_state.pt")
    resumed = ["--output_dir", str(tmp_path), "--resume"]
    assert (parse(resumed)[0].trainer.learning_rate, parse(resumed)[0].run.seed) == (0.2, 0)
    assert parse([*resumed, "--learning_rate", "0.4"])[0].trainer.learning_rate == 0.4
    state = tmp_path / "checkpoint-2" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:20])  # torn: the resume goes on from checkpoint-1
    assert parse(resumed)[0].trainer.learning_rate == 0.1
    torch.save({}, tmp_path / "checkpoint-1" / "trainer_state.pt")  # from before checkpoints kept the flags
    assert (parse(resumed)[0].trainer.learning_rate, parse(resumed)[0].run.seed) == (0.3, 5)
