"""The sampling contract: SamplingParams holds every limit and rule, and the server's schemas state the same."""

import dataclasses
import json

import pytest

from tandemrl.server.openai import CompletionRequest
from tandemrl.server.wire import BatchItem, Sampling, to_sampling_params
from tandemrl.types import GREEDY_EPS, MAX_SEED, MAX_TEMPERATURE, SAMPLING_BOUNDS, SAMPLING_MAX_ITEMS, SamplingParams


@pytest.mark.parametrize(
    "fields, word",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": MAX_TEMPERATURE * 2}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"seed": MAX_SEED + 1}, "seed"),
        ({"stop": ("x",) * (SAMPLING_MAX_ITEMS["stop"] + 1)}, "stop"),
        ({"stop_token_ids": (1,) * (SAMPLING_MAX_ITEMS["stop_token_ids"] + 1)}, "stop_token_ids"),
    ],
)
def test_illegal_sampling_params_raise_naming_the_field(fields, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**fields)


def test_a_temperature_below_greedy_eps_is_greedy():
    assert SamplingParams(temperature=GREEDY_EPS / 2).temperature == 0.0
    assert SamplingParams(temperature=GREEDY_EPS).temperature == GREEDY_EPS


def test_the_wire_schemas_state_sampling_params_ranges_and_defaults():
    for model in (Sampling, CompletionRequest):
        schema = model.model_json_schema()["properties"]
        for name, bound in SAMPLING_BOUNDS.items():
            text = str(schema[name])
            for key, word in (("ge", "'minimum'"), ("gt", "'exclusiveMinimum'"), ("le", "'maximum'")):
                if key in bound:
                    assert f"{word}: {bound[key]}" in text, (model, name, text)
        for name, most in SAMPLING_MAX_ITEMS.items():
            assert f"': {most}" in str(schema[name])  # maxItems (a list), maxLength (OpenAI's str | list)
    assert to_sampling_params(Sampling()) == SamplingParams()


def test_any_legal_sampling_params_is_a_legal_wire_item():
    params = SamplingParams(temperature=MAX_TEMPERATURE, top_k=1, seed=MAX_SEED, stop=("x",) * SAMPLING_MAX_ITEMS["stop"])
    item = BatchItem.model_validate(json.loads(json.dumps({"prompt_ids": [1], "request_id": "a", **dataclasses.asdict(params)})))  # as the client sends it
    assert to_sampling_params(item) == params


@pytest.mark.parametrize(
    "fields, word",
    [
        ({"top_k": 10**20}, "top_k"), ({"max_tokens": 2**63}, "max_tokens"), ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"), ({"top_p": float("nan")}, "top_p"), ({"min_p": float("nan")}, "min_p"),
        ({"seed": 2**64}, "seed"), ({"stop": ("x" * 5000,)}, "stop"),
    ],
)
def test_every_sampling_field_is_bounded_above_and_nan_is_refused(fields, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**fields)


@pytest.mark.parametrize("seed", [None, 0, 7, MAX_SEED])
def test_with_seed_is_replace_of_the_seed_alone(seed):
    params = SamplingParams(max_tokens=9, temperature=GREEDY_EPS / 2, top_k=3, stop_token_ids=(4, 5), stop=("x",), seed=1, top_logprobs=2)
    copy = params.with_seed(seed)
    assert copy == dataclasses.replace(params, seed=seed) and type(copy) is SamplingParams
    assert all(getattr(copy, f.name) is getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "seed")


@pytest.mark.parametrize("seed", [-1, MAX_SEED + 1, float("nan")])
def test_with_seed_refuses_what_replace_refuses_with_its_message(seed):
    with pytest.raises(ValueError) as replaced:
        dataclasses.replace(SamplingParams(), seed=seed)
    with pytest.raises(ValueError) as seeded:
        SamplingParams().with_seed(seed)
    assert str(seeded.value) == str(replaced.value)
