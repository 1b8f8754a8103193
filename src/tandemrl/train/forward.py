"""How the trainer's forward runs on its device: which weights, which attention, compiled or not, and
how many tokens a micro-batch holds.

Chosen once, when the trainer is built. On CUDA with float32 master weights and --bf16: 16-bit compute
weights (train/precision.py), packed variable-length attention (train/attention.py), each decoder
layer compiled. On CPU: the policy itself with transformers' own attention (the equivalence reference;
the embedded default's golden curve runs here). Under torchrun (train/distributed.py) FSDP2 shards the
policy per decoder layer, and its mixed-precision policy takes the compute twin's place.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from tandemrl.algo.logprobs import logprobs_and_entropy, set_compile, set_triton
from tandemrl.train.attention import layout, use_packed_attention
from tandemrl.train.batching import PackedBatch
from tandemrl.train.config import TrainerConfig
from tandemrl.train.distributed import SINGLE, DataParallel, shard
from tandemrl.train.lora import runs_under_autocast, unwrap
from tandemrl.train.precision import ComputeWeights

log = logging.getLogger(__name__)

CPU_MICROBATCH_TOKENS = 512  # on a CPU smaller packs run faster (cache-sized): the built-in tasks' 512 was 2.7x 8192's step time
MAX_AUTO_MICROBATCH_TOKENS = 16384  # a 0.5B step (512 x 384 tokens) peaks at 30 GiB with 2048-row logprob chunks


@dataclass(kw_only=True)
class ForwardPlan:
    """The trainer's forward set-up. Written once by `forward_plan`; `compute` refreshes itself."""

    compute: ComputeWeights | None  # 16-bit twin of the policy, or None (the policy runs itself)
    dtype: torch.dtype | None  # dtype of frozen copies (reference model); None = the policy's
    packed: bool  # packed attention: the forward takes the row layout as kwargs
    compile: bool
    no_grad_budget_factor: int  # no-grad passes (reference, old policy) take this many times the tokens
    dp: DataParallel = SINGLE  # the ranks FSDP2 shards the policy over (SINGLE: no sharding)
    mixed: bool = False  # sharded: bfloat16 compute over float32 shards
    autocast: torch.dtype | None = None  # LoRA over a 16-bit base: float32 adapters computed in this dtype

    def forward_model(self, master: Any, version: int) -> Any:
        """The model to run forward and backward on: the compute twin, fresh for `version`, or the policy."""
        if self.compute is None:
            return master
        self.compute.refresh(version)
        return self.compute.model

    def frozen_copy(self, master: Any) -> Any:
        """A no-grad copy of the policy as it is now (the reference model), set up like the forward model."""
        frozen = copy.deepcopy(master)
        if self.dtype is not None:
            frozen = frozen.to(self.dtype)
        frozen.eval().requires_grad_(False)
        self._prepare(frozen)
        return frozen

    def shard_policy(self, master: Any) -> None:
        """Under torchrun: the policy sharded (after the reference was copied whole; with LoRA the
        transformers model inside peft's, adapters included); else nothing."""
        if self.dp.enabled:
            self._prepare(unwrap(master))

    def logprobs(self, model: Any, m: PackedBatch, **options) -> tuple[torch.Tensor, torch.Tensor]:
        """`packed_logprobs` of `model` on `m`; through the sharded model's registered method under FSDP."""
        run = model.packed_logprobs if self.dp.enabled else functools.partial(packed_logprobs, model)
        with torch.autocast("cuda", dtype=self.autocast) if self.autocast is not None else contextlib.nullcontext():
            return run(m.input_ids, m.position_ids, m.trained_index, m.target_ids, self.attention_kwargs(m), floors=m.logit_floors, **options)

    def attention_kwargs(self, m: PackedBatch) -> dict:
        return layout(m.cu_seqlens, m.max_seqlen) if self.packed else {}

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if self.compute is None:
            optimizer.zero_grad(set_to_none=True)
        else:
            self.compute.zero_grad()

    def after_backward(self) -> None:
        if self.compute is not None:
            self.compute.accumulate()

    def reshard(self, model: Any) -> None:
        """After no-grad passes under FSDP: the root's gathered weights (embedding, norm, head) freed. FSDP2
        keeps the root gathered after a forward for the backward that follows, and no backward follows
        these (the reference model's would stay gathered for the whole run)."""
        if self.dp.enabled:
            model.reshard()

    def invalidate(self) -> None:
        if self.compute is not None:
            self.compute.refresh_on_next_use()

    def _prepare(self, model: Any) -> None:
        if self.packed:
            use_packed_attention(model)
        if self.compile:
            compile_layers(model)
        if self.dp.enabled:
            shard(model, decoder_layers(model), self.dp, mixed=self.mixed, forward_methods={"packed_logprobs": packed_logprobs})


def compute_dtype(config: TrainerConfig, model: Any) -> torch.dtype | None:
    """bfloat16 when the policy trains in mixed precision (16-bit compute over float32 masters: on CUDA with
    --bf16), else None (it computes in its own dtype)."""
    param = next(model.parameters())
    return torch.bfloat16 if param.device.type == "cuda" and config.bf16 and param.dtype == torch.float32 else None


def forward_plan(config: TrainerConfig, model: Any, dp: DataParallel = SINGLE) -> ForwardPlan:
    """The plan; in one process it also sets the policy up (under torchrun `shard_policy` does, later)."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    mixed = compute_dtype(config, model) is not None
    plan = ForwardPlan(
        compute=None,
        dtype=torch.bfloat16 if mixed and not dp.enabled else None,
        packed=on_cuda,
        compile=on_cuda and config.torch_compile,
        no_grad_budget_factor=4 if on_cuda else 1,
        dp=dp,
        mixed=mixed,
        autocast=torch.bfloat16 if on_cuda and runs_under_autocast(model) else None,
    )
    set_compile(plan.compile)
    set_triton(on_cuda and config.triton_logprobs)
    if dp.enabled:  # FSDP2's mixed precision replaces the compute twin
        if config.gradient_checkpointing:
            _checkpoint_activations(model)
        return plan
    if mixed:
        plan.compute = ComputeWeights(model, torch.bfloat16)
    forward = plan.compute.model if plan.compute is not None else model
    if config.gradient_checkpointing:
        _checkpoint_activations(forward)
    plan._prepare(forward)
    return plan


def _checkpoint_activations(model: Any) -> None:
    """transformers' activation checkpointing, by its current name where it has one (gradient_checkpointing_enable
    warns a FutureWarning from 5.2x; TRL's yaml default, gradient_checkpointing true, showed it every run)."""
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()


def packed_logprobs(
    model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, trained_index: torch.Tensor, target_ids: torch.Tensor,
    attention: dict, *, temperature: float, chunk_size: int, with_entropy: bool, floors: torch.Tensor | None = None, top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs and entropy [T] of the trained targets of a packed row; no [N, V] logits ever exist.

    input_ids, position_ids [1, N]; trained_index [T]; target_ids [N]; attention: the row's layout kwargs;
    floors [N]: the sampler's logit floors (PackedBatch.logit_floors), so each target is scored under the
    truncated distribution it was sampled from (top_k: see algo/logprobs.py's `truncated`).
    """
    hidden = model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention).last_hidden_state  # [1, N, H]
    return logprobs_and_entropy(
        hidden[0, trained_index], model.get_output_embeddings(), target_ids[trained_index],
        temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
        softcap=getattr(model.config, "final_logit_softcapping", None) or 0.0,  # Gemma 2
        floors=None if floors is None else floors[trained_index], top_k=top_k,
    )  # fmt: skip


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The decoder layers: the classes transformers keeps whole when sharding a model (_no_split_modules)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_layers(model: Any) -> None:
    """torch.compile each decoder layer."""
    layers = decoder_layers(model)
    if not layers:
        log.info("no decoder layers found to compile in %s; it runs eager", type(model).__name__)
        return
    # one graph serves every layer (parameters are graph inputs); room for a few shapes per layer
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in layers:
        layer.compile(dynamic=True)


def microbatch_budget(config: TrainerConfig, model: Any, device: torch.device) -> int:
    """Tokens per training micro-batch: --max_tokens_per_microbatch, or (0) chosen from free memory.

    The estimate: each decoder layer keeps ~10 hidden-sized and ~3 MLP-sized 16-bit activations per token
    for backward. Half of the free memory goes to them, within [2048, MAX_AUTO_MICROBATCH_TOKENS].
    """
    if config.max_tokens_per_microbatch > 0:
        return config.max_tokens_per_microbatch
    if device.type != "cuda":
        return CPU_MICROBATCH_TOKENS
    cfg = model.config
    per_token = cfg.num_hidden_layers * (10 * cfg.hidden_size + 3 * getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)) * 2
    free, _total = torch.cuda.mem_get_info(device)
    tokens = int(0.5 * free / per_token) // 1024 * 1024
    return max(2048, min(MAX_AUTO_MICROBATCH_TOKENS, tokens))
