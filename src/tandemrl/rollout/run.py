"""Plays one conversation to its end: prompt (context) -> completion (sampled), and with an environment
-> its answer (context) -> completion (sampled) -> ... until the model stops calling it or a limit hits.

Invariant (token-in, token-out): the trace keeps sampled tokens exactly as sampled and appends only
the chat template's token delta for the environment's messages; each turn's prompt is the whole trace
so far, so the engine's prefix cache reuses earlier turns. Text is decoded only for the environment,
rewards and logs.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Any

from tandemrl.generation.base import Generator
from tandemrl.rollout.chat import ChatFormat, decoder_of
from tandemrl.rollout.env import Env
from tandemrl.types import Completion, Example, FinishReason, Message, Rollout, RolloutStatus, SamplingParams, TokenTrace, Turn


@dataclass(frozen=True, kw_only=True)
class MultiTurn:
    """What a multi-turn rollout needs beyond a Generator; built once per run by cli/."""

    env: Env
    chat: ChatFormat
    max_turns: int
    max_total_tokens: int
    warm_up: bool = False  # --warm_up_turns


async def play(
    example: Example, prompt_ids: list[int], *, generator: Generator, params: SamplingParams, tokenizer: Any,
    multi_turn: MultiTurn | None = None,
) -> Rollout:
    if multi_turn is not None:
        return await _play_turns(example, prompt_ids, generator=generator, params=params, tokenizer=tokenizer, mt=multi_turn)
    trace = TokenTrace()
    trace.append_context(prompt_ids)
    completion = await generator.generate(prompt_ids, params)
    trace.append_sampled(completion)
    return Rollout(
        example=example,
        trace=trace,
        completion_text=decoder_of(tokenizer)(completion.token_ids, skip_special_tokens=True),
        finish_reason=completion.finish_reason,
        status=_status(completion.finish_reason),
        turns=[_turn(0, completion, generator)],
    )


async def _play_turns(
    example: Example, prompt_ids: list[int], *, generator: Generator, params: SamplingParams, tokenizer: Any, mt: MultiTurn
) -> Rollout:
    """Turns until the environment has nothing to add. A rollout ends truncated (finish "length") when a
    turn hits its token limit, when the environment's answer would pass max_total_tokens, or when the
    environment still answers after max_turns (that answer is then not played)."""
    trace, messages, turns, warm_ups = TokenTrace(), [], [], []
    decode = decoder_of(tokenizer)
    trace.append_context(prompt_ids)
    params = with_turn_stop(params, mt)
    finish: FinishReason = "length"
    for number in range(mt.max_turns):
        room = mt.max_total_tokens - len(trace.token_ids)
        if room < 1:
            break
        turn_params = params if params.max_tokens <= room else dataclasses.replace(params, max_tokens=room)  # a replace validates every field again
        completion = await generator.generate(list(trace.token_ids), turn_params)
        turns.append(_turn(len(trace.token_ids), completion, generator))
        trace.append_sampled(completion)
        messages.append({"role": "assistant", "content": decode(completion.token_ids, skip_special_tokens=True)})
        finish = completion.finish_reason
        if finish != "stop":
            break
        last_sampled_id = completion.token_ids[-1] if completion.token_ids else None
        if mt.warm_up and number < mt.max_turns - 1:
            warm_ups += _warm_up(generator, trace.token_ids, mt, last_sampled_id)
        answers = await mt.env.step(example, messages)
        if not answers:
            break
        most = mt.max_total_tokens - len(trace.token_ids) - 1  # the answer's room: the next turn needs a token
        delta = None if number == mt.max_turns - 1 else await mt.chat.delta_within(answers, last_sampled_id=last_sampled_id, most=most)
        if delta is None:  # not played: the last turn's answer, or one past max_total_tokens (not tokenized whole)
            finish = "length"
            break
        trace.append_context(delta)
        messages += answers
    for task in warm_ups:  # one still queued is of no use any more
        task.cancel()
    return Rollout(
        example=example,
        trace=trace,
        completion_text="",  # decoded only where shown: completion_text()
        finish_reason=finish,
        status=_status(finish),
        messages=messages,
        turns=turns,
    )


def completion_text(rollout: Rollout, tokenizer: Any) -> str:
    """What a rollout wrote after its prompt, as text: a single-turn rollout's completion_text; a multi-turn
    rollout's conversation decoded now (only the few logged are: a decode of every conversation, at every
    step's end, cost ~10-50 us a rollout on the event loop that waits for the last one)."""
    if not _is_conversation(rollout):
        return rollout.completion_text
    return decoder_of(tokenizer)(rollout.trace.token_ids[rollout.turns[0].start :])


def completion_token_ids(rollout: Rollout) -> list[int]:
    """The token ids completion_text is the text of: a single-turn rollout's sampled tokens, a multi-turn
    rollout's whole conversation after its prompt (tool answers and turn markers too)."""
    if _is_conversation(rollout):
        return rollout.trace.token_ids[rollout.turns[0].start :]
    return [t for t, m in zip(rollout.trace.token_ids, rollout.trace.loss_mask) if m]


def _is_conversation(rollout: Rollout) -> bool:
    return not rollout.completion_text and bool(rollout.messages) and bool(rollout.turns)


def with_turn_stop(params: SamplingParams, mt: MultiTurn) -> SamplingParams:
    """`params` that also stop where the chat template closes an assistant message (a turn's end); `params`
    itself when they do already (play_group applies it once a group: a replace validates every field again)."""
    end = mt.chat.end_of_turn_id
    if end is None or end in params.stop_token_ids:
        return params
    return dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, end))


WARM_UP = SamplingParams(max_tokens=1, temperature=0.0, seed=0)  # seeded: a warm-up takes nothing from the engine's seed counter


def _warm_up(generator: Generator, token_ids: list[int], mt: MultiTurn, last_sampled_id: int | None) -> list[asyncio.Task]:
    """While the environment answers, the generator prefills the head of the next turn that no tool answer
    changes (the sampled turn's closing, a tool message's opening), so the next turn computes only the
    answer and what follows it. Only a generator with a prefix cache that has nothing else to run (every
    rollout between turns at once): a warm-up in a busy engine would stop its decode batch for a prefill
    step, while its tool calls are hidden behind the other rollouts' decoding anyway. Its token is dropped."""
    if not getattr(generator, "caches_prefixes", False) or generator.num_unfinished():
        return []
    head = mt.chat.answer_head_ids(last_sampled_id=last_sampled_id)
    if not head or len(token_ids) + len(head) >= mt.max_total_tokens:
        return []
    task = asyncio.get_running_loop().create_task(generator.generate(token_ids + head, WARM_UP))
    task.add_done_callback(lambda done: done.cancelled() or done.exception())  # a failed warm-up changes nothing: never logged
    return [task]


def _turn(start: int, completion: Completion, generator: Generator) -> Turn:
    version = completion.policy_versions[0] if completion.policy_versions else generator.version
    return Turn(start=start, end=start + len(completion.token_ids), policy_version=version, finish_reason=completion.finish_reason)


def _status(finish: FinishReason) -> RolloutStatus:
    return RolloutStatus.TRUNCATED if finish == "length" else RolloutStatus.OK


def conversation_of(rollout: Rollout) -> list[Message] | str:
    """What rewards see as the completion: the messages of a multi-turn rollout (TRL's conversational
    form), the text of a single-turn one."""
    return rollout.messages if rollout.messages else rollout.completion_text
