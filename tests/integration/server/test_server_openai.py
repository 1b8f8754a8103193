"""The OpenAI routes of a real server, through the official `openai` client: completions and chat,
plain and streaming, with tandem's token ids and policy versions on each choice."""

from __future__ import annotations

import openai
import pytest


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(oai, tiny_model_dir):
    assert [m.id for m in oai.models.list().data] == [tiny_model_dir]


def test_completions_plain_and_streaming_agree_under_greedy(oai, tiny_model_dir):
    args = dict(model=tiny_model_dir, prompt="the answer", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = oai.completions.create(**args, logprobs=1)
    choice = plain.choices[0]
    assert choice.finish_reason == "length" and len(choice.logprobs.token_logprobs) == 6
    assert plain.usage.completion_tokens == 6 and choice.model_extra["policy_versions"] == [0] * 6
    streamed = "".join(chunk.choices[0].text for chunk in oai.completions.create(**args, stream=True))
    assert streamed == choice.text


def test_chat_plain_and_streaming_with_n(oai, tiny_model_dir):
    args = dict(model=tiny_model_dir, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, n=2)
    plain = oai.chat.completions.create(**args, logprobs=True, extra_body={"ignore_eos": True})
    assert [c.index for c in plain.choices] == [0, 1] and plain.choices[0].message.role == "assistant"
    assert plain.choices[0].message.content == plain.choices[1].message.content  # greedy
    assert len(plain.choices[0].logprobs.content) == 5
    texts = {0: "", 1: ""}
    for chunk in oai.chat.completions.create(**args, stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: plain.choices[0].message.content, 1: plain.choices[1].message.content}


def test_bad_openai_request_is_a_400_with_openais_error_object(oai, server, tiny_model_dir):
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        oai.completions.create(model=tiny_model_dir, prompt="x", max_tokens=100000)
    with pytest.raises(openai.BadRequestError, match="messages") as invalid:
        oai.chat.completions.create(model=tiny_model_dir, messages=[], max_tokens=2)
    assert invalid.value.body["param"] == "messages" and invalid.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="temperature: Input should be less than or equal to") as invalid:
        oai.completions.create(model=tiny_model_dir, prompt="x", temperature=1e9)
    assert invalid.value.body["param"] == "temperature"
    raw = server.post("/v1/completions", {"prompt": "x", "top_p": 0})
    assert raw.status_code == 400 and set(raw.json()["error"]) == {"message", "type", "param", "code"}


def test_completions_max_tokens_defaults_to_16_as_openais(oai, tiny_model_dir):
    answer = oai.completions.create(model=tiny_model_dir, prompt="the answer", extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 16 and answer.choices[0].finish_reason == "length"


def test_text_streams_as_it_is_sampled_and_stops_as_plain_does(oai, tiny_model_dir, backend):
    args = dict(model=tiny_model_dir, prompt="the answer", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    plain = oai.completions.create(**args).choices[0].text
    chunks = list(oai.completions.create(**args, stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == plain
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-2].choices[0].model_extra["token_ids"]
    if backend == "engine":  # it streams tokens; hf hands over whole completions
        assert sum(1 for t in texts if t) > 1
    stop = plain[len(plain) // 2 :][:2]
    stopped = oai.completions.create(**args, stop=[stop]).choices[0].text
    assert stopped == plain[: plain.find(stop)]
    assert "".join(c.choices[0].text for c in oai.completions.create(**args, stop=[stop], stream=True)) == stopped


def test_streaming_with_logprobs_sends_the_text_with_its_logprobs(oai, tiny_model_dir):
    args = dict(model=tiny_model_dir, prompt="the answer", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    with_text = [c.choices[0] for c in oai.completions.create(**args, stream=True, logprobs=0) if c.choices[0].text]
    assert len(with_text) == 1 and len(with_text[0].logprobs.token_logprobs) == 5
    assert with_text[0].text == oai.completions.create(**args).choices[0].text


def test_logprobs_return_real_top_alternatives(oai, tiny_model_dir):
    args = dict(model=tiny_model_dir, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = oai.completions.create(prompt="the answer", logprobs=3, **args).choices[0].logprobs
    assert len(plain.top_logprobs) == 4 and all(len(top) == 3 for top in plain.top_logprobs)
    for token, logprob, top in zip(plain.tokens, plain.token_logprobs, plain.top_logprobs):
        best = max(top.values())
        assert list(top.values()) == sorted(top.values(), reverse=True) and best <= 0
        assert top.get(token) == pytest.approx(best, abs=1e-4) and logprob == pytest.approx(best, abs=1e-4)  # greedy: the best one
    chat = oai.chat.completions.create(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2, **args)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob and c.top_logprobs[0].token == c.token for c in content)


def test_what_a_client_asks_is_never_silently_ignored(oai, server, tiny_model_dir):
    import httpx

    with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' is not served here") as missing:
        oai.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert missing.value.body["code"] == "model_not_found"
    chat = dict(model=tiny_model_dir, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(openai.BadRequestError, match="tools: this server renders no tool schemas"):
        oai.chat.completions.create(**chat, tools=[tool])
    with pytest.raises(openai.BadRequestError, match="response_format 'json_object'"):
        oai.chat.completions.create(**chat, response_format={"type": "json_object"})
    assert oai.chat.completions.create(**chat, response_format={"type": "text"}).choices[0].message.role == "assistant"
    raw = httpx.post(server.url + "/v1/completions", content=b'{"prompt": ', headers={"Content-Type": "application/json"}, timeout=30)
    assert raw.status_code == 400 and raw.json()["error"]["param"] is None and "not valid JSON" in raw.json()["error"]["message"]


def test_fields_that_would_change_the_answer_are_refused_not_ignored(oai, tiny_model_dir):
    """OpenAI's fields this server does not apply, set to anything but their no-op value, are a 400 naming them
    (functions, a penalty, logit_bias, suffix, best_of were dropped silently: the answer ignored them)."""
    chat = dict(model=tiny_model_dir, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    text = dict(model=tiny_model_dir, prompt="x", max_tokens=2)
    refused = [
        (oai.chat.completions.create, chat, {"functions": [{"name": "f", "parameters": {"type": "object", "properties": {}}}]}, "functions"),
        (oai.chat.completions.create, chat, {"tool_choice": "required"}, "tool_choice 'required' without tools"),
        (oai.chat.completions.create, chat, {"frequency_penalty": 0.5}, "frequency_penalty"),
        (oai.chat.completions.create, chat, {"presence_penalty": -1}, "presence_penalty"),
        (oai.completions.create, text, {"logit_bias": {"5": 10}}, "logit_bias"),
        (oai.completions.create, text, {"suffix": "end"}, "suffix"),
        (oai.completions.create, text, {"best_of": 3}, "best_of"),
    ]
    for create, base, extra, name in refused:
        with pytest.raises(openai.BadRequestError, match=name):
            create(**base, **extra)
    for create, base, noop in ((oai.chat.completions.create, chat, {"frequency_penalty": 0, "presence_penalty": 0, "tool_choice": "none", "logit_bias": {}}),
                               (oai.completions.create, text, {"best_of": 1, "suffix": ""})):  # fmt: skip
        assert create(**base, **noop).choices[0].finish_reason in ("stop", "length")


def test_null_is_unset_as_in_openais_api(oai, tiny_model_dir):
    """OpenAI's API (and the openai client's types: n: Optional[int], stream, logprobs, echo) take null for
    an unset field; n, stream, echo and chat's logprobs were a 400 ('n: Input should be a valid integer')."""
    chat = dict(model=tiny_model_dir, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    text = dict(model=tiny_model_dir, prompt="x", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    nulls = dict(n=None, stream=None, logprobs=None, seed=None, stop=None, top_p=None, stream_options=None)
    plain = oai.chat.completions.create(**chat, **nulls, top_logprobs=None)
    assert len(plain.choices) == 1 and plain.choices[0].logprobs is None
    assert plain.choices[0].message.content == oai.chat.completions.create(**chat).choices[0].message.content
    answer = oai.completions.create(**text, **nulls, echo=None, best_of=None, suffix=None)
    assert len(answer.choices) == 1 and answer.choices[0].text == oai.completions.create(**text).choices[0].text
    with pytest.raises(openai.BadRequestError, match="messages: Field required"):
        oai.chat.completions.create(model=tiny_model_dir, messages=None, max_tokens=2)


def test_streaming_sends_usage_last_when_asked(oai, tiny_model_dir):
    args = dict(model=tiny_model_dir, prompt="the answer", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}, stream=True)
    chunks = list(oai.completions.create(**args, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4 and chunks[-1].usage.prompt_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])
    assert all(c.usage is None for c in oai.completions.create(**args))  # not asked: no usage chunk


@pytest.mark.parametrize("name", ["messages", "self", "add_generation_prompt"])
def test_chat_template_kwargs_naming_what_the_template_is_given_is_a_400(oai, server, tiny_model_dir, name):
    """`messages` or `self` in chat_template_kwargs were a 500 on both routes (they collided with arguments)."""
    chat = dict(model=tiny_model_dir, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=f"chat_template_kwargs may not set {name}"):
        oai.chat.completions.create(**chat, extra_body={"chat_template_kwargs": {name: 1}})
    raw = server.post("/generate", {"messages": chat["messages"], "max_tokens": 2, "chat_template_kwargs": {name: 1}})
    assert raw.status_code == 400 and f"may not set {name}" in raw.json()["detail"], raw.text


def test_a_stop_list_over_the_limit_is_refused_for_its_length(oai, tiny_model_dir):
    with pytest.raises(openai.BadRequestError, match="at most 16 items") as refused:
        oai.completions.create(model=tiny_model_dir, prompt="x", max_tokens=2, stop=[str(i) for i in range(17)])
    assert refused.value.body["param"].startswith("stop")
    assert oai.completions.create(model=tiny_model_dir, prompt="x", max_tokens=2, stop="\n").choices[0].finish_reason in ("stop", "length")


# (field, a value of the wrong JSON type, the type the field takes): each was coerced ("5" -> 5, true -> 1, 1 -> true)
WRONG_TYPES = [
    ("max_tokens", "5", "integer"), ("max_tokens", True, "integer"), ("max_tokens", 5.5, "integer"), ("n", "2", "integer"),
    ("seed", "7", "integer"), ("top_k", "3", "integer"), ("stop_token_ids", ["1"], "integer"), ("temperature", "0.5", "number"),
    ("top_p", True, "number"), ("min_p", "0", "number"), ("repetition_penalty", "1", "number"), ("stream", "false", "boolean"),
    ("stream", 0, "boolean"), ("ignore_eos", 1, "boolean"), ("ignore_eos", "true", "boolean"),
    ("stream_options", {"include_usage": "false"}, "boolean"),
]  # fmt: skip


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_value_of_the_wrong_json_type_is_a_400_naming_the_field_and_its_type(oai, server, tiny_model_dir, route):
    """OpenAI's API answers 400 to `"max_tokens": "5"`; the server took it as 5 (and `true` as 1, `1` as true)."""
    create = oai.completions.create if route == "completions" else oai.chat.completions.create
    base = dict(model=tiny_model_dir, **({"prompt": "x"} if route == "completions" else {"messages": [{"role": "user", "content": "hi"}]}))
    wrong = [*WRONG_TYPES, ("logprobs", True, "integer") if route == "completions" else ("logprobs", 1, "boolean")]
    wrong += [("best_of", "1", "integer"), ("echo", 0, "boolean")] if route == "completions" else [("max_completion_tokens", "2", "integer"), ("top_logprobs", 1.5, "integer")]
    for name, value, kind in wrong:
        with pytest.raises(openai.BadRequestError, match=f"{name}.*{kind}") as refused:
            create(**base, max_tokens=2, extra_body={name: value})
        assert refused.value.body["param"].split(".")[0] == name and "\n" not in refused.value.body["message"], (name, value)
    with pytest.raises(openai.BadRequestError, match="^Error code: 400 - max_tokens: Input should be a valid integer, not a string$"):
        create(**base, extra_body={"max_tokens": "5"})
    # what JSON's types allow stays served: an int where a number is asked, an integral number where an integer is, null (unset)
    for fine in ({"temperature": 0, "top_p": 1, "max_tokens": 2.0}, {"max_tokens": None, "n": 1.0, "seed": None}):
        assert create(**base, extra_body={**fine, "ignore_eos": True}).choices[0].finish_reason == "length", fine


def test_native_routes_refuse_a_value_of_the_wrong_json_type_naming_the_field(server):
    """/generate and /generate_batch coerced as the OpenAI routes did; they refuse it with their schema errors' 422."""
    wrong = [w for w in WRONG_TYPES if not w[0].startswith("stream")]
    for name, value, kind in [*wrong, ("is_async", "true", "boolean"), ("prompt_ids", ["1"], "integer")]:
        body = {"prompt": "x", "max_tokens": 2, name: value} if name != "prompt_ids" else {"prompt_ids": value}
        answer = server.post("/generate", body)
        assert answer.status_code == 422 and answer.json()["detail"][0]["loc"][1] == name and kind in answer.text, (name, answer.text)
        if name not in ("is_async", "n"):  # not fields of a batch item
            batch = server.post("/generate_batch", {"items": [{"request_id": "a", **body}]})
            assert batch.status_code == 422 and batch.json()["detail"][0]["loc"][3] == name and kind in batch.text, (name, batch.text)
    assert server.post("/collect", {"request_ids": ["x"], "timeout_s": "1"}).status_code == 422
    served = server.post("/generate", {"prompt": "x", "max_tokens": 2.0, "temperature": 0, "ignore_eos": True})
    assert served.json()["results"][0]["finish_reason"] == "length", served.text
