"""The `hf` Generator: transformers `generate`, any causal LM. Slow, obviously correct: the parity
reference for the engine and the fallback for architectures the engine lacks.

Concurrent `generate` calls with equal sampling parameters are batched into one padded call. Weight
updates and generation take one lock, so no token comes from half-updated weights. Seeds: a batch of
seeded requests is seeded by all their seeds together, so a run is reproducible when batches are
(the synchronous pipeline); only the engine makes each request's sample independent of its batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Iterable
from typing import Any

import torch

from tandemrl.generation.base import HFConfig
from tandemrl.generation.loading import load_model, load_tokenizer, resolve_device, resolve_dtype
from tandemrl.generation.tick import TickBatcher
from tandemrl.types import Completion, SamplingParams

log = logging.getLogger(__name__)


class HFGenerator:
    def __init__(self, config: HFConfig, *, model: Any = None, tokenizer: Any = None) -> None:
        self.config = config
        self.version = 0
        self.device = resolve_device(config.device)
        self.tokenizer = tokenizer or load_tokenizer(config.model)
        self.owns_model = model is None  # colocated, the model is the trainer's: sleep must not move it
        self.fallback_reason: str | None = None  # set by build_generator: why the engine was asked for and cannot serve
        self.model = model or load_model(config.model, dtype=resolve_dtype(config.dtype, self.device), device=self.device)
        self._lock = threading.Lock()
        self._this_tick: TickBatcher[tuple[list[int], SamplingParams, asyncio.Future]] = TickBatcher(self._queue)
        self._pending: list[tuple[list[int], SamplingParams, asyncio.Future]] = []  # ticks waiting for a generate call
        self._flush_task: asyncio.Task | None = None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        future = asyncio.get_running_loop().create_future()
        self._this_tick.add((prompt_ids, params, future))
        return await future

    def _queue(self, calls: list[tuple[list[int], SamplingParams, asyncio.Future]]) -> None:
        self._pending += calls
        if self._flush_task is None or self._flush_task.done():
            self._flush_task = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        while self._pending:
            pending, self._pending = self._pending, []
            by_params: dict[SamplingParams, list] = {}
            for item in pending:
                by_params.setdefault(dataclasses.replace(item[1], seed=None), []).append(item)
            for items in by_params.values():
                for start in range(0, len(items), self.config.max_batch_size):
                    chunk = items[start : start + self.config.max_batch_size]
                    try:
                        seeds = [params.seed for _, params, _ in chunk]
                        seed = None if None in seeds else hash(tuple(seeds)) % 2**63
                        params = dataclasses.replace(chunk[0][1], seed=seed)
                        completions = await asyncio.to_thread(self._generate_batch, [p for p, _, _ in chunk], params)
                    except Exception as error:  # noqa: BLE001 - the error belongs to the callers
                        for _, _, future in chunk:
                            future.done() or future.set_exception(error)
                        continue
                    for (_, _, future), completion in zip(chunk, completions):
                        future.done() or future.set_result(completion)

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        from transformers import GenerationConfig

        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=self.device)  # [B, P]
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        eos_ids = list(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            eos_ids.append(self.tokenizer.eos_token_id)
        sample = not params.greedy
        gen_config = GenerationConfig(
            max_new_tokens=params.max_tokens,
            do_sample=sample,
            temperature=params.temperature if sample else None,
            top_p=params.top_p if sample else None,
            top_k=params.top_k_or(0) if sample else None,
            min_p=(params.min_p or None) if sample else None,
            repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
            eos_token_id=eos_ids,  # a list, never None: None would bring back the model's own EOS under ignore_eos
            pad_token_id=pad_id,
            stop_strings=list(params.stop) or None,
            return_dict_in_generate=True,
            output_scores=True,
            output_logits=params.top_logprobs > 0 or (sample and params.filters),
            **self.config.generation_kwargs,
        )
        seeded = params.seed is not None
        devices = [] if self.device.type == "cpu" else [self.device]
        with self._lock, torch.no_grad(), torch.random.fork_rng(devices=devices, enabled=seeded):
            if seeded:
                torch.manual_seed(params.seed)
            was_training = self.model.training
            self.model.eval()
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, generation_config=gen_config, tokenizer=self.tokenizer
            )
            self.model.train(was_training)
            version = self.version
        new_ids = out.sequences[:, width:]  # [B, T]
        scores = torch.stack(out.scores, dim=1).float()  # [B, T, V] tempered and filtered: -inf where excluded
        logprobs = scores.log_softmax(-1).gather(-1, new_ids[..., None])[..., 0]  # [B, T]
        floors = _floors(scores, torch.stack(out.logits, dim=1).float() / params.temperature) if sample and params.filters else [None] * len(new_ids)
        tops = _top_logprobs(out.logits, params.top_logprobs) if params.top_logprobs else [None] * len(new_ids)
        return [
            self._completion(row.tolist(), lp.tolist(), params, eos_ids, version, top, floor)
            for row, lp, top, floor in zip(new_ids, logprobs, tops, floors)
        ]

    def _completion(
        self, ids: list[int], logprobs: list[float], params: SamplingParams, eos_ids: list[int], version: int, top: list[dict[int, float]] | None,
        floors: list[float] | None = None,
    ) -> Completion:
        length, reason = len(ids), "length"
        for i, token_id in enumerate(ids):
            if token_id in eos_ids or (params.stop and _contains_stop(self.tokenizer.decode(ids[: i + 1]), params.stop)):
                length, reason = i + 1, "stop"
                break
        return Completion(
            token_ids=ids[:length], logprobs=logprobs[:length], finish_reason=reason, policy_versions=[version] * length,
            top_logprobs=None if top is None else top[:length], logit_floors=None if floors is None else floors[:length],
        )

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, version: int) -> None:
        await asyncio.to_thread(self._load_weights, weights, version)

    def _load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """A tensor of a name this model lacks, or of another shape (copy_ would broadcast it), is a ValueError
        naming it; a list is checked whole before any copy, so a refused one leaves the weights as they were."""
        params = dict(self.model.named_parameters())

        def checked(name: str, tensor: torch.Tensor) -> torch.Tensor:
            if name not in params:
                raise ValueError(f"update_weights: the model has no parameter {name!r}")
            if tensor.shape != params[name].shape:
                raise ValueError(f"tensor {name} has shape {list(tensor.shape)}; this model's is {list(params[name].shape)}")
            return params[name]

        if isinstance(weights, list):
            for name, tensor in weights:
                checked(name, tensor)
        with self._lock, torch.no_grad():
            for name, tensor in weights:
                target = checked(name, tensor)
                if target.data_ptr() != tensor.data_ptr():  # colocated and shared: already live
                    target.copy_(tensor)
            self.version = version

    async def sleep(self, level: int) -> None:
        if level >= 2 and self.device.type == "cuda" and self.owns_model:
            await asyncio.to_thread(self.model.to, "cpu")

    async def wake(self) -> None:
        if self.device.type == "cuda" and self.owns_model:
            await asyncio.to_thread(self.model.to, self.device)

    async def close(self) -> None:
        pass


def _contains_stop(text: str, stop: tuple[str, ...]) -> bool:
    return any(s in text for s in stop)


def _top_logprobs(logits: tuple[torch.Tensor, ...], k: int) -> list[list[dict[int, float]]]:
    """Per row and step, the `k` most likely tokens of the model's raw distribution, best first.

    Example: one row, one step of logits [0, ln 3] and k=1 -> [[{1: log(0.75)}]]
    """
    top = torch.stack(logits, dim=1).float().log_softmax(-1).topk(k, dim=-1)  # [B, T, k]
    return [[dict(zip(i, v)) for i, v in zip(ids, values)] for ids, values in zip(top.indices.tolist(), top.values.tolist())]


def _floors(scores: torch.Tensor, tempered: torch.Tensor) -> list[list[float]]:
    """Completion.logit_floors of each row [B, T]: halfway between the lowest kept score and the highest
    excluded tempered logit (as the engine's sampler.logit_floors); -inf where nothing was excluded."""
    excluded = scores == float("-inf")  # [B, T, V]
    kept_min = scores.masked_fill(excluded, float("inf")).amin(-1)
    excluded_max = tempered.masked_fill(~excluded, float("-inf")).amax(-1)
    return torch.where(excluded_max > float("-inf"), (kept_min + excluded_max) / 2, float("-inf")).tolist()
