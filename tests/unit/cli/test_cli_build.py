"""How `tandem train` sizes its colocated engine: for one step's sequences, each as long as it may get."""

from __future__ import annotations

import asyncio

import pytest

from tandemrl.cli.build import _eval_set, _judge, _policy, _rollout_side
from tandemrl.cli.train import parse


def test_colocated_engine_holds_one_steps_sequences_at_full_length():
    config, _ = parse(["--num_prompts_per_step", "3", "--num_generations", "5", "--device", "cpu"])
    tokenizer, model = _policy(config, None)
    generator, _ = _rollout_side(config, config.resolve(), model, tokenizer)
    try:
        max_len = config.data.max_prompt_length + config.algo.max_completion_length
        assert generator.config.max_num_seqs == 15 and generator.max_model_len == max_len
        assert len(generator.blocks.blocks) == 15 * -(-max_len // generator.config.block_size) + 1
    finally:
        asyncio.run(generator.close())


def test_generator_device_places_the_colocated_engine():
    config, _ = parse(["--num_prompts_per_step", "2", "--num_generations", "2", "--device", "cpu", "--generator_device", "cpu"])
    tokenizer, model = _policy(config, None)
    generator, _ = _rollout_side(config, config.resolve(), model, tokenizer)
    try:
        assert generator.config.device == "cpu" and generator.device.type == "cpu"
    finally:
        asyncio.run(generator.close())


def test_an_eval_file_is_read_whole_at_the_default_split_and_another_split_of_it_is_refused(tmp_path):
    """--eval_dataset FILE is the evaluation set (the flag's default split 'test' names no split of a file); an
    --eval_dataset_split given on a file is refused as --dataset_split is (on main it was ignored)."""
    path = tmp_path / "e.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    config, _ = parse(["--dataset", str(path), "--eval_dataset", str(path)])
    assert [e.prompt for e in _eval_set(config).examples] == ["a", "b"]
    config, _ = parse(["--dataset", str(path), "--eval_dataset", str(path), "--eval_dataset_split", "validation"])
    with pytest.raises(ValueError, match="is one file, whose one split is 'train' .* not 'validation'"):
        _eval_set(config)


def test_a_rank_that_scores_nothing_builds_no_judge():
    config, _ = parse(["--reward_model", "no/such-judge", "--device", "cpu"])
    with pytest.raises(OSError):  # a rank that scores loads the judge
        _judge(config, config.resolve(), scores=True)
    generator, judge = _judge(config, config.resolve(), scores=False)  # the others load nothing, and keep its place
    assert generator is None and judge.name == "reward_model"
    with pytest.raises(RuntimeError, match="this rank generates no groups"):
        judge.fn([], [])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max_staleness", "1", "--generator", "hf"], "hf generator shares the trainer's weights"),
        (["--max_staleness", "1", "--sleep_level", "1"], "cannot sleep"),
        (["--max_staleness", "-1"], "--max_staleness must be >= 0"),
    ],
)
def test_max_staleness_rejects_what_cannot_overlap(flags, message):
    with pytest.raises(ValueError, match=message):
        parse(flags)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--offload_model", "--generator", "hf"], "hf generator runs the trainer's own model"),
        (["--lora_r", "8", "--generator", "hf"], "hf generator runs the trainer's own model"),
        (["--lora_r", "8", "--beta", "0.04", "--sync_ref_model"], "adapters disabled"),
        (["--lora_r", "8", "--lora_dropout", "0.1"], "--disable_dropout false"),
    ],
)
def test_memory_levers_and_lora_reject_what_cannot_work(flags, message):
    with pytest.raises(ValueError, match=message):
        parse(flags)
