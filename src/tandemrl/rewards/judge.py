"""A generative reward model: an LLM judge reads each (prompt, completion) through a prompt template and
its reply is parsed into a score. It is one more reward function, named `reward_model`.

Invariant: the judge never raises on a completion. A failed generation or a reply without a score is a
None reward (not applicable: it adds nothing to the total), logged with the reason.
The judge's Generator (an in-process engine or a rollout server) is built by cli/ and handed in.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from tandemrl.plugins import load_object
from tandemrl.types import Message, SamplingParams

log = logging.getLogger(__name__)

TEMPLATE = (
    "Rate how well the response answers the request, from 0 (useless or wrong) to 10 (correct and complete).\n\n"
    "[Request]\n{prompt}\n\n[Response]\n{completion}\n\n"
    "Reply with one line: Score: N"
)
_SCORE = re.compile(r"score\s*[:=]?\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


@dataclass(kw_only=True)
class JudgeConfig:
    """A generative reward model (LLM judge), scored as the reward function `reward_model`."""

    reward_model: str = ""
    """LLM judge: hub id or directory. Runs in an in-process engine, or on --reward_model_url (then only its tokenizer loads here)."""
    reward_model_url: str = ""
    """A `tandem rollout` server serving the judge, e.g. http://127.0.0.1:8001."""
    reward_model_plugin: str = ""
    """Custom judge logic: module:Class or file.py:Class, built as Class(generator=..., tokenizer=...) and called as a reward function."""
    reward_model_template: str = ""
    """File with the judge's prompt, {prompt} and {completion} in it (default: a 0-10 rating, 'Score: N')."""
    reward_model_max_tokens: int = 32
    """Tokens the judge may write before its score."""
    reward_model_max_concurrency: int = 256
    """Judge requests in flight at once (the rest wait their turn); at most the judge server's --max_pending_requests, which refuses more."""

    def __post_init__(self) -> None:
        if self.reward_model_url and not self.reward_model:
            raise ValueError("--reward_model_url needs --reward_model too (its tokenizer renders the judge's prompt)")
        if self.reward_model_max_concurrency < 1:
            raise ValueError(f"--reward_model_max_concurrency must be >= 1, got {self.reward_model_max_concurrency}")

    @property
    def enabled(self) -> bool:
        return bool(self.reward_model or self.reward_model_plugin)


def parse_score(text: str, *, max_score: float = 10.0) -> float | None:
    """The last "Score: N" of a reply, scaled to [0, 1]; None when there is none.

    Example: parse_score("fine. Score: 7") -> 0.7; parse_score("no idea") -> None
    """
    found = _SCORE.findall(text)
    return None if not found else min(max(float(found[-1]) / max_score, 0.0), 1.0)


def as_text(value: str | list[Message]) -> str:
    """A prompt or completion as plain text: messages become "role: content" lines."""
    if isinstance(value, str):
        return value
    return "\n".join(f"{m.get('role', '')}: {m.get('content') or ''}" for m in value)


class Bounded:
    """`generator` with at most `limit` generate calls in flight, the rest waiting their turn: a judge server
    answers a batch past its --max_pending_requests with 503 (nothing started) and a step's every completion
    at once was such a batch. Any other attribute is the generator's."""

    def __init__(self, generator: Any, limit: int):
        self.generator, self.limit = generator, limit
        self._slots: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots[0] is not loop:  # a semaphore serves one event loop
            self._slots = (loop, asyncio.Semaphore(self.limit))
        async with self._slots[1]:
            return await self.generator.generate(prompt_ids, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.generator, name)


class GenerativeJudge:
    """The default judge: template -> chat messages -> greedy generation -> parse_score. A plugin may
    subclass it and override `render` (the judge's messages) or `parse` (its reply into a score)."""

    def __init__(self, *, generator: Any, tokenizer: Any, template: str = TEMPLATE, max_tokens: int = 32):
        self.generator, self.tokenizer, self.template, self.max_tokens = generator, tokenizer, template, max_tokens

    def render(self, prompt: str | list[Message], completion: str | list[Message]) -> list[Message]:
        return [{"role": "user", "content": self.template.format(prompt=as_text(prompt), completion=as_text(completion))}]

    def parse(self, reply: str) -> float | None:
        return parse_score(reply)

    async def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        return list(await asyncio.gather(*(self._score(p, c) for p, c in zip(prompts, completions))))

    async def _score(self, prompt: Any, completion: Any) -> float | None:
        try:
            ids = self.tokenizer.apply_chat_template(self.render(prompt, completion), add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            result = await self.generator.generate(list(ids), SamplingParams(max_tokens=self.max_tokens, temperature=0.0))
            reply = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)  # a garbled answer's ids raise here
        except Exception as error:  # noqa: BLE001 - a judge failure is a missing reward, never a crashed step
            log.warning("reward model failed (%s: %s); the reward is None", type(error).__name__, error)
            return None
        score = self.parse(reply)
        if score is None:
            log.warning("reward model reply has no score, the reward is None: %r", reply[:200])
        return score


def build_judge(config: JudgeConfig, *, generator: Any, tokenizer: Any) -> Any:
    """The judge as a reward function: the plugin's class when given, else GenerativeJudge; either calls the
    generator at most --reward_model_max_concurrency times at once."""
    generator = None if generator is None else Bounded(generator, config.reward_model_max_concurrency)  # a plugin may need none
    if config.reward_model_plugin:
        cls = load_object(config.reward_model_plugin, what="reward model plugin")
        return cls(generator=generator, tokenizer=tokenizer)
    template = TEMPLATE
    if config.reward_model_template:
        if not os.path.isfile(config.reward_model_template):
            raise FileNotFoundError(f"--reward_model_template {config.reward_model_template}: no such file")
        with open(config.reward_model_template) as f:
            template = f.read()
        if "{prompt}" not in template or "{completion}" not in template:
            raise ValueError(f"--reward_model_template {config.reward_model_template}: write {{prompt}} and {{completion}} in it")
    return GenerativeJudge(generator=generator, tokenizer=tokenizer, template=template, max_tokens=config.reward_model_max_tokens)
