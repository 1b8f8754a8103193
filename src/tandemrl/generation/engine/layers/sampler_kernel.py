"""Triton fused Gumbel-max sampling of rows without filters, the GPU path of sampler.py's `sample`.

Legend: B rows, V vocab. Same noise hash as sampler.py (lowbias32), so both paths draw the same tokens.
Imported only on CUDA; tests/gpu checks it against sampler.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _sample_chunk_kernel(
    logits_ptr, temps_ptr, keys_ptr, max_ptr, sum_ptr, score_ptr, index_ptr, logit_ptr,
    stride_b, V, S, CHUNK: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    # program (row, chunk) over CHUNK vocab entries: the max and the sum of exp of the tempered logits,
    # and the argmax of tempered logit + Gumbel noise (Gumbel-max; greedy rows get no noise) with that
    # logit. Many chunks per row keep every SM busy; the hash runs in 32-bit integers.
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    greedy = temp == 0.0
    inv_temp = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temp))
    key = tl.load(keys_ptr + row).to(tl.uint32)
    first = chunk * CHUNK
    run_max = tl.full([TILE], float("-inf"), tl.float32)
    for start in range(0, CHUNK, TILE):  # pass 1, the max (the chunk stays in cache for pass 2)
        v = first + start + tl.arange(0, TILE)
        z = tl.load(logits_ptr + row * stride_b + v, mask=v < V, other=float("-inf")).to(tl.float32) * inv_temp
        run_max = tl.maximum(run_max, z)
    chunk_max = tl.max(run_max, 0)
    shift = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
    run_sum = tl.zeros([TILE], tl.float32)
    best_score = tl.full([TILE], float("-inf"), tl.float32)
    # lanes past the vocab never win: they must not alias a real token when the winner is read back
    best_logit = tl.full([TILE], float("-inf"), tl.float32)
    best_index = tl.full([TILE], -1, tl.int32)
    for start in range(0, CHUNK, TILE):  # pass 2
        v = first + start + tl.arange(0, TILE)
        valid = v < V
        z = tl.load(logits_ptr + row * stride_b + v, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        run_sum += tl.where(valid, tl.exp(z - shift), 0.0)
        bits = _mix32((key + v.to(tl.uint32) * 0x9E3779B9) & 0xFFFFFFFF)
        uniform = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        noise = tl.where(greedy, 0.0, -tl.log(-tl.log(uniform)))
        score = tl.where(valid, z + noise, float("-inf"))
        better = score > best_score
        best_score = tl.where(better, score, best_score)
        best_logit = tl.where(better, z, best_logit)
        best_index = tl.where(better, v, best_index)
    top = tl.max(best_score, 0)
    # the first lane holding the best score, so ties break towards the lower index (as torch.argmax)
    index = tl.min(tl.where(best_score == top, best_index, V), 0)
    out = row * S + chunk
    tl.store(max_ptr + out, chunk_max)
    tl.store(sum_ptr + out, tl.sum(run_sum, 0))
    tl.store(score_ptr + out, top)
    tl.store(index_ptr + out, index)
    tl.store(logit_ptr + out, tl.max(tl.where(best_index == index, best_logit, float("-inf")), 0))


@triton.jit
def _sample_combine_kernel(max_ptr, sum_ptr, score_ptr, index_ptr, logit_ptr, tokens_ptr, logprobs_ptr, V, S, SP: tl.constexpr):
    # one program per row over its S chunks: logsumexp of the tempered logits, and the best chunk's token
    row = tl.program_id(0)
    c = tl.arange(0, SP)
    valid = c < S
    at = row * S + c
    maxes = tl.load(max_ptr + at, mask=valid, other=float("-inf"))
    row_max = tl.max(maxes, 0)
    sums = tl.load(sum_ptr + at, mask=valid, other=0.0)
    lse = row_max + tl.log(tl.sum(sums * tl.exp(tl.where(maxes == float("-inf"), float("-inf"), maxes - row_max)), 0))
    scores = tl.load(score_ptr + at, mask=valid, other=float("-inf"))
    indices = tl.load(index_ptr + at, mask=valid, other=V)
    top = tl.max(scores, 0)
    index = tl.min(tl.where(valid & (scores == top), indices, V), 0)  # the lowest index among equal scores
    logit = tl.max(tl.where(valid & (indices == index), tl.load(logit_ptr + at, mask=valid, other=float("-inf")), float("-inf")), 0)
    tl.store(tokens_ptr + row, index.to(tl.int64))
    tl.store(logprobs_ptr + row, logit - lse)


def sample_unfiltered(logits: Tensor, temperatures: Tensor, keys: Tensor, chunk: int = 8192) -> tuple[Tensor, Tensor]:
    """Gumbel-max over logits [B, V] of rows without top-k/top-p/min-p -> (token_ids [B], logprobs [B])."""
    batch, vocab_size = logits.shape
    tile = 1024
    chunk = max(tile, min(chunk, triton.next_power_of_2(vocab_size)))
    chunks = triton.cdiv(vocab_size, chunk)
    parts = torch.empty(4, batch, chunks, dtype=torch.float32, device=logits.device)  # max, sum, score, logit
    indices = torch.empty(batch, chunks, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    _sample_chunk_kernel[(batch, chunks)](
        logits, temperatures, keys, parts[0], parts[1], parts[2], indices, parts[3],
        logits.stride(0), vocab_size, chunks, CHUNK=chunk, TILE=tile, num_warps=4,
    )  # fmt: skip
    _sample_combine_kernel[(batch,)](
        parts[0], parts[1], parts[2], indices, parts[3], tokens, logprobs, vocab_size, chunks, SP=max(16, triton.next_power_of_2(chunks)),
    )  # fmt: skip
    return tokens, logprobs
