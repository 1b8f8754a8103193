"""TRL 1.16's keys and value forms as `tandem train` reads them: every key of TRL's `trl grpo` (the fixture
tests/fixtures/trl_keys.json, written from TRL 1.16 itself) has one place, and a yaml or command line in
TRL's forms resolves to the tandem config it means."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import yaml

from tandemrl.cli import trl
from tandemrl.cli.train import parse
from tandemrl.config import LEAVES

FIXTURE = json.loads((Path(__file__).parents[2] / "fixtures" / "trl_keys.json").read_text())
FLAGS = {f.name for leaf in LEAVES for f in dataclasses.fields(leaf)}


def test_fixture_is_trl_1_16s_and_every_key_has_exactly_one_place():
    assert FIXTURE["trl_version"].startswith("1.16")
    for key in FIXTURE["keys"]:
        places = [key in FLAGS, key in trl.TRANSLATED, key in trl.IGNORED, key in trl.REFUSED]
        assert sum(places) == 1, (key, places)
    assert trl.TRL_KEYS <= set(FIXTURE["keys"]), trl.TRL_KEYS - set(FIXTURE["keys"])  # no invented names
    for key in trl.REFUSED:  # TRL's own default is never refused
        assert trl._at_default(key, FIXTURE["keys"][key]["default"]), key
    assert {k for k in trl.REFUSED if isinstance(FIXTURE["keys"][k]["default"], bool)} <= trl.REFUSED_BOOLS <= set(trl.REFUSED)


def test_a_yaml_of_every_trl_key_at_its_default_is_accepted(tmp_path, caplog):
    path = tmp_path / "all.yaml"
    path.write_text(yaml.safe_dump({k: v["default"] for k, v in FIXTURE["keys"].items()}))
    with caplog.at_level(logging.INFO, logger="tandemrl.cli.train"):
        config, _ = parse(["--config", str(path)])
    assert config.run.seed == 42 and config.algo.loss_type == "dapo" and config.trainer.lr_scheduler_type == "linear"
    assert config.run.num_train_epochs == 3.0  # max_steps -1: the epochs decide, as TRL
    assert config.data.num_prompts_per_step == 1  # 8 completions x 1 micro-batch / 8 generations
    assert config.generation.top_k == -1 and config.log.report_to == () and config.algo.max_completion_length == 512
    assert config.algo.tis_mode == "sequence_mask" and config.algo.tis_cap == 3.0
    assert config.lora.lora_r == 0  # TRL reads lora_* only with use_peft
    assert any("use_vllm" in r.message and "ignored" in r.message for r in caplog.records)


TRL_DOCS_YAML = """\
model_name_or_path: {model}
dataset_name: {data}
output_dir: {out}
per_device_train_batch_size: 4
gradient_accumulation_steps: 2
num_generations: 4
bf16: true
report_to: none
use_vllm: true
learning_rate: 1.0e-6
logging_steps: 0.5
max_steps: 2
"""


def test_trl_docs_yaml_translates_with_one_line_each(tmp_path, caplog):
    path = tmp_path / "grpo.yaml"
    path.write_text(TRL_DOCS_YAML.format(model="m", data="d.jsonl", out=tmp_path / "run"))
    with caplog.at_level(logging.INFO, logger="tandemrl.cli.train"):
        config, _ = parse(["--config", str(path)])
    assert (config.run.model, config.data.dataset, config.run.task) == ("m", "d.jsonl", "")
    assert config.data.num_prompts_per_step == 2 and config.data.num_generations == 4  # 4 x 2 / 4
    assert config.trainer.bf16 is True and config.log.report_to == () and config.log.logging_steps == 1
    lines = [r.message for r in caplog.records]
    for key in ("model_name_or_path", "dataset_name", "use_vllm", "per_device_train_batch_size", "logging_steps"):
        assert sum(key in line for line in lines) == 1, (key, lines)


def test_a_trl_key_read_with_another_says_so_not_that_it_is_a_default(caplog):
    """dataset_config main, folded into dataset_name's --dataset, was logged '-> nothing (its default)'."""
    with caplog.at_level(logging.INFO, logger="tandemrl.cli.train"):
        config, _ = parse(["--dataset_name", "openai/gsm8k", "--dataset_config", "main"])
    assert config.data.dataset == "openai/gsm8k:main"
    assert "TRL setting dataset_config: main -> read with dataset_name" in [r.message for r in caplog.records]


def test_trl_value_forms_on_the_command_line():
    config, _ = parse(["--bf16", "false", "--scale_rewards", "true", "--top_k", "0", "--logging_steps", "0.1", "--report_to", "tensorboard"])
    assert config.trainer.bf16 is False and config.algo.scale_rewards == "group" and config.generation.top_k == -1
    assert config.log.logging_steps == 15 and config.log.report_to == ()  # 0.1 of the synthetic recipe's 150 steps
    config, _ = parse(["--num_train_epochs", "1", "--logging_steps", "0.1", "--save_steps", "0.5", "--max_steps", "40"])
    assert config.log.logging_steps == 0.1 and config.checkpoint.save_steps == 0.5  # the epochs' steps are known once the data is
    config, _ = parse(["--bf16", "true", "--scale_rewards", "false", "--report_to", "none", "--disable_dropout", "False"])
    assert config.trainer.bf16 is True and config.algo.scale_rewards == "none" and config.trainer.disable_dropout is False
    with pytest.raises(ValueError, match="--bf16.*'maybe' is not true or false \\(write true/false, yes/no, y/n, t/f, 1/0 or on/off"):
        parse(["--bf16", "maybe"])
    with pytest.raises(ValueError, match="report_to all: name the sinks"):
        parse(["--report_to", "all"])


def test_max_steps_beside_num_train_epochs_says_which_decides(caplog):
    """TRL: a positive max_steps overrides num_train_epochs; here the epochs decide, so a TRL yaml with both is told."""
    with caplog.at_level(logging.INFO, logger="tandemrl.cli.train"):
        config, _ = parse(["--max_steps", "40", "--num_train_epochs", "1"])
    assert config.run.num_train_epochs == 1.0
    assert any("max_steps 40 and num_train_epochs 1 are both set: the epochs decide the steps here" in r.message for r in caplog.records)


def test_trl_names_on_the_command_line():
    config, _ = parse([
        "--model_name_or_path", "m", "--dataset_name", "org/data", "--dataset_config", "main", "--use_vllm",
        "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4", "--num_generations", "8",
        "--vllm_gpu_memory_utilization", "0.5", "--vllm_importance_sampling_correction", "false", "--use_peft",
    ])  # fmt: skip
    assert (config.run.model, config.data.dataset, config.data.num_prompts_per_step) == ("m", "org/data:main", 4)
    assert config.engine.gpu_memory_utilization == 0.5 and config.algo.tis_cap == 0.0 and config.lora.lora_r == 16
    config, _ = parse(["--vllm_mode", "server", "--vllm_server_port", "8001", "--vllm_enable_sleep_mode", "false"])
    assert config.generation.rollout_mode == "server" and config.generation.rollout_server_urls == ("http://127.0.0.1:8001",)
    with pytest.raises(ValueError, match="setting vllm_mode: 'Server' is not one of server, colocate"):
        parse(["--vllm_mode", "Server"])  # was colocate, silently (TRL refuses it)


def test_a_trl_flag_over_a_yaml_of_its_linked_keys_wins_and_keeps_the_others(tmp_path):
    # yaml supplies defaults, flags win: a flag read with other TRL keys (dataset_name + dataset_config,
    # vllm_mode + host/port, use_peft + lora_*) applies over the yaml's, never dropped as "nothing"
    config_path = tmp_path / "grpo.yaml"
    config_path.write_text("dataset_name: openai/gsm8k\ndataset_config: main\nvllm_mode: server\nuse_peft: true\n")
    config, _ = parse(["--config", str(config_path), "--dataset_config", "socratic", "--vllm_server_port", "8001", "--use_peft", "false"])
    assert config.data.dataset == "openai/gsm8k:socratic"
    assert config.generation.rollout_server_urls == ("http://127.0.0.1:8001",)
    assert config.lora.lora_r == 0
    config, _ = parse(["--config", str(config_path), "--dataset_name", "org/other"])
    assert config.data.dataset == "org/other:main" and config.lora.lora_r == 16  # the yaml's dataset_config, as TRL


def test_a_flag_setting_the_steps_batch_wins_over_the_yamls_other_form_of_it(tmp_path):
    """yaml supplies defaults, flags win: --num_prompts_per_step over a yaml's per_device_train_batch_size (an error
    before), TRL's batch flags over a yaml's num_prompts_per_step; both forms in one source stay an error."""
    path = tmp_path / "grpo.yaml"
    path.write_text("per_device_train_batch_size: 8\ngradient_accumulation_steps: 2\nnum_generations: 4\n")
    assert parse(["--config", str(path), "--num_prompts_per_step", "3"])[0].data.num_prompts_per_step == 3
    assert parse(["--config", str(path), "--gradient_accumulation_steps", "4"])[0].data.num_prompts_per_step == 8  # 8 x 4 / 4
    path.write_text("num_prompts_per_step: 3\nnum_generations: 4\n")
    assert parse(["--config", str(path), "--per_device_train_batch_size", "8"])[0].data.num_prompts_per_step == 2  # 8 x 1 / 4
    path.write_text("num_prompts_per_step: 3\nper_device_train_batch_size: 8\n")
    with pytest.raises(ValueError, match="per_device_train_batch_size and num_prompts_per_step set the same thing"):
        parse(["--config", str(path)])


def test_trl_keys_tandem_cannot_honour_are_refused_and_batch_conflicts_named():
    with pytest.raises(ValueError, match="use_dora: no DoRA"):
        parse(["--use_dora", "true"])
    with pytest.raises(ValueError, match="not a multiple of num_generations 8"):
        parse(["--per_device_train_batch_size", "4", "--num_generations", "8"])
    with pytest.raises(ValueError, match="set the same thing"):
        parse(["--per_device_train_batch_size", "8", "--num_prompts_per_step", "2"])
    assert parse(["--optim", "adamw_torch"])[0].trainer.adam_beta2 == 0.99  # adamw_*: accepted


def test_trls_optimizer_keys_reach_the_trainer(tmp_path):
    """adam_epsilon was ignored with an info line; it is AdamW's eps now, as TRL's (default 1e-8, TRL's too)."""
    path = tmp_path / "grpo.yaml"
    path.write_text("adam_epsilon: 1.0e-6\nadam_beta1: 0.8\nadam_beta2: 0.95\nweight_decay: 0.1\nmax_grad_norm: 0.5\n")
    trainer = parse(["--config", str(path)])[0].trainer
    assert (trainer.adam_epsilon, trainer.adam_beta1, trainer.adam_beta2, trainer.weight_decay, trainer.max_grad_norm) == (1e-6, 0.8, 0.95, 0.1, 0.5)
    assert parse(["--adam_epsilon", "1e-5"])[0].trainer.adam_epsilon == 1e-5 and parse([])[0].trainer.adam_epsilon == 1e-8


def test_trls_ddp_timeout_bounds_every_collective_among_the_ranks(tmp_path):
    """ddp_timeout was ignored with an info line, every collective waiting gloo's 30 minutes (a stopped rank
    hung the run that long: test_train_torchrun_faults.py); it is the collectives' deadline, TRL's default."""
    path = tmp_path / "grpo.yaml"
    path.write_text("ddp_timeout: 60\n")
    assert parse(["--config", str(path)])[0].trainer.ddp_timeout == 60 and parse([])[0].trainer.ddp_timeout == 1800
    with pytest.raises(ValueError, match="--ddp_timeout must be >= 1"):
        parse(["--ddp_timeout", "0"])


def test_shuffle_dataset_is_honoured(tmp_path):
    """TRL's shuffle_dataset (default true) was ignored with an info line: false is the dataset's order now."""
    path = tmp_path / "grpo.yaml"
    path.write_text("shuffle_dataset: false\n")
    assert parse(["--config", str(path)])[0].data.shuffle_dataset is False
    assert parse(["--shuffle_dataset", "false"])[0].data.shuffle_dataset is False and parse([])[0].data.shuffle_dataset is True


def test_every_bool_reads_hfargumentparsers_forms_in_any_case(tmp_path):
    """HfArgumentParser's string_to_bool forms (yes/no, true/false, y/n, t/f, 1/0, any case) wherever a bool is read:
    a tandem switch, TRL's translated bools, TRL's refused ones at their default (`--load_in_4bit no` and a quoted
    `use_dora: 'no'` were refused as set); anything else is one line naming the key and the forms."""
    path = tmp_path / "grpo.yaml"
    path.write_text("use_dora: 'no'\nload_in_8bit: 'F'\ntrust_remote_code: 'Y'\nresume_from_checkpoint: 'no'\nuse_peft: 'T'\n")
    config, _ = parse(["--config", str(path), "--load_in_4bit", "no", "--bf16", "N", "--log_completions", "n", "--disable_dropout", "f"])
    assert config.run.trust_remote_code is True and config.checkpoint.resume is False and config.lora.lora_r == 16
    assert config.trainer.bf16 is False and config.log.log_completions_steps == 0 and config.trainer.disable_dropout is False
    assert parse(["--vllm_importance_sampling_correction", "NO"])[0].algo.tis_cap == 0.0
    with pytest.raises(ValueError, match="load_in_4bit: no quantized training"):
        parse(["--load_in_4bit", "Yes"])
    for key, value in (("load_in_4bit", "maybe"), ("use_peft", "2")):
        with pytest.raises(ValueError, match=f"setting {key}: '{value}' is not true or false \\(write true/false, yes/no"):
            parse([f"--{key}", value])
    path.write_text("trust_remote_code: nope\n")
    with pytest.raises(ValueError, match="setting trust_remote_code: 'nope' is not true or false \\(write true/false"):
        parse(["--config", str(path)])


def test_comma_separated_reward_funcs_are_several_functions_as_a_list_is(tmp_path, caplog):
    """`reward_funcs: a,b` (or --reward_funcs a,b) was read as one function named "a,b"; it is two, as [a, b]
    (no reference holds a comma), and reward_weights alike."""
    path = tmp_path / "grpo.yaml"
    path.write_text("reward_funcs: accuracy_reward, format\nreward_weights: 1,0.5\n")
    with caplog.at_level(logging.INFO, logger="tandemrl.cli.train"):
        reward = parse(["--config", str(path)])[0].reward
    assert reward.reward_funcs == ("math_accuracy", "format") and reward.reward_weights == (1.0, 0.5)
    assert any("reward_funcs accuracy_reward, format -> --reward_funcs math_accuracy format" in r.message for r in caplog.records)
    assert parse(["--reward_funcs", "format,length", "my_lib.rewards.fn"])[0].reward.reward_funcs == ("format", "length", "my_lib.rewards:fn")
    path.write_text("reward_funcs: [format, length]\nreward_weights: [1, 0.5]\n")
    assert parse(["--config", str(path)])[0].reward.reward_funcs == ("format", "length")
    assert parse(["--reward_weights", "2"])[0].reward.reward_weights == (2.0,)
    assert parse(["--reward_weights", "1,0.5", "0.2"])[0].reward.reward_weights == (1.0, 0.5, 0.2)  # the flag too (argparse refused it)


@pytest.mark.parametrize(
    "typed, meant",
    [("--lr", "--learning_rate"), ("--gradient_accumulation_step", "--gradient_accumulation_steps"),
     ("--per_device_train_batch", "--per_device_train_batch_size"), ("--use_vlm", "--use_vllm"),
     ("--model_name_or_pth", "--model_name_or_path"), ("--epochs", "--num_train_epochs")],
)  # fmt: skip
def test_did_you_mean_searches_trls_names_and_common_aliases(typed, meant):
    with pytest.raises(ValueError, match=f"unknown flag {typed} \\(did you mean {meant}\\?\\)"):
        parse([typed, "1"])


def readme_default_differences() -> list[list[str]]:
    """The rows of README's "Differences from TRL 1.16's defaults" table, cells without backticks."""
    text = (Path(__file__).parents[3] / "README.md").read_text()
    table = text[text.index("**Differences from TRL 1.16's defaults.**") :].split("\n\n")[1]
    rows = [[c.strip().strip("`") for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert rows and all(len(row) == 5 for row in rows), table
    return rows


# same meaning, other spelling of the same default (TRL's None = tandem's own rule, 0 = -1 = off, ...)
SAME_DEFAULT = {"bf16", "top_k", "min_p", "epsilon", "importance_sampling_level", "report_to", "output_dir", "run_name",
                "model_init_kwargs", "generation_kwargs", "chat_template_kwargs", "reward_funcs", "reward_weights",
                "lora_r", "lora_alpha", "lora_target_modules", "lora_modules_to_save"}  # fmt: skip


def test_readme_table_of_default_differences_matches_trl_and_tandem_and_misses_none():
    from tandemrl.config import TrainConfig

    ours = TrainConfig().to_dict()
    rows = readme_default_differences()
    for key, theirs, flag, mine, _ in rows:
        assert yaml.safe_load(theirs) == FIXTURE["keys"][key]["default"], key
        assert yaml.safe_load(mine) == ours[flag.removeprefix("--")], flag
    listed = {row[0] for row in rows}
    for key, entry in FIXTURE["keys"].items():
        if key in FLAGS and key not in SAME_DEFAULT and key not in listed:
            theirs, mine = entry["default"], ours[key]
            assert theirs == (list(mine) if isinstance(mine, tuple) else mine), f"{key}: TRL {theirs!r}, tandem {mine!r}: add it to README's table"


def cut_off_rows(text: str) -> list[int]:
    """Line numbers of table rows a blank line cut off from their table (they render as text, not rows)."""
    lines = text.splitlines()
    return [i + 1 for i, line in enumerate(lines) if line.startswith("|") and not lines[i - 1].startswith("|")
            and not (i + 1 < len(lines) and lines[i + 1].startswith("|---"))]  # fmt: skip


def test_readme_tables_have_no_row_cut_off_by_a_blank_line():
    """The "Coming from TRL" table once had rows cut off by blank lines (issue 35); every table is whole."""
    assert cut_off_rows("| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n") == [5]
    assert cut_off_rows((Path(__file__).parents[3] / "README.md").read_text()) == []


def test_eval_strategy_evaluates_on_the_datasets_test_split_as_trls_script(tmp_path):
    """TRL's script evaluates on dataset_name's dataset_test_split whenever eval_strategy is not "no"; without
    --eval_dataset tandem evaluated nothing, and dataset_test_split alone still changes nothing (TRL's default)."""
    config_path = tmp_path / "grpo.yaml"
    config_path.write_text("dataset_name: openai/gsm8k\ndataset_config: main\neval_strategy: steps\neval_steps: 20\ndataset_test_split: validation\n")
    config, _ = parse(["--config", str(config_path)])
    assert (config.data.eval_dataset, config.data.eval_dataset_split, config.data.eval_steps) == ("openai/gsm8k:main", "validation", 20)
    config, _ = parse(["--config", str(config_path), "--dataset_name", "org/other"])  # a flag of the group takes eval_strategy along
    assert config.data.eval_dataset == "org/other:main"
    config, _ = parse(["--config", str(config_path), "--eval_dataset", "e.jsonl"])  # tandem's own flag wins
    assert config.data.eval_dataset == "e.jsonl"
    config, _ = parse(["--dataset_name", "org/d", "--eval_strategy", "no"])
    assert config.data.eval_dataset == ""
    config_path.write_text("dataset_name: org/d\neval_strategy: epoch\neval_dataset: e.jsonl\n")  # one source, both
    assert parse(["--config", str(config_path)])[0].data.eval_dataset == "e.jsonl"
    with pytest.raises(ValueError, match="d.jsonl is one file with no such split; pass --eval_dataset FILE, or eval_strategy no"):
        parse(["--dataset_name", "d.jsonl", "--eval_strategy", "steps"])
