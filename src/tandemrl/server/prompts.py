"""Turns a request's prompt (token ids, text, or chat messages) into checked token ids.

Invariant: what leaves here is a non-empty list of in-vocabulary ids that, with max_tokens, fits in
max_model_len; anything else is a ValueError naming the problem (answered 400). Text is checked before
the tokenizer sees it (at most max_prompt_chars characters per request, all its prompts together, counted
before any is rendered or tokenized: 30 prompts just under the cap each cost 123 s of tokenizing before
their 400; valid Unicode: a lone surrogate made the tokenizer raise TypeError, a 500), and
`encode_off_loop` tokenizes in a worker thread, so a long prompt never stalls the event loop (every stream
and /health with it).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Sequence
from typing import Any

from tandemrl.data.prompts import cuts_at_word_ends, encode_at_most, lone_surrogate
from tandemrl.types import SamplingParams


TEMPLATE_OWN = ("self", "messages", "tools", "documents", "add_generation_prompt")  # what transformers hands the template itself


class Prompter:
    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int, max_prompt_chars: int = 1_000_000):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_prompt_chars
        self._cuttable = cuts_at_word_ends(tokenizer)

    def encode(
        self, *, prompt_ids: list[int] | None = None, prompt: str | None = None, messages: list[dict] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None, max_tokens: int = 1,
    ) -> list[int]:
        """A text is tokenized only as far as it takes to tell it leaves no room for `max_tokens` in
        max_model_len (a ValueError then): a prompt of 900 K characters took 5 s of a worker thread to learn
        it was too long, and 8 of them held a short request beside them 4.6 s."""
        if prompt_ids is not None:
            return prompt_ids
        if prompt is not None:
            return self._encode_within(self.checked_text(prompt), max_tokens, add_special_tokens=True)
        text = self.chat_text(messages or [], chat_template_kwargs or {})
        return self._encode_within(self.checked_text(text), max_tokens, add_special_tokens=False)

    def _encode_within(self, text: str, max_tokens: int, *, add_special_tokens: bool) -> list[int]:
        most = max(0, self.max_model_len - max_tokens)  # 0: only an empty prompt passes, to check's own 400
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=add_special_tokens)
        ids = encode_at_most(encode, text, most, cuttable=self._cuttable)
        if ids is None:
            raise ValueError(
                f"prompt (more than {most} tokens) + max_tokens ({max_tokens}) > max_model_len ({self.max_model_len}); "
                "shorten the prompt or lower max_tokens"
            )
        return ids

    async def encode_off_loop(self, **prompt: Any) -> list[int]:
        """`encode`, in a worker thread when there is text to tokenize."""
        if prompt.get("prompt_ids") is not None:
            return self.encode(**prompt)
        return await asyncio.to_thread(self.encode, **prompt)

    def check_request_chars(self, *texts: Any) -> None:
        """Raises ValueError when one request's text (prompt strings, chat messages, template variables:
        every string in them) has more than max_prompt_chars characters in all. Cheap: called before any
        prompt is rendered or tokenized, so a request over the cap costs no tokenizing.

        Example (cap 10): check_request_chars(["abcdef", "ghijkl"]) raises; check_request_chars([1, 2, 3]) passes."""
        total = sum(map(_num_chars, texts))
        if total > self.max_prompt_chars:
            raise ValueError(
                f"the request's prompt text has {total} characters in all; this server takes at most {self.max_prompt_chars} per request "
                "(--max_prompt_chars): send fewer or shorter prompts per request, or token ids (prompt_ids)"
            )

    def checked_text(self, text: str) -> str:
        if len(text) > self.max_prompt_chars:
            raise ValueError(f"the prompt has {len(text)} characters; this server takes at most {self.max_prompt_chars} (--max_prompt_chars)")
        at = lone_surrogate(text)
        if at is not None:
            raise ValueError(f"the prompt is not valid Unicode: a lone surrogate at character {at}")
        return text

    def chat_text(self, messages: list[dict], chat_template_kwargs: dict[str, Any]) -> str:
        """The chat template's text of `messages`, with a request's chat_template_kwargs (vLLM's field):
        template variables only, never apply_chat_template's own arguments (a template, tokenize, ...) nor
        the variables it sets itself (messages: a 500 when given)."""
        reserved = {*inspect.signature(self.tokenizer.apply_chat_template).parameters, *TEMPLATE_OWN}
        own = reserved & set(chat_template_kwargs)
        if own:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(own))}: give the template's own variables")
        flat = [{**m, "content": _text_of(m.get("content"))} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(flat, add_generation_prompt=True, tokenize=False, **chat_template_kwargs)
        except Exception as error:  # jinja raises its own types for messages the template rejects
            raise ValueError(f"the chat template rejected the messages: {error}") from None

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = self._outside_vocabulary(prompt_ids) + self._outside_vocabulary(params.stop_token_ids)
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) > max_model_len ({self.max_model_len}); "
                "shorten the prompt or lower max_tokens"
            )

    def _outside_vocabulary(self, token_ids: Sequence[int]) -> list[int]:
        """Ids not in [0, vocab_size), found by min and max at C speed first (a Python walk of a body's 4 M ids
        held the event loop 0.3 s). Example (vocab 10): [3, 12, -1] -> [12, -1]; [3, 4] -> []."""
        if not token_ids or (min(token_ids) >= 0 and max(token_ids) < self.vocab_size):
            return []
        return [i for i in token_ids if not 0 <= i < self.vocab_size]

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _num_chars(value: Any) -> int:
    """Characters of every string in `value` (nested lists and dicts: values, not keys; token ids count 0)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(map(_num_chars, value.values()))
    if isinstance(value, (list, tuple)) and value and not isinstance(value[0], int):  # token ids: not walked
        return sum(map(_num_chars, value))
    return 0


def _text_of(content: Any) -> str:
    """OpenAI content: a string, None, or a list of parts of which the text ones are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
