"""Plays one conversation to its end. Single turn today: prompt (context) -> one completion (sampled).

The trace keeps tokens exactly as sampled; the text is decoded only for rewards and logs.
"""

from __future__ import annotations

from typing import Any

from tandemrl.generation.base import Generator
from tandemrl.types import Example, Rollout, RolloutStatus, SamplingParams, TokenTrace


async def play(example: Example, prompt_ids: list[int], *, generator: Generator, params: SamplingParams, tokenizer: Any) -> Rollout:
    trace = TokenTrace()
    trace.append_context(prompt_ids)
    completion = await generator.generate(prompt_ids, params)
    trace.append_sampled(completion)
    truncated = completion.finish_reason == "length"
    return Rollout(
        example=example,
        trace=trace,
        completion_text=tokenizer.decode(completion.token_ids, skip_special_tokens=True),
        finish_reason=completion.finish_reason,
        status=RolloutStatus.TRUNCATED if truncated else RolloutStatus.OK,
    )
