"""The generative reward model: template, score parsing, failures as logged None, plugins, a tiny model."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tandemrl.rewards.judge import GenerativeJudge, JudgeConfig, build_judge, parse_score
from tandemrl.types import Completion, SamplingParams


class Replies:
    """A generator that answers every prompt with `text` (or raises), recording the prompts it saw."""

    def __init__(self, tokenizer, text: str | None):
        self.tokenizer, self.text, self.prompts = tokenizer, text, []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        self.prompts.append(self.tokenizer.decode(prompt_ids))
        if self.text is None:
            raise ConnectionError("judge server is down")
        ids = self.tokenizer(self.text, add_special_tokens=False)["input_ids"]
        return Completion(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", policy_versions=[0] * len(ids))


def test_parse_score_scales_the_last_score():
    assert parse_score("ok. Score: 7") == 0.7
    assert parse_score("score=3, no, Score: 12") == 1.0
    assert parse_score("I cannot rate this") is None


def test_judge_sees_the_whole_conversation_and_scores_it(tiny_tokenizer):
    generator = Replies(tiny_tokenizer, "Score: 8")
    judge = GenerativeJudge(generator=generator, tokenizer=tiny_tokenizer)
    conversation = [{"role": "assistant", "content": "<tool_call>x</tool_call>"}, {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]
    scores = asyncio.run(judge(["what is 6*7?", "hi"], [conversation, "hello"]))
    assert scores == [0.8, 0.8]
    assert "what is 6*7?" in generator.prompts[0] and "tool: 42" in generator.prompts[0]


@pytest.mark.parametrize("reply, reason", [(None, "ConnectionError"), ("no number here", "has no score")])
def test_judge_failures_are_a_logged_none(tiny_tokenizer, caplog, reply, reason):
    judge = GenerativeJudge(generator=Replies(tiny_tokenizer, reply), tokenizer=tiny_tokenizer)
    with caplog.at_level(logging.WARNING, logger="tandemrl.rewards.judge"):
        assert asyncio.run(judge(["p"], ["c"])) == [None]
    assert reason in caplog.text


def test_plugin_class_is_built_with_the_generator_and_tokenizer(tmp_path, tiny_tokenizer):
    (tmp_path / "myjudge.py").write_text(
        "from tandemrl.rewards.judge import GenerativeJudge\n"
        "class Strict(GenerativeJudge):\n"
        "    def parse(self, reply):\n"
        "        return 1.0 if 'yes' in reply else 0.0\n"
    )
    config = JudgeConfig(reward_model_plugin=f"{tmp_path / 'myjudge.py'}:Strict")
    judge = build_judge(config, generator=Replies(tiny_tokenizer, "yes"), tokenizer=tiny_tokenizer)
    assert asyncio.run(judge(["p"], ["c"])) == [1.0]


def test_template_file_needs_both_fields(tmp_path):
    (tmp_path / "t.txt").write_text("rate {completion}")
    with pytest.raises(ValueError, match="write {prompt} and {completion}"):
        build_judge(JudgeConfig(reward_model="m", reward_model_template=str(tmp_path / "t.txt")), generator=None, tokenizer=None)


def test_a_tiny_model_judges_in_process_without_crashing(tiny_model_dir, tiny_tokenizer):
    """A random tiny judge rarely writes a score: every value is a score in [0, 1] or a logged None."""
    from tandemrl.generation.base import EngineConfig
    from tandemrl.generation.factory import build_generator

    generator = build_generator(EngineConfig(model=tiny_model_dir, device="cpu", max_model_len=256), tokenizer=tiny_tokenizer)
    try:
        judge = build_judge(JudgeConfig(reward_model=tiny_model_dir, reward_model_max_tokens=8), generator=generator, tokenizer=tiny_tokenizer)
        scores = asyncio.run(judge(["2+2?", [{"role": "user", "content": "hi"}]], ["4", [{"role": "assistant", "content": "hello"}]]))
    finally:
        asyncio.run(generator.close())
    assert len(scores) == 2 and all(s is None or 0 <= s <= 1 for s in scores)
