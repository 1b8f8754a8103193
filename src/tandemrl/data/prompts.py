"""Prompts into token ids: a string is tokenized as is, chat messages through the chat template.

Invariant: the ids returned are exactly what the Generator receives; nothing re-tokenizes them later.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from tandemrl.types import Message


def encode_prompt(tokenizer: Any, prompt: str | list[Message], *, tools: list[dict] | None = None, **chat_template_kwargs: Any) -> list[int]:
    """Token ids of one prompt, ready for generation.

    A string gets no special tokens added (as TRL does); messages get the chat template with the
    assistant turn opened (`add_generation_prompt=True`), the `tools` schemas, if any, shown as the
    template shows them, and `chat_template_kwargs` (e.g. Qwen3's enable_thinking=False) passed to it.
    Example (ChatML): [{"role": "user", "content": "hi"}] -> ids of "<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n"
    """
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template, so chat-message prompts cannot be encoded; "
            "use a model with a chat template (an -Instruct model) or give plain string prompts"
        )
    ids = tokenizer.apply_chat_template(prompt, tools=tools or None, add_generation_prompt=True, tokenize=True, **chat_template_kwargs)
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def lone_surrogate(text: str) -> int | None:
    """The position of the first lone surrogate in `text` (half of a UTF-16 pair: JSON's "\\ud800" decodes to
    one), or None. No tokenizer takes such text (transformers' fast ones raise TypeError) and UTF-8 cannot
    write it, so it is refused where text comes in (a dataset row, a server's request).

    Example: lone_surrogate("ok \\ud800") -> 3; lone_surrogate("ok") -> None
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return error.start
    return None


def check_prompt_length(ids: list[int], max_prompt_length: int, index: int, source: str) -> None:
    """Raises ValueError when row `index` of `source` (e.g. "--eval_dataset e.jsonl") has a prompt of more than
    `max_prompt_length` tokens. A prompt is never truncated (TRL 1.16 has no max_prompt_length and keeps it whole;
    older TRL cut it from the left, silently): the run stops before its first step, naming the row."""
    if len(ids) > max_prompt_length:
        raise ValueError(
            f"prompt of row {index} of {source} has {len(ids)} tokens, more than --max_prompt_length {max_prompt_length} "
            "(a prompt is never truncated); raise --max_prompt_length, or shorten or drop the row"
        )


_WORD_END = re.compile(r"[^\W_](?=\s)")  # a letter or digit before whitespace: where encode_at_most may cut


def cuts_at_word_ends(tokenizer: Any) -> bool:
    """Whether encode_at_most may measure `tokenizer`'s text from prefixes: not when an added token holds
    whitespace (it could span a cut)."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    return not any(re.search(r"\s", token) for token in added)


def encode_at_most(encode: Callable[[str], list[int]], text: str, most: int, *, cuttable: bool = True) -> list[int] | None:
    """encode(text), or None when it has more than `most` tokens, told from growing prefixes of the text where
    it is long, so a text of megabytes is never tokenized whole to learn it is too long (5 MB: ~8 s).

    Each prefix ends at a word's end before whitespace: a tokenizer that splits words at whitespace before its
    model runs (byte-level BPE, Metaspace, WordPiece) tokenizes the words before the cut as it does in the
    whole text, so a prefix over `most` tokens is exact proof the whole is. Specials an encode adds (a BOS) are
    in the prefix's count and the whole's alike. `cuttable` False (cuts_at_word_ends): tokenized whole.

    Example: encode_at_most(encode, "word " * 10**6, 100) -> None, after encoding ~500 characters
    """
    end = 4 * (most + 1)  # characters: a token has at least one (specials aside)
    while cuttable and end < len(text):
        cut = _WORD_END.search(text, end)
        if cut is None:
            break
        if len(encode(text[: cut.end()])) > most:
            return None
        end = 2 * cut.end()
    ids = encode(text)
    return ids if len(ids) <= most else None
