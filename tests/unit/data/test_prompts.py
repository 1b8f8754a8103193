"""Prompts into token ids with the tiny ChatML tokenizer."""

from __future__ import annotations

import copy
import re

import pytest

from tandemrl.data.prompts import check_prompt_length, encode_prompt


def test_string_prompt_is_tokenized_as_is(tiny_tokenizer) -> None:
    ids = encode_prompt(tiny_tokenizer, "the answer is 42")
    assert tiny_tokenizer.decode(ids) == "the answer is 42"
    assert all(type(i) is int for i in ids)


def test_messages_go_through_the_chat_template_with_the_assistant_turn_open(tiny_tokenizer) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = encode_prompt(tiny_tokenizer, messages)
    expected = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer.decode(ids) == expected
    assert isinstance(ids, list) and all(type(i) is int for i in ids)


def test_chat_template_kwargs_reach_the_template(tiny_tokenizer) -> None:
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is false %} /no_think{% endif %}"
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.decode(encode_prompt(tokenizer, messages)) == "hi"
    assert tokenizer.decode(encode_prompt(tokenizer, messages, enable_thinking=False)) == "hi /no_think"


def test_messages_without_a_chat_template_say_the_fix(tiny_tokenizer) -> None:
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template.*give plain string prompts$"):
        encode_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    assert encode_prompt(tokenizer, "hi") == encode_prompt(tiny_tokenizer, "hi")


def test_prompt_too_long_names_row_dataset_and_flag() -> None:
    check_prompt_length([0] * 512, 512, 17, "--dataset d.jsonl")
    message = (
        "prompt of row 17 of --dataset d.jsonl has 900 tokens, more than --max_prompt_length 512 (a prompt is never "
        "truncated); raise --max_prompt_length, or shorten or drop the row"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_prompt_length([0] * 900, 512, 17, "--dataset d.jsonl")
