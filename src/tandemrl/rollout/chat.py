"""Chat turns in tokens, and tool calls out of the model's text.

Invariant (token-in, token-out): sampled tokens are never re-tokenised. After an assistant turn only
the environment's messages are rendered, as the chat template's token delta: the template renders a
stand-in conversation whose assistant turn is a marker, followed by those messages, and the delta is
the text after the marker: the assistant turn's closing (e.g. ChatML's "<|im_end|>\\n", less the
"<|im_end|>" when the model sampled it), the messages, the next assistant turn's opening. Cutting
after the marker, not after a render of the stand-in alone, also serves templates that render the last
assistant turn differently from earlier ones (Qwen3's empty <think> block). Every render passes the
run's chat_template_kwargs (e.g. enable_thinking), as the prompt's render did, so the next turn's
opening is the one the first turn had.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandemrl.data.prompts import cuts_at_word_ends, encode_at_most
from tandemrl.plugins import load_object
from tandemrl.threads import in_daemon_thread
from tandemrl.types import Message

_MARK = "@@tandem-turn@@"  # content of the stand-in assistant message the delta is cut after
_TURNS = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
DELTA_CACHE_SIZE = 4096  # distinct environment answers whose token delta is kept
LONG_ANSWER_CHARS = 1 << 16  # answers past this many characters are measured in a thread, from a prefix
# json.dumps(messages, default=repr) without building an encoder every call (~2 us of ~5.5, per answer)
_delta_key = json.JSONEncoder(default=repr).encode
_STAND_INS = ([{"role": "system", "content": "s"}, *_TURNS], _TURNS)  # the second for templates without a system role


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCall:
    """One call parsed from the model's text; `error` set when the call is malformed (then it is the answer)."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""


class ToolCallParser(Protocol):
    """Finds the tool calls in one assistant turn's text; never raises on model output."""

    def parse(self, text: str) -> list[ToolCall]: ...


class HermesParser:
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

    Example: '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>' -> [ToolCall(name="add", arguments={"a": 1})]
    """

    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        return [_parse_json_call(body) for body in self._BLOCK.findall(text)]


def _parse_json_call(body: str) -> ToolCall:
    try:
        call = json.loads(body)
    except (ValueError, RecursionError) as error:  # besides JSONDecodeError: an int past 4300 digits, deep nesting
        reason = error.msg if isinstance(error, json.JSONDecodeError) else str(error).split(";")[0].split(":")[0]
        return ToolCall(error=f"malformed tool call, not JSON ({reason}); write {{\"name\": ..., \"arguments\": {{...}}}}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='malformed tool call: give {"name": "<tool>", "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # still a string: answered as not an object below
            pass
    if not isinstance(arguments, dict):
        return ToolCall(name=call["name"], error="malformed tool call: arguments must be a JSON object")
    return ToolCall(name=call["name"], arguments=arguments)


PARSERS: dict[str, type] = {"hermes": HermesParser}


def build_parser(name: str) -> ToolCallParser:
    """A built-in parser by name, or `module:Class` / `file.py:Class` with a `parse(text)` method."""
    if name in PARSERS:
        return PARSERS[name]()
    if ":" not in name:
        raise ValueError(f"unknown --tool_call_parser {name!r}; use one of {', '.join(PARSERS)} or module:Class")
    return load_object(name, what="tool call parser")()


class ChatFormat:
    """The token deltas of one tokenizer's chat template (and tools), for the turns of a rollout."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, *, chat_template_kwargs: dict[str, Any] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn rollouts need a tokenizer with a chat template; use an -Instruct model")
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # --chat_template_kwargs, at every render
        self._stand_in = _STAND_INS[0] if self._renders(_STAND_INS[0], tools) else _STAND_INS[1]
        for add_generation_prompt in (False, True):  # the template, once: later messages may carry the marker themselves
            if self._render(self._stand_in, add_generation_prompt, tools).count(_MARK) != 1:
                raise ValueError("the chat template does not render an assistant message's content once, as given; "
                                 "multi-turn rollouts need a template that does")
        probe = [{"role": "tool", "content": "x"}]
        same = self._after_mark(probe, True, tools) == self._after_mark(probe, True, None)
        self._tools = None if same else tools or None  # schemas that change nothing after the marker are left out: faster
        closing_ids = self._encode(self._after_mark([{"role": "user", "content": "u"}], False, self._tools))
        self.end_of_turn_id: int | None = closing_ids[0] if closing_ids else None
        """The token that ends an assistant turn (ChatML: <|im_end|>); generation stops on it."""
        self._end_text = self.tokenizer.decode(closing_ids[:1])
        # a render and an encode cost ~0.3 ms, paid on the event loop between a turn and the next, for every
        # rollout; answers repeat (a group's rollouts make the same calls, errors recur), so each distinct
        # answer's delta is computed once (a delta is a function of the messages alone)
        self._deltas: dict[tuple[str, bool], tuple[int, ...]] = {}
        self._heads: dict[bool, tuple[int, ...]] = {}  # answer_head_ids by whether the turn sampled its end
        self._cuttable = cuts_at_word_ends(tokenizer)  # whether _long_delta may measure from prefixes

    def delta_ids(self, messages: list[Message], *, last_sampled_id: int | None) -> list[int]:
        """Context tokens that follow a sampled assistant turn: its closing, `messages`, the next opening.

        Example (ChatML, turn ended by <|im_end|>), [tool "7"] -> ids of
        "\\n<|im_start|>user\\n<tool_response>\\n7\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"
        """
        sampled_end = last_sampled_id is not None and last_sampled_id == self.end_of_turn_id
        key = (_delta_key(messages), sampled_end)  # key order kept: a template may iterate a dict
        ids = self._deltas.get(key)
        if ids is None:
            text = self._after_mark(messages, True, self._tools)
            if sampled_end and text.startswith(self._end_text):
                text = text[len(self._end_text) :]
            ids = self._deltas[key] = tuple(self._encode(text))
            if len(self._deltas) > DELTA_CACHE_SIZE:
                del self._deltas[next(iter(self._deltas))]  # the oldest answer
        return list(ids)

    async def delta_within(self, messages: list[Message], *, last_sampled_id: int | None, most: int) -> list[int] | None:
        """delta_ids, or None when it has more than `most` tokens. Answers of over LONG_ANSWER_CHARS characters
        (a tool dumping a file) are rendered in a daemon thread and tokenized only as far as it takes to tell:
        a 5 MB answer took ~9 s of the event loop to tokenize whole, stalling every other rollout."""
        if sum(len(str(m.get("content") or "")) for m in messages) <= LONG_ANSWER_CHARS:
            ids = self.delta_ids(messages, last_sampled_id=last_sampled_id)
            return ids if len(ids) <= most else None
        long_delta = functools.partial(self._long_delta, messages, last_sampled_id, most)
        return await in_daemon_thread(long_delta, name="chat-delta")  # no cache: its key would be the whole answer

    def _long_delta(self, messages: list[Message], last_sampled_id: int | None, most: int) -> list[int] | None:
        """The delta of `messages` if it has at most `most` tokens, else None (encode_at_most: from prefixes)."""
        text = self._after_mark(messages, True, self._tools)
        if last_sampled_id is not None and last_sampled_id == self.end_of_turn_id and text.startswith(self._end_text):
            text = text[len(self._end_text) :]
        return encode_at_most(self._encode, text, most, cuttable=self._cuttable)

    def answer_head_ids(self, *, last_sampled_id: int | None) -> list[int]:
        """The head of the next delta that no tool answer changes, less its last token (a tokenizer may
        merge it with the answer's first characters); [] when two answers differ from the first token.

        Example (ChatML, turn not ended by <|im_end|>) -> ids of "<|im_end|>\n<|im_start|>user\n<tool_response>"
        """
        sampled_end = last_sampled_id is not None and last_sampled_id == self.end_of_turn_id
        head = self._heads.get(sampled_end)
        if head is None:
            zero, one = (self.delta_ids([{"role": "tool", "content": c}], last_sampled_id=last_sampled_id) for c in "01")
            same = next((i for i, (a, b) in enumerate(zip(zero, one)) if a != b), min(len(zero), len(one)))
            head = self._heads[sampled_end] = tuple(zero[: max(same - 1, 0)])
        return list(head)

    def _after_mark(self, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        # cut after the stand-in's marker, the first: a later message may carry it too (model-reachable text: a
        # tool's answer, an unknown tool's name echoed); __init__ checked the template renders it once
        full = self._render(self._stand_in + messages, add_generation_prompt, tools)
        return full[full.index(_MARK) + len(_MARK) :]

    def _renders(self, messages: list[Message], tools: list[dict] | None) -> bool:
        from jinja2 import TemplateError

        try:
            self._render(messages, False, tools)
        except TemplateError:  # raise_exception in the template: e.g. a template without a system role
            return False
        return True

    def _render(self, messages: list[Message], add_generation_prompt: bool, tools: list[dict] | None) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False, **self.chat_template_kwargs
        )

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]


def decoder_of(tokenizer: Any) -> Any:
    """`tokenizer.decode`, or for a list of ids the same call without transformers' first walk over it
    (decode checks every id is a number before it calls `_decode`: 4x the cost of a 128-token decode,
    paid by each rollout's every turn on the event loop). The plain `decode` where a tokenizer overrides it.

    Example: decoder_of(tokenizer)([72, 105], skip_special_tokens=True) == tokenizer.decode([72, 105], skip_special_tokens=True)
    """
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:
        return tokenizer.decode
    if not isinstance(tokenizer, PreTrainedTokenizerBase) or type(tokenizer).decode is not PreTrainedTokenizerBase.decode:
        return tokenizer.decode

    def decode(token_ids: list[int], skip_special_tokens: bool = False, **kwargs: Any) -> str:
        return tokenizer._decode(token_ids=list(token_ids), skip_special_tokens=skip_special_tokens, **kwargs)

    return decode
