"""A request's prompt into token ids: chat messages through the template with the request's kwargs."""

from __future__ import annotations

import copy

import pytest

from tandemrl.server.openai import ChatRequest
from tandemrl.server.prompts import Prompter
from tandemrl.server.wire import GenerateRequest

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def test_chat_template_kwargs_of_a_request_reach_the_template(tiny_tokenizer):
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = TEMPLATE
    prompter = Prompter(tokenizer, vocab_size=len(tokenizer), max_model_len=512)
    messages = [{"role": "user", "content": "hi"}]
    off = prompter.encode(messages=messages, chat_template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.decode(prompter.encode(messages=messages)).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="may not set tokenize"):  # template variables only
        prompter.encode(messages=messages, chat_template_kwargs={"tokenize": True})
    # both routes take the field under vLLM's name
    assert GenerateRequest(messages=messages, chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs
    assert ChatRequest(messages=messages, chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs


@pytest.mark.parametrize("name", ["messages", "self", "tools", "add_generation_prompt"])
def test_chat_template_kwargs_may_not_set_what_the_template_is_given(tiny_tokenizer, name):
    prompter = Prompter(tiny_tokenizer, vocab_size=len(tiny_tokenizer), max_model_len=512)
    with pytest.raises(ValueError, match=f"chat_template_kwargs may not set {name}"):
        prompter.encode(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={name: 1})


def test_a_long_prompt_is_refused_from_a_prefix_exactly_where_its_whole_would_be(tiny_tokenizer):
    """Past 4 characters per token of room, a prompt is measured from prefixes cut at word ends: refused when
    its whole would not fit beside max_tokens, served when it would, to the token."""
    text = "the quick brown fox jumps over 12345 lazy dogs; " * 100
    n = len(tiny_tokenizer.encode(text))
    for room, fits in ((n, True), (n - 1, False), (n // 10, False)):
        prompter = Prompter(tiny_tokenizer, vocab_size=len(tiny_tokenizer), max_model_len=room + 5)
        if fits:
            assert prompter.encode(prompt=text, max_tokens=5) == tiny_tokenizer.encode(text)
        else:
            with pytest.raises(ValueError, match=rf"prompt \(more than {room} tokens\) \+ max_tokens \(5\) > max_model_len \({room + 5}\)"):
                prompter.encode(prompt=text, max_tokens=5)
    with pytest.raises(ValueError, match=r"more than 0 tokens\) \+ max_tokens \(5\)"):
        Prompter(tiny_tokenizer, vocab_size=len(tiny_tokenizer), max_model_len=5).encode(prompt=text, max_tokens=5)
