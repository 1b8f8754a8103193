"""Token logprobs and entropy from hidden states, without ever holding float32 logits for all tokens.

Legend: N tokens, H hidden size, V vocab, C chunk size.
Invariant: at most C x V logits exist at a time, in forward and in backward. The head is one autograd
function (linear + log-softmax + gather, the Liger / "cut cross-entropy" trade of compute for memory):
forward keeps only its inputs and each row's max and log-sum-exp (of the logits less that max, tempered:
`_tempered`, precise at low temperatures); backward recomputes a chunk's logits, turns
them into the gradient of the logits, and multiplies it into the gradients of the hidden states and of
the head's weight. Matmuls run in the weight's dtype (bf16 on the GPU path); logits, softmax and the
weight's gradient accumulate in float32. On CUDA with --triton_logprobs, a chunk's row statistics and its
logits' gradient are single-pass Triton kernels over the raw logits (algo/logprobs_kernel.py); the torch
path (compiled on CUDA) is the reference and the CPU path. Given the sampler's logit floors (top-k, top-p,
min-p: generation/engine/layers/sampler.py), a row keeps only the tokens the sampler kept and renormalises
over them, so a token is scored under the truncated distribution it was drawn from (ratio 1 at lag 0).
Under top-k alone (`top_k`), a row keeps its own k largest logits instead (the target among them): a
fixed floor makes the kept set jump where the trainer's logits and the sampler's differ by numerics across
it, and near the k-th logit of a flat distribution (the sampler's bf16 logits tie there) that moves whole
tokens of ~1/k probability each; the k largest move only by a swap of two near-equal logits.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b with a float32 result, accumulated in float32 also when the inputs are 16-bit."""
    if a.dtype != torch.float32 and a.is_cuda and _mm_out_dtype_works():
        return torch.mm(a, b, out_dtype=torch.float32)
    return (a @ b).float()


def _add_mm_f32(out: Tensor, a: Tensor, b: Tensor, *, in_matmul: bool) -> None:
    """out += a @ b, out float32. in_matmul (16-bit CUDA inputs, where torch allows it): the sum happens
    inside the matmul (cuBLAS beta = 1), with no float32 temporary of out's size and no separate add."""
    if in_matmul and a.dtype != torch.float32 and a.is_cuda and _baddbmm_accumulates():
        _add_mm_f32_in_matmul(out, a, b)
    else:
        out += _mm_f32(a, b)


def _add_mm_f32_in_matmul(out: Tensor, a: Tensor, b: Tensor) -> None:
    torch.baddbmm(out[None], a[None], b[None], out_dtype=torch.float32, out=out[None])


@functools.cache
def _baddbmm_accumulates() -> bool:
    """baddbmm(out, a, b, out_dtype=float32, out=out) on 16-bit CUDA inputs adds a @ b into float32 out
    (checked once on small tensors, so a torch without it, or with other semantics, takes the plain path)."""
    try:
        generator = torch.Generator(device="cuda").manual_seed(0)
        grad = torch.randn(8, 6, device="cuda", generator=generator).bfloat16()  # as the head's [C, V]
        hidden = torch.randn(8, 4, device="cuda", generator=generator).bfloat16()  # [C, H]
        out = torch.randn(6, 4, device="cuda", generator=generator)  # [V, H]
        expected = out + grad.float().t() @ hidden.float()
        _add_mm_f32_in_matmul(out, grad.t(), hidden)
        return torch.allclose(out, expected, atol=1e-4)
    except (TypeError, RuntimeError):
        return False


EXCLUDED = -1e20
"""The logit of a token the sampler excluded: finite, so 0 x logit stays 0 in entropy and gradients
(an -inf would make them NaN), and exp of it is 0 at every temperature."""


def truncated(logits: Tensor, floors: Tensor | None, target_ids: Tensor, temperature: float, top_k: int = 0) -> Tensor:
    """Logits [C, V] (before the temperature) with the tokens below each row's floor (tempered units,
    floors [C]) set to EXCLUDED; the target always stays. None or -inf floors keep everything.
    top_k > 0 (the sampler's only filter): a row with a floor keeps its own top_k largest logits instead,
    the target among them (the top_k - 1 largest and the target where the target is not).

    Example: logits [[3, 1, 2]], floors [1.5], target [0], temperature 1 -> [[3, -1e20, 2]]
    Example: logits [[3, 1, 2]], floors [1.5], target [1], temperature 1, top_k 2 -> [[3, 1, -1e20]]
    """
    if floors is None:
        return logits
    if 0 < top_k < logits.shape[-1]:
        largest = logits.topk(top_k, dim=-1).values  # [C, k], descending
        target = logits.gather(-1, target_ids[:, None])  # [C, 1]
        kth = largest[:, -1:]
        bound = torch.where(target >= kth, kth, largest[:, -2:-1] if top_k > 1 else target)  # [C, 1]
        keep = (logits >= bound) | (floors == float("-inf"))[:, None]  # [C, V]; a row the sampler did not filter keeps all
    else:
        keep = logits >= (floors * temperature)[:, None]  # [C, V]; the floor lies halfway to the excluded, past numerics
    keep.scatter_(-1, target_ids[:, None], True)
    return logits.masked_fill(~keep, EXCLUDED)


def _logits(
    hidden: Tensor, weight: Tensor, temperature: float, floors: Tensor | None = None, target_ids: Tensor | None = None, top_k: int = 0,
    row_max: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`_tempered` of hidden [C, H] @ weight [V, H]^T (float32 [C, V]), truncated at `floors` (or its own top_k) when given."""
    return _tempered(truncated(_mm_f32(hidden, weight.t()), floors, target_ids, temperature, top_k), temperature, row_max)


def _tempered(logits: Tensor, temperature: float, row_max: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """((logits - row_max) / T, row_max [C]) of a chunk's fresh float32 logits [C, V], in place; row_max: each
    row's max unless given (backward: the forward's). The max comes off before the temperature, as the
    sampler's: logits of ~60 at T = 1e-4 are ~6e5 tempered, where float32's spacing (1/16) put logprobs 3e-2 off."""
    row_max = logits.amax(-1) if row_max is None else row_max
    logits = logits.sub_(row_max[:, None])
    return (logits.div_(temperature) if temperature != 1.0 else logits), row_max


@functools.cache
def _mm_out_dtype_works() -> bool:
    """torch.mm(..., out_dtype=float32) on 16-bit CUDA inputs (torch >= 2.8); else logits round through bf16."""
    try:
        x = torch.ones(2, 2, device="cuda", dtype=torch.bfloat16)
        return torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def _row_stats(logits: Tensor, target_ids: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Log-sum-exp, target logprob and (optionally) entropy of each row. logits [C, V] float32.

    Example: logits [[0, 0]], target [1] -> lse [ln 2], logprobs [-ln 2], entropy [ln 2]
    """
    lse = torch.logsumexp(logits, dim=-1)  # [C]
    logprobs = logits.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1) - lse  # [C]
    if not with_entropy:
        return lse, logprobs, torch.zeros_like(lse)
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [C]
    return lse, logprobs, entropy


def _logits_grad(
    logits: Tensor, lse: Tensor, target_ids: Tensor, grad: Tensor, entropy: Tensor, grad_entropy: Tensor, temperature: float,
    dtype: torch.dtype,
) -> Tensor:
    """d(sum_i grad_i * logprob_i + grad_entropy_i * entropy_i) / d(raw logits), computed in float32 and
    returned in `dtype` (the head weight's: the cast fuses into the same pass) [C, V].

    With z = logits / T and p = softmax(z): d logprob / dz = onehot(target) - p and
    d entropy / dz = -p (z - E_p[z]), E_p[z] = lse - entropy; both divided by T for the raw logits.
    """
    probs = torch.exp(logits - lse.unsqueeze(-1))  # [C, V]
    out = probs * (-grad.unsqueeze(-1) - grad_entropy.unsqueeze(-1) * (logits - (lse - entropy).unsqueeze(-1)))
    out.scatter_add_(-1, target_ids.unsqueeze(-1), grad.unsqueeze(-1))
    out = out / temperature if temperature != 1.0 else out
    return out.to(dtype)


@functools.cache
def _compiled(fn):
    """The elementwise and reduction parts fused by torch.compile on CUDA (the matmuls stay cuBLAS's)."""
    return torch.compile(fn, dynamic=True)


def _maybe_compiled(fn, tensor: Tensor):
    return _compiled(fn) if tensor.is_cuda and _COMPILE[0] else fn


_COMPILE = [True]  # the trainer switches it off with --torch_compile false
_TRITON = [False]  # the trainer sets it from --triton_logprobs (on by default)


def set_compile(enabled: bool) -> None:
    """Whether the head's elementwise parts run compiled on CUDA (a process-wide choice, made once)."""
    _COMPILE[0] = enabled


def set_triton(enabled: bool) -> None:
    """Whether the head's row statistics and logits gradient run as Triton kernels on CUDA (where triton
    imports; else the torch path runs). A process-wide choice, made once."""
    _TRITON[0] = enabled


@functools.cache
def _triton_installed() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        log.warning("triton is not installed: the logprob head runs its torch path (install triton for the faster head)")
        return False
    return True


def _use_triton(tensor: Tensor) -> bool:
    return tensor.is_cuda and _TRITON[0] and _triton_installed()


def _capped(rows: Tensor, weight: Tensor, softcap: float) -> tuple[Tensor, Tensor]:
    """(c * tanh(z / c), tanh(z / c)) of the raw logits z = rows @ weight^T, float32 [C, V] (Gemma 2's final cap)."""
    squashed = torch.tanh(_mm_f32(rows, weight.t()) / softcap)
    return squashed * softcap, squashed


def _chunk_stats(hidden: Tensor, softcap: float = 0.0, top_k: int = 0):
    """fn(hidden [C, H], weight [V, H], target_ids [C], temperature, with_entropy, floors [C] | None) -> (lse, logprobs,
    entropy, row_max) [C]: lse of the tempered logits less the row's max (`_tempered`), and that max (raw)."""
    if softcap:  # the capped logits, then the torch path's statistics
        def capped(rows: Tensor, weight: Tensor, target_ids: Tensor, temperature: float, with_entropy: bool, floors: Tensor | None):
            logits, row_max = _tempered(truncated(_capped(rows, weight, softcap)[0], floors, target_ids, temperature, top_k), temperature)
            return *_row_stats(logits, target_ids, with_entropy), row_max

        return capped
    if _use_triton(hidden):
        from tandemrl.algo.logprobs_kernel import row_stats

        def kernel(rows: Tensor, weight: Tensor, target_ids: Tensor, temperature: float, with_entropy: bool, floors: Tensor | None):
            return row_stats(truncated(_mm_f32(rows, weight.t()), floors, target_ids, temperature, top_k), target_ids, temperature, with_entropy)

        return kernel
    stats = _maybe_compiled(_row_stats, hidden)

    def torch_path(rows: Tensor, weight: Tensor, target_ids: Tensor, temperature: float, with_entropy: bool, floors: Tensor | None):
        logits, row_max = _logits(rows, weight, temperature, floors, target_ids, top_k)
        return *stats(logits, target_ids, with_entropy), row_max

    return torch_path


def _chunk_logits_grad(hidden: Tensor, softcap: float = 0.0, top_k: int = 0):
    """fn(hidden [C, H], weight [V, H], lse, target_ids, grad, entropy, grad_entropy [C], temperature, floors, row_max) ->
    the gradient of the chunk's raw logits [C, V] in the weight's dtype (see `_logits_grad`; an excluded
    token's is 0, as its probability). lse and row_max: `_chunk_stats`'."""
    if softcap:  # through the cap: d(c tanh(z / c)) / dz = 1 - tanh^2
        def capped(rows: Tensor, weight: Tensor, lse: Tensor, target_ids: Tensor, *per_row: Tensor, temperature: float, floors: Tensor | None, row_max: Tensor) -> Tensor:
            logits, squashed = _capped(rows, weight, softcap)
            logits, _ = _tempered(truncated(logits, floors, target_ids, temperature, top_k), temperature, row_max)
            grad = _logits_grad(logits, lse, target_ids, *per_row, temperature, torch.float32)
            return (grad * (1 - squashed * squashed)).to(weight.dtype)

        return capped
    if _use_triton(hidden):
        from tandemrl.algo.logprobs_kernel import logits_grad

        def kernel(rows: Tensor, weight: Tensor, lse: Tensor, target_ids: Tensor, *per_row: Tensor, temperature: float, floors: Tensor | None, row_max: Tensor) -> Tensor:
            logits = truncated(_mm_f32(rows, weight.t()), floors, target_ids, temperature, top_k)
            return logits_grad(logits, row_max, lse, target_ids, *per_row, temperature, weight.dtype)

        return kernel
    grad_fn = _maybe_compiled(_logits_grad, hidden)

    def torch_path(rows: Tensor, weight: Tensor, lse: Tensor, target_ids: Tensor, *per_row: Tensor, temperature: float, floors: Tensor | None, row_max: Tensor) -> Tensor:
        logits, _ = _logits(rows, weight, temperature, floors, target_ids, top_k, row_max)
        return grad_fn(logits, lse, target_ids, *per_row, temperature, weight.dtype)

    return torch_path


class _LinearLogprobs(torch.autograd.Function):
    """logprobs [N] and entropy [N] of target_ids under softmax(hidden @ weight^T / T)."""

    @staticmethod
    def forward(ctx, hidden, weight, target_ids, temperature, chunk_size, with_entropy, softcap=0.0, floors=None, top_k=0):  # noqa: ANN001
        logprobs, entropy, lse, row_max = (hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(4))
        stats = _chunk_stats(hidden, softcap, top_k)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            chunk_floors = None if floors is None else floors[rows]
            lse[rows], logprobs[rows], entropy[rows], row_max[rows] = stats(hidden[rows], weight, target_ids[rows], temperature, with_entropy, chunk_floors)
        ctx.save_for_backward(hidden, weight, target_ids, lse, entropy, floors, row_max)
        ctx.temperature, ctx.chunk_size, ctx.softcap, ctx.top_k = temperature, chunk_size, softcap, top_k
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):  # noqa: ANN001
        hidden, weight, target_ids, lse, entropy, floors, row_max = ctx.saved_tensors
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(lse)
        grad_hidden = hidden.new_empty(hidden.shape) if ctx.needs_input_grad[0] else None  # contiguous: mm writes its rows
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        logits_grad = _chunk_logits_grad(hidden, ctx.softcap, ctx.top_k)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            grad = logits_grad(
                hidden[rows], weight, lse[rows], target_ids[rows], grad_logprobs[rows].float(), entropy[rows],
                grad_entropy[rows].float(), temperature=ctx.temperature, floors=None if floors is None else floors[rows], row_max=row_max[rows],
            )  # [C, V] in the weight's dtype
            if grad_hidden is not None:
                torch.mm(grad, weight, out=grad_hidden[rows])  # [C, H]
            if grad_weight is not None:  # [V, H], float32 across chunks
                _add_mm_f32(grad_weight, grad.t(), hidden[rows], in_matmul=_use_triton(hidden))
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None, None, None, None


def logprobs_and_entropy(
    hidden: Tensor,
    lm_head: torch.nn.Module,
    target_ids: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    softcap: float = 0.0,
    floors: Tensor | None = None,
    top_k: int = 0,
) -> tuple[Tensor, Tensor]:
    """Logprob of each target token under softmax(lm_head(hidden) / temperature), and its entropy; with
    `floors` [N] (the sampler's, tempered units) under the softmax over the tokens the sampler kept; with
    `top_k` > 0 too (top-k the sampler's only filter), over each filtered row's own top_k largest (`truncated`).

    hidden [N, H], target_ids [N] -> logprobs [N] float32, entropy [N] float32 (zeros unless
    with_entropy; both carry gradients, so an entropy bonus can train). Dividing by the sampling temperature scores tokens under the
    distribution they were sampled from. lm_head is a bias-free Linear (the Llama/Qwen head). `softcap` c > 0:
    the logits are c * tanh(logits / c) first (Gemma 2's final_logit_softcapping), as transformers' forward.
    Example: hidden [[1.0]], lm_head Linear(1, 2) with weight [[0], [0]], target [0] -> ([-ln 2], [ln 2])
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to score tokens (greedy has no logprobs), got {temperature}")
    if getattr(lm_head, "bias", None) is not None:
        raise ValueError("the output head has a bias; tandem's logprob head supports bias-free heads (Llama, Qwen, ...)")
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32), hidden.new_zeros(0, dtype=torch.float32)
    weight = lm_head.weight  # [V, H]
    if hidden.dtype != weight.dtype:  # under autocast the decoder may hand over another dtype than the head's
        hidden = hidden.to(weight.dtype)
    return _LinearLogprobs.apply(hidden, weight, target_ids, float(temperature), chunk_size, with_entropy, float(softcap), floors, int(top_k))
