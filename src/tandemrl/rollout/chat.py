"""Chat turns in tokens, and tool calls out of the model's text.

Invariant (token-in, token-out): sampled tokens are never re-tokenised. After an assistant turn only
the environment's messages are rendered, as the chat template's token delta: the text the template puts
after an assistant message (e.g. ChatML's "\\n" after "<|im_end|>", or the whole "<|im_end|>\\n" when
the model stopped otherwise), then those messages, then the next assistant turn's opening.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandemrl.plugins import load_object
from tandemrl.types import Message

_MARK = "@@tandem-turn@@"  # content of the stand-in assistant message the delta is cut after
_STAND_IN = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]


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
    except json.JSONDecodeError as error:
        return ToolCall(error=f"malformed tool call, not JSON ({error.msg}); write {{\"name\": ..., \"arguments\": {{...}}}}")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='malformed tool call: give {"name": "<tool>", "arguments": {...}}')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
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
    """The token deltas of one tokenizer's chat template, computed once per run."""

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn rollouts need a tokenizer with a chat template; use an -Instruct model")
        self.tokenizer, self.tools = tokenizer, tools or None
        self._base = self._render(_STAND_IN, add_generation_prompt=False)
        suffix = self._base[self._base.rindex(_MARK) + len(_MARK) :]
        suffix_ids = self._encode(suffix)
        self.end_of_turn_id: int | None = suffix_ids[0] if suffix_ids else None
        """The token that ends an assistant turn (ChatML: <|im_end|>); generation stops on it."""
        end_text = self.tokenizer.decode(suffix_ids[:1])
        self._suffix = suffix
        self._after_end = suffix[len(end_text) :] if end_text and suffix.startswith(end_text) else suffix

    def delta_ids(self, messages: list[Message], *, last_sampled_id: int | None) -> list[int]:
        """Context tokens that follow a sampled assistant turn: its closing, `messages`, the next opening.

        Example (ChatML, turn ended by <|im_end|>), [tool "7"] -> ids of
        "\\n<|im_start|>user\\n<tool_response>\\n7\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"
        """
        full = self._render(_STAND_IN + messages, add_generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError("the chat template renders earlier turns differently once later ones follow; "
                             "multi-turn rollouts need a template whose past turns do not change")
        closing = self._after_end if last_sampled_id == self.end_of_turn_id else self._suffix
        return self._encode(closing + full[len(self._base) :])

    def _render(self, messages: list[Message], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def _encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
