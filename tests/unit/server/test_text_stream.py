"""TextStream: the safe text deltas of a streamed choice (no half characters, no start of a stop string)."""

from __future__ import annotations

import pytest

from tandemrl.server.openai import TextStream

BYTES = "Hi there, é😀\n\nrest".encode()  # one "token" per byte: é and 😀 span several


def decode(token_ids: list[int]) -> str:
    return bytes(token_ids).decode(errors="replace")


def stream(stop: tuple[str, ...]) -> tuple[list[str], str]:
    texts = TextStream(decode, stop)
    deltas = [texts.push(b) for b in BYTES]
    full = decode(list(BYTES))
    cut = min((full.find(s) for s in stop if s in full), default=len(full))
    return deltas, "".join(deltas) + texts.finish(full[:cut])


def test_deltas_never_hold_half_a_character_and_add_up_to_the_text():
    deltas, total = stream(())
    assert total == BYTES.decode()
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d) < len(BYTES)  # the multi-byte characters waited for their last byte


@pytest.mark.parametrize("stop", [("\n\n",), (", é",), ("rest", "\n")])
def test_nothing_from_a_stop_string_on_is_ever_sent(stop):
    deltas, total = stream(stop)
    full = BYTES.decode()
    expected = full[: min(full.find(s) for s in stop)]
    assert "".join(deltas) == expected[: len("".join(deltas))]  # every delta was a prefix of the trimmed text
    assert total == expected


def test_a_token_whose_text_depends_on_its_neighbour_is_decoded_with_it():
    pieces = {1: "▁Hello", 2: "▁world", 3: "!"}

    def sentencepiece_like(ids: list[int]) -> str:  # a leading "▁" is a space, except at the very start
        return "".join(pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")

    texts = TextStream(sentencepiece_like, ())
    assert [texts.push(i) for i in (1, 2, 3)] == ["Hello", " world", "!"]
