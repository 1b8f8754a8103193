"""TrainConfig.resolve() -> Plan: the run worked out once, on CPU, building nothing; and every setting,
default and rule spanning leaves has one home (a table of them, each checked against the source)."""

from __future__ import annotations

import ast
import dataclasses
import functools
from pathlib import Path

import pytest
import yaml

import tandemrl
from tandemrl.cli.train import parse
from tandemrl.config import GenerationConfig
from tandemrl.generation.base import EngineConfig, RemoteConfig
from tandemrl.types import SamplingParams

SRC = Path(tandemrl.__file__).parent


def test_generation_kwargs_temperature_is_the_one_the_trainer_scores_under():
    plan = parse(["--temperature", "1.0", "--generation_kwargs", '{"temperature": 0.7, "top_k": 50}'])[0].resolve()
    assert (plan.sampling.temperature, plan.sampling.top_k) == (0.7, 50)


def test_resolving_builds_nothing_and_is_pure():
    config, _ = parse(["--num_prompts_per_step", "3", "--num_generations", "5", "--steps_per_generation", "2"])
    assert config.resolve() == config.resolve()
    plan = config.resolve()
    assert plan.engine.max_num_seqs == 30 and plan.engine.max_model_len == config.data.max_prompt_length + config.algo.max_completion_length
    assert isinstance(plan.generator, EngineConfig) and plan.generator.max_num_seqs == 30 and plan.generator.gpu_memory_utilization == 0.4
    assert plan.loop.steps_per_generation == 2 and plan.loop.max_policy_lag == 1


@pytest.mark.parametrize(
    "flags, graphs",
    [
        ([], "plain"),
        (["--top_p", "0.9"], "filtered"),
        (["--generation_kwargs", '{"top_k": 50}'], "filtered"),  # TRL's form: the sampler the run draws with decides
        (["--min_p", "0.05", "--decode_graphs", "plain"], "plain"),  # the flag, where given, wins
        (["--decode_graphs", "filtered"], "filtered"),
    ],
)
def test_the_decode_graphs_hold_the_sampler_the_run_draws_with(flags, graphs):
    assert parse(flags)[0].resolve().generator.decode_graphs == graphs


def test_the_api_key_falls_back_to_the_environment_once_for_the_policy_and_the_judge(monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    flags = ["--rollout_mode", "server", "--rollout_server_urls", "http://127.0.0.1:1", "--reward_model", "j", "--reward_model_url", "http://127.0.0.1:2"]
    plan = parse(flags)[0].resolve()
    assert isinstance(plan.generator, RemoteConfig) and isinstance(plan.judge, RemoteConfig)
    assert plan.generator.api_key == plan.judge.api_key == "from-env"
    assert parse([*flags, "--api_key", "given"])[0].resolve().judge.api_key == "given"
    assert "from-env" not in yaml.safe_dump(plan.to_dict())  # never printed


@pytest.mark.parametrize("deadline", [30.0, 1200.0])
def test_a_judge_servers_request_deadline_is_the_reward_deadline(deadline):
    """On main it was 600 s whatever --reward_timeout_s: a judge given 1200 s was cut at 600 (logged Nones)."""
    plan = parse(["--reward_model", "j", "--reward_model_url", "http://127.0.0.1:2", "--reward_timeout_s", str(deadline)])[0].resolve()
    assert plan.judge.request_timeout_s == deadline


def test_a_judge_engine_takes_its_own_memory_fraction():
    plan = parse(["--reward_model", "some/judge"])[0].resolve()
    assert isinstance(plan.judge, EngineConfig) and plan.judge.model == "some/judge" and plan.judge.gpu_memory_utilization == 0.2


def test_dynamic_sampling_that_cannot_refill_is_a_note():
    assert parse(["--drop_zero_variance_groups"])[0].resolve().notes == ()
    notes = parse(["--drop_zero_variance_groups", "--max_staleness", "1"])[0].resolve().notes
    assert len(notes) == 1 and "not refilled" in notes[0]


def test_print_config_output_is_a_config_file(tmp_path, capsys):
    from tandemrl.cli.train import main

    assert main(["--print_config", "--beta", "0.04", "--generation_kwargs", '{"temperature": 0.5}']) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["plan"]["sampling"]["temperature"] == 0.5 and printed["plan"]["generator"]["backend"] == "engine"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(printed))
    assert parse(["--config", str(path)])[0] == parse(["--beta", "0.04", "--generation_kwargs", '{"temperature": 0.5}'])[0]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tensor_parallel_size", "2", "--max_staleness", "1"], "not supported"),
        (["--max_total_tokens", "64", "--max_prompt_length", "64", "--tools", "m:f"], "must exceed --max_prompt_length"),
        (["--routing_replay", "--generator", "hf"], "records no routes"),
    ],
)
def test_rules_spanning_leaves_are_the_configs(flags, message):
    with pytest.raises(ValueError, match=message):
        parse(flags)


# --- each setting, default and rule spanning leaves, defined once -----------------------------------------

@functools.cache
def _nodes() -> list[tuple[str, ast.AST]]:
    """Every node of the package's source, with its module's path (walked once: the rows below filter it)."""
    return [(str(path.relative_to(SRC)), n) for path in SRC.rglob("*.py") for n in ast.walk(ast.parse(path.read_text()))]


def _calls_of(name: str) -> set[str]:
    """Modules that construct `name(...)`."""
    return {m for m, n in _nodes() if isinstance(n, ast.Call) and getattr(n.func, "id", None) == name}


def _raising(fragment: str) -> set[str]:
    """Modules with a `raise` whose message mentions `fragment`."""
    found = set()
    for module, node in _nodes():
        if isinstance(node, ast.Raise) and node.exc is not None:
            text = " ".join(c.value for c in ast.walk(node.exc) if isinstance(c, ast.Constant) and isinstance(c.value, str))
            if fragment in text:
                found.add(module)
    return found


def _constants(value: str) -> set[str]:
    return {m for m, n in _nodes() if isinstance(n, ast.Constant) and n.value == value}


def _literal_keywords(name: str) -> set[str]:
    """Modules passing `name=<a literal number>`."""
    return {
        m for m, n in _nodes()
        if isinstance(n, ast.keyword) and n.arg == name and isinstance(n.value, ast.Constant) and n.value.value is not None
    }  # fmt: skip


def _trainer_sampling_args() -> set[str]:
    """The expressions cli/ hands the Trainer its sampling settings by (temperature, sampling)."""
    return {
        ast.unparse(k.value).rsplit(".", 1)[0] if k.arg == "temperature" else ast.unparse(k.value)
        for m, n in _nodes() if m.startswith("cli/")
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Trainer" for k in n.keywords if k.arg in ("temperature", "sampling")
    }  # fmt: skip


ONE_HOME = [
    # what, where it is found, its one home
    ("the loop's settings are resolved", lambda: _calls_of("LoopSettings"), {"config.py"}),
    ("the servers' client settings (API key applied) are resolved", lambda: _calls_of("RemoteConfig"), {"config.py"}),
    ("the engine is sized", lambda: _calls_of("EngineSizing"), {"config.py"}),
    ("the API key's environment fallback", lambda: _constants("TANDEM_API_KEY"), {"generation/base.py"}),
    ("--max_staleness is validated", lambda: _raising("--max_staleness"), {"config.py"}),
    ("--generation_kwargs are checked", lambda: _raising("--generation_kwargs"), {"config.py"}),
    ("where the engine serves LoRA beside the trainer's base (--lora_engine)", lambda: _raising("--lora_engine shared"), {"config.py"}),
    ("no memory fraction is a literal at a call", lambda: _literal_keywords("gpu_memory_utilization"), set()),
    ("the trainer's sampling settings are the sampler's", lambda: _trainer_sampling_args(), {"plan.sampling"}),
]


@pytest.mark.parametrize("what, found, home", ONE_HOME, ids=[w for w, _, _ in ONE_HOME])
def test_each_setting_and_rule_has_one_home(what, found, home):
    assert found() == home, what


def test_defaults_are_stated_once():
    g = GenerationConfig()
    sampling = SamplingParams()
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        assert getattr(g, name) == getattr(sampling, name), name
    assert g.rollout_server_timeout == RemoteConfig().rollout_server_timeout
    source = (SRC / "config.py").read_text()
    assert "= _SAMPLING." in source and "= _REMOTE.rollout_server_timeout" in source  # read from their owners, not copied
    assert not any(f.name in ("temperature", "api_key") for f in dataclasses.fields(EngineConfig))
