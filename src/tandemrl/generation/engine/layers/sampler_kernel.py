"""Triton fused Gumbel-max sampling, the GPU path of sampler.py's `sample`: rows without filters
(`sample_unfiltered`), and rows with top-k, top-p or min-p (`sample_filtered`: thresholds searched, no sort).

Legend: B rows, V vocab. Same noise hash as sampler.py (lowbias32), so both paths draw the same tokens
(but for near-ties: on a GPU the noise's logs are lg2.approx, within 1e-5 of exact; see _gumbel).
Imported only on CUDA; tests/gpu checks it against sampler.py.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def mix32(x):
    # sampler.mix32 (lowbias32) on uint32 values, or on int64 ones in [0, 2^32) (state_kernel.py's keys: the
    # same operations as torch's in the same width; the second product may wrap in int64, its low 32 bits exact)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _lg2_approx(x):
    # the GPU's lg2.approx: one special-function op (tl.log is libdevice's logf, ~20 instructions); its error
    # is ~2^-22 absolute for x near 1, relative elsewhere
    return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _gumbel(bits, FAST: tl.constexpr):
    # the standard Gumbel noise -ln(-ln u) of hash bits, u = (bits >> 9 + 0.5) / 2^23 in (0, 1), as sampler.py's
    # gumbel_noise and uniform_of. FAST (on a GPU; the interpreter runs no PTX): both logs through lg2.approx,
    # 1.6x the unfiltered kernel's speed at 512 rows. There the inner e = -ln u of u near 1 is the series of
    # -ln(1 - w) in w = 1 - u (exact: Sterbenz), relative error < 1e-8 for w < 1/16, where lg2's absolute error
    # would be a large relative error of e, and so of the noise of the likeliest winners (e small, noise large).
    # Elsewhere |log2 u| > 0.093 keeps e's relative error under ~2e-6; the outer log adds ~1e-7 to the noise.
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    if not FAST:
        return -tl.log(-tl.log(u))
    w = 1.0 - u
    series = w * (1.0 + w * (0.5 + w * (0.3333333333333333 + w * (0.25 + w * (0.2 + w * 0.16666666666666666)))))
    e = tl.where(w < 0.0625, series, -0.6931471805599453 * _lg2_approx(u))
    return -0.6931471805599453 * _lg2_approx(e)


@triton.jit
def _inv_temperature(temp):
    # 1 / T; 1 for a greedy row (T = 0)
    return tl.where(temp == 0.0, 1.0, 1.0 / tl.where(temp == 0.0, 1.0, temp))


# the kernels' FAST_LOG: lg2.approx on a GPU, tl.log under triton's interpreter (TRITON_INTERPRET=1, which
# triton itself reads when this module's kernels are defined, so it is read here once too)
FAST_LOG = os.environ.get("TRITON_INTERPRET", "0") != "1"


@triton.jit
def _sample_chunk_kernel(
    logits_ptr, temps_ptr, keys_ptr, max_ptr, sum_ptr, score_ptr, index_ptr, logit_ptr,
    stride_b, V, S, CHUNK: tl.constexpr, TILE: tl.constexpr, FAST_LOG: tl.constexpr,
):  # fmt: skip
    # program (row, chunk) over CHUNK vocab entries: the max m of the raw logits, the sum of exp of the
    # tempered logits z = (x - m) / T, and the argmax of z + Gumbel noise (Gumbel-max; greedy rows get no
    # noise) with its z. m comes off before the temperature: logits of ~60 at T = 1e-4 are ~6e5 tempered,
    # where float32's spacing (1/16) put logprobs off by 3e-2. Many chunks per row keep every SM busy; the
    # hash runs in 32-bit integers.
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    greedy = temp == 0.0
    inv_temp = _inv_temperature(temp)
    key = tl.load(keys_ptr + row).to(tl.uint32)
    first = chunk * CHUNK
    run_max = tl.full([TILE], float("-inf"), tl.float32)
    for start in range(0, CHUNK, TILE):  # pass 1, the max (the chunk stays in cache for pass 2)
        v = first + start + tl.arange(0, TILE)
        x = tl.load(logits_ptr + row * stride_b + v, mask=v < V, other=float("-inf")).to(tl.float32)
        run_max = tl.maximum(run_max, x)
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
        z = (tl.load(logits_ptr + row * stride_b + v, mask=valid, other=float("-inf")).to(tl.float32) - shift) * inv_temp
        run_sum += tl.where(valid, tl.exp(z), 0.0)
        noise = tl.where(greedy, 0.0, _gumbel(mix32((key + v.to(tl.uint32) * 0x9E3779B9) & 0xFFFFFFFF), FAST_LOG))
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
def _sample_combine_kernel(temps_ptr, max_ptr, sum_ptr, score_ptr, index_ptr, logit_ptr, tokens_ptr, logprobs_ptr, V, S, SP: tl.constexpr):
    # one program per row over its S chunks: logsumexp of the tempered logits less the row's max, and the
    # best chunk's token. A chunk's sums, scores and logits are relative to its own max: each is moved by
    # (chunk max - row max) / T (0 for the chunk holding the row's max: a greedy row's scores stay exact)
    row = tl.program_id(0)
    inv_temp = _inv_temperature(tl.load(temps_ptr + row))
    c = tl.arange(0, SP)
    valid = c < S
    at = row * S + c
    maxes = tl.load(max_ptr + at, mask=valid, other=float("-inf"))
    row_max = tl.max(maxes, 0)
    offsets = tl.where(maxes == float("-inf"), float("-inf"), (maxes - row_max) * inv_temp)
    sums = tl.load(sum_ptr + at, mask=valid, other=0.0)
    lse = tl.log(tl.sum(sums * tl.exp(offsets), 0))
    scores = tl.load(score_ptr + at, mask=valid, other=float("-inf")) + offsets
    indices = tl.load(index_ptr + at, mask=valid, other=V)
    top = tl.max(scores, 0)
    index = tl.min(tl.where(valid & (scores == top), indices, V), 0)  # the lowest index among equal scores
    logit = tl.max(tl.where(valid & (indices == index), tl.load(logit_ptr + at, mask=valid, other=float("-inf")) + offsets, float("-inf")), 0)
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
        logits.stride(0), vocab_size, chunks, CHUNK=chunk, TILE=tile, FAST_LOG=FAST_LOG, num_warps=4,
    )  # fmt: skip
    _sample_combine_kernel[(batch,)](
        temperatures, parts[0], parts[1], parts[2], indices, parts[3], tokens, logprobs, vocab_size, chunks, SP=max(16, triton.next_power_of_2(chunks)),
    )  # fmt: skip
    return tokens, logprobs


@triton.jit
def _key32(x, SHIFT: tl.constexpr):
    # float32 -> int32 key in the floats' order (the sign-magnitude bits of a negative flipped); SHIFT drops
    # low bits that are always zero (16 for bf16 logits), so a search over keys takes few rounds
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits) >> SHIFT


@triton.jit
def _at_least(t, SHIFT: tl.constexpr):
    # the smallest float32 whose key is >= t (_key32's inverse at the bottom of key t), so a pass compares each
    # logit with one float (x >= _at_least(t)) instead of computing its key. Floats compare -0.0 equal to 0.0,
    # as torch's sort does (their keys differ: -1 and 0; no logit lies between them, so F(-1) = F(0)); past
    # the largest key (+inf's) it is NaN, which no logit reaches. -inf's key also holds NaN bit patterns below
    # -inf's own (the bits flipped: -inf is 0x807FFFFF), so its bottom is clamped to -inf
    low = tl.maximum(t.to(tl.int32) << SHIFT, -2139095041)
    return tl.where(low < 0, low ^ 0x7FFFFFFF, low).to(tl.float32, bitcast=True)


@triton.jit
def _key_of(x, SHIFT: tl.constexpr):
    # one float's key, -0.0 read as 0.0 (a row's range starts and ends at keys the searches can land on)
    return _key32(tl.where(x == 0.0, 0.0, x), SHIFT).to(tl.int64)


@triton.jit
def _row_start(temps_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row_ptr, row, V, SHIFT: tl.constexpr, TILE: tl.constexpr):
    # a filtered row's start: its sampling settings (greedy rows are not filtered, as sampler.sample), then
    # pass 1: the largest and smallest logits, and their keys (int64: a bisection's midpoint never overflows)
    temp = tl.load(temps_ptr + row)
    greedy = temp == 0.0
    inv_temp = _inv_temperature(temp)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.where(greedy, 0.0, tl.load(min_p_ptr + row))
    run_max = tl.full([TILE], float("-inf"), tl.float32)
    run_min = tl.full([TILE], float("inf"), tl.float32)
    for start in range(0, V, TILE):
        v = start + tl.arange(0, TILE)
        x = tl.load(row_ptr + v, mask=v < V, other=float("-inf")).to(tl.float32)
        run_max = tl.maximum(run_max, x)
        run_min = tl.minimum(run_min, tl.where(v < V, x, float("inf")))
    top = tl.max(run_max, 0)
    return temp, inv_temp, top_k, top_p, min_p, top, _key_of(tl.min(run_min, 0), SHIFT), _key_of(top, SHIFT)


@triton.jit
def _mass_of_top_k(lo_count, lo_mass, above_count, above_mass, top_k):
    # F(lo)'s mass once the tied logits at lo past the top_k-th are dropped (ties have equal masses), from
    # F(lo) = (lo_count, lo_mass) and F(lo + 1) = (above_count, above_mass)
    return above_mass + (lo_mass - above_mass) / (lo_count - above_count) * (top_k - above_count)


@triton.jit
def _count_of_top_p(target, lo_count, lo_mass, above_count, above_mass):
    # how many logits stay at or above top-p's threshold lo: all above it, and of the tied ones at lo (equal
    # masses) the j-th while the mass before it is under the target
    tied = lo_count - above_count
    each = (lo_mass - above_mass) / tied
    return above_count + tl.minimum(tied, tl.maximum(1, tl.ceil((target - above_mass) / each).to(tl.int32)))


@triton.jit
def _draw_kept(
    row_ptr, row, V, lo, keep_tied, tied, top_k, top_p, min_p, temp, top, inv_temp, keys_ptr, tokens_ptr, logprobs_ptr, floors_ptr,
    SHIFT: tl.constexpr, TILE: tl.constexpr, FAST_LOG: tl.constexpr,
):  # fmt: skip
    # the last pass over a row, once its threshold key lo is known (the logits whose key is above lo stay, and
    # of those whose key is lo the first keep_tied): min-p, then Gumbel-max among the kept, their mass, the
    # lowest kept and highest excluded logit; stores the token, its logprob under the kept set and the floor.
    # tied: at least how many keys are lo; only where keep_tied is less are the ties ranked (a scan a tile)
    greedy = temp == 0.0
    key_seed = tl.load(keys_ptr + row).to(tl.uint32)
    at_lo = _at_least(lo, SHIFT)
    above_lo = _at_least(lo + 1, SHIFT)
    partial = keep_tied < tied
    tied_before = tl.sum(tl.zeros([TILE], tl.int32), 0)
    kept_mass = tl.zeros([TILE], tl.float32)
    kept_min = tl.full([TILE], float("inf"), tl.float32)
    excluded_max = tl.full([TILE], float("-inf"), tl.float32)
    best_score = tl.full([TILE], float("-inf"), tl.float32)
    best_z = tl.full([TILE], float("-inf"), tl.float32)
    best_index = tl.full([TILE], -1, tl.int32)
    for start in range(0, V, TILE):
        v = start + tl.arange(0, TILE)
        valid = v < V
        x = tl.load(row_ptr + v, mask=valid, other=float("-inf")).to(tl.float32)
        z = (x - top) * inv_temp
        e = tl.exp(z)
        stays = valid & (x >= at_lo)
        if partial:  # a threshold inside a tie: its first keep_tied stay, as a stable sort would keep
            tie = stays & ~(x >= above_lo)
            rank = tied_before + tl.cumsum(tie.to(tl.int32), 0) - 1
            tied_before += tl.sum(tie.to(tl.int32), 0)
            stays = valid & ((x >= above_lo) | (tie & (rank < keep_tied)))
        keep = stays & (e >= min_p)
        kept_mass += tl.where(keep, e, 0.0)
        kept_min = tl.minimum(kept_min, tl.where(keep, x, float("inf")))
        excluded_max = tl.maximum(excluded_max, tl.where(valid & ~keep, x, float("-inf")))
        noise = tl.where(greedy, 0.0, _gumbel(mix32((key_seed + v.to(tl.uint32) * 0x9E3779B9) & 0xFFFFFFFF), FAST_LOG))
        score = tl.where(keep, z + noise, float("-inf"))
        better = score > best_score
        best_score = tl.where(better, score, best_score)
        best_z = tl.where(better, z, best_z)
        best_index = tl.where(better, v, best_index)
    best = tl.max(best_score, 0)
    index = tl.min(tl.where(best_score == best, best_index, V), 0)
    z = tl.max(tl.where(best_index == index, best_z, float("-inf")), 0)
    tl.store(tokens_ptr + row, index.to(tl.int64))
    tl.store(logprobs_ptr + row, z - tl.log(tl.sum(kept_mass, 0)))
    # the floor (sampler.logit_floors): halfway between the lowest kept and highest excluded tempered logit;
    # -inf where the row filters nothing, is greedy, or excludes nothing
    low, high = tl.min(kept_min, 0), tl.max(excluded_max, 0)
    filters = ((top_k < V) | (top_p < 1.0) | (min_p > 0.0)) & (temp != 0.0) & (high > float("-inf"))
    tl.store(floors_ptr + row, tl.where(filters, (low * inv_temp + high * inv_temp) * 0.5, float("-inf")))


@triton.jit
def _sums_from(src_ptr, n, threshold, top, inv_temp, SHIFT: tl.constexpr, TILE: tl.constexpr, MASS: tl.constexpr):
    # (count, sum of exp((x - top) / T)) of src[0:n] whose key is >= threshold (a key within the row's
    # range); the sum only when MASS (a top-k round counts, no exp). Compares floats (_at_least), the tail
    # past n loaded as NaN, which compares false; the exp as exp2 of (x - top) * scale (not an FMA of x * scale -
    # top * scale: the logits tied with the top must weigh exactly 1, or a tie's share comes out one off)
    at = _at_least(threshold, SHIFT)
    scale = inv_temp * 1.4426950408889634  # log2(e)
    count = tl.zeros([TILE], tl.int32)
    mass = tl.zeros([TILE], tl.float32)
    for start in range(0, n, TILE):
        v = start + tl.arange(0, TILE)
        x = tl.load(src_ptr + v, mask=v < n, other=float("nan")).to(tl.float32)
        above = x >= at
        count += above.to(tl.int32)
        if MASS:
            mass += tl.where(above, tl.exp2((x - top) * scale), 0.0)
    return tl.sum(count, 0), tl.sum(mass, 0)


@triton.jit
def _compact(row_ptr, V, lo, hi, list_ptr, top, inv_temp, SHIFT: tl.constexpr, TILE: tl.constexpr, MASS: tl.constexpr):
    # writes the row's logits (as float32) whose key lies in [lo, hi] to list_ptr, in index order; (their
    # count, and where MASS, the masses of those and of those above lo, as _sums_from: exp2 of (x - top) *
    # scale). Top-p after top-k lists its bracket [lo, top key] with both masses in this one pass
    at_lo = _at_least(lo, SHIFT)
    above_lo = _at_least(lo + 1, SHIFT)  # NaN where lo is the top key: nothing above
    above_hi = _at_least(hi + 1, SHIFT)
    scale = inv_temp * 1.4426950408889634  # log2(e)
    n = tl.sum(tl.zeros([TILE], tl.int32), 0)
    mass_at = tl.zeros([TILE], tl.float32)
    mass_above = tl.zeros([TILE], tl.float32)
    for start in range(0, V, TILE):
        v = start + tl.arange(0, TILE)
        x = tl.load(row_ptr + v, mask=v < V, other=float("nan")).to(tl.float32)
        inside = (x >= at_lo) & ~(x >= above_hi)  # (not x < above_hi: NaN there must stay out)
        at = n + tl.cumsum(inside.to(tl.int32), 0) - 1
        tl.store(list_ptr + at, x, mask=inside)
        n += tl.sum(inside.to(tl.int32), 0)
        if MASS:
            e = tl.exp2((x - top) * scale)
            mass_at += tl.where(inside, e, 0.0)
            mass_above += tl.where(x >= above_lo, e, 0.0)
    return n, tl.sum(mass_at, 0), tl.sum(mass_above, 0)


@triton.jit
def _search(
    row_ptr, list_ptr, V, lo, hi, lo_raw, lo_count, lo_mass, above_count, above_mass, goal, top, inv_temp, listed, n,
    CAPACITY: tl.constexpr, BY_MASS: tl.constexpr, SHIFT: tl.constexpr, TILE: tl.constexpr, VALUE_ROUNDS: tl.constexpr,
):  # fmt: skip
    # bisection for the largest key t in [lo, hi] whose F(t) = (count, mass of keys >= t) reaches goal (a count
    # when not BY_MASS, else a mass); F(lo) reaches it, F(hi + 1) = (above_count, above_mass); lo_raw: how many
    # keys are >= lo (lo_count may be less: top-k's share of a tie). Once the keys inside [lo, hi] fit in
    # CAPACITY they are copied out in one pass, and later rounds read that list, not the row: F(t) = F at
    # the copy's hi + 1 (base) + the list's part. listed = 1: the list already holds the n keys >= lo, and
    # hi is the row's top key (nothing above it: base 0).
    # base_* start as values of their own, not as above_count / above_mass themselves: triton finds a while
    # loop's carried variables by a dry visit of its body, where `base_count = above_count` then changed
    # nothing, so the GPU build did not carry them and a round after the copy read F(hi + 1) as the value
    # before the loop (0): top-p alone, whose first rounds miss, found the wrong threshold (the interpreter
    # runs the Python and was right)
    base_count = lo_raw * 0
    base_mass = above_mass * 0.0
    value_rounds = lo_raw * 0
    while lo < hi:
        if (CAPACITY > 0) & (listed == 0) & (lo_raw - above_count <= CAPACITY) & (hi - lo > 2):
            n, _, _ = _compact(row_ptr, V, lo, hi, list_ptr, top, inv_temp, SHIFT, TILE, False)
            listed = n * 0 + 1
            base_count, base_mass = above_count, above_mass
        mid = lo + (hi - lo + 1) // 2
        if (listed == 0) & (value_rounds < VALUE_ROUNDS):
            # the rounds over the row split the bracket's values, not its keys: logits spread evenly in
            # value, and half the keys between two logits of one sign are the floats nearer zero (a bisection
            # of keys took ~9 rounds over a normal row before its top k fit in a list; by value ~3, top-p 0.9
            # ~5-6). Only where both ends are ordinary logits (a row masked with -1e30 or -inf splits by key
            # until its bracket is), and at most VALUE_ROUNDS of them: the key bisection bounds the rest.
            # (Stopping earlier cost more: a row whose bracket is not listed yet then bisects keys near zero,
            # and one such row sets a wave's time: 4 rounds were 0.90x of none at top-p 0.5 on flat rows)
            low, high = _at_least(lo, SHIFT), _at_least(hi, SHIFT)
            if (tl.abs(low) < 65536.0) & (tl.abs(high) < 65536.0):
                value_rounds += 1
                mid = tl.minimum(tl.maximum(_key_of(0.5 * low + 0.5 * high, SHIFT), lo + 1), hi)
        if listed == 1:
            count, mass = _sums_from(list_ptr, n, mid, top, inv_temp, SHIFT, TILE, BY_MASS)
            count, mass = count + base_count, mass + base_mass
        else:
            count, mass = _sums_from(row_ptr, V, mid, top, inv_temp, SHIFT, TILE, BY_MASS)
        if BY_MASS:
            reached = mass >= goal
        else:
            reached = count >= goal
        if reached:
            lo, lo_raw, lo_count, lo_mass = mid, count, count, mass
        else:
            hi, above_count, above_mass = mid - 1, count, mass
    return lo, lo_raw, lo_count, lo_mass, above_count, above_mass


@triton.jit
def _sample_filtered_kernel(
    logits_ptr, temps_ptr, top_k_ptr, top_p_ptr, min_p_ptr, keys_ptr, tokens_ptr, logprobs_ptr, floors_ptr, lists_ptr,
    stride_b, V, CAPACITY: tl.constexpr, SHIFT: tl.constexpr, TILE: tl.constexpr, VALUE_ROUNDS: tl.constexpr, FAST_LOG: tl.constexpr,
):  # fmt: skip
    # one program per row: top-k, then top-p, then min-p as thresholds on the logits' order (searched as
    # int32 keys; a pass compares each logit with the threshold's float, _at_least), found by bisection
    # (_search: a pass over the row a round, no sort); then one pass draws the Gumbel-max
    # sample among the kept tokens. Ties at a threshold keep the lowest indices, as a stable sort would
    # (sampler.filter_logits). The row's total mass only where top-p needs it; top-k's rounds count without
    # exp (the masses at its threshold in one pass after, where top-p follows); each search reads a list of
    # the keys left inside its bracket once they fit in CAPACITY (top-p after top-k: the top k, from its first
    # round) instead of the row. (One program on purpose: the searches and the draw share the row's max,
    # keys and running sums in registers.)
    row = tl.program_id(0)
    row_ptr = logits_ptr + row * stride_b
    list_ptr = lists_ptr + row * CAPACITY
    temp, inv_temp, top_k, top_p, min_p, top, lo, hi = _row_start(temps_ptr, top_k_ptr, top_p_ptr, min_p_ptr, row_ptr, row, V, SHIFT, TILE)
    key_top = hi
    lo_count = (V * 0 + V).to(tl.int32)  # F(lo): every logit
    lo_raw = lo_count
    lo_mass = tl.sum(tl.zeros([TILE], tl.float32), 0)
    above_count = lo_count * 0
    above_mass = lo_mass
    use_k = (top_k < V) & (temp != 0.0)
    use_p = (top_p < 1.0) & (temp != 0.0)
    listed = lo_count * 0  # top-p's search starts from a list of the keys >= lo (n of them) where listed
    n = lo_count * 0
    if use_p & (top_k >= V):  # top-p alone: F(lo) is the whole row's mass
        _, lo_mass = _sums_from(row_ptr, V, lo, top, inv_temp, SHIFT, TILE, True)
    if use_k:  # the largest key with at least top_k logits at or above it
        lo, lo_raw, lo_count, lo_mass, above_count, above_mass = _search(
            row_ptr, list_ptr, V, lo, hi, lo_raw, lo_count, lo_mass, above_count, above_mass, top_k, top, inv_temp, listed, n,
            CAPACITY, False, SHIFT, TILE, VALUE_ROUNDS,
        )  # fmt: skip
        if use_p:  # the masses at and above the threshold, which top-p's target needs
            if (CAPACITY > 0) & (lo_raw <= CAPACITY):  # and the top k listed for top-p's search, in one pass
                n, lo_mass, above_mass = _compact(row_ptr, V, lo, key_top, list_ptr, top, inv_temp, SHIFT, TILE, True)
                listed = n * 0 + 1
            else:
                _, lo_mass = _sums_from(row_ptr, V, lo, top, inv_temp, SHIFT, TILE, True)
                if lo < key_top:
                    _, above_mass = _sums_from(row_ptr, V, lo + 1, top, inv_temp, SHIFT, TILE, True)
                else:
                    above_mass = lo_mass * 0.0
        lo_mass = _mass_of_top_k(lo_count, lo_mass, above_count, above_mass, top_k)
        lo_count = top_k.to(tl.int32)
    if use_p:  # the largest key whose logits at or above it reach top_p of the mass
        target = top_p * lo_mass
        lo, lo_raw, lo_count, lo_mass, above_count, above_mass = _search(
            row_ptr, list_ptr, V, lo, key_top, lo_raw, lo_count, lo_mass, above_count * 0, above_mass * 0.0, target, top, inv_temp,
            listed, n, CAPACITY, True, SHIFT, TILE, VALUE_ROUNDS,
        )  # fmt: skip
        lo_count = _count_of_top_p(target, lo_count, lo_mass, above_count, above_mass)
    keep_tied = lo_count - above_count  # of the logits whose key is lo, the first keep_tied stay
    tied = lo_raw - above_count  # at least as many keys are lo (exactly, once a search has closed on lo)
    _draw_kept(
        row_ptr, row, V, lo, keep_tied, tied, top_k, top_p, min_p, temp, top, inv_temp, keys_ptr, tokens_ptr, logprobs_ptr, floors_ptr,
        SHIFT, TILE, FAST_LOG,
    )  # fmt: skip


def sample_filtered(
    logits: Tensor, temperatures: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor, keys: Tensor, *, capacity: int = 16384, tile: int = 4096,
    num_warps: int = 16, value_rounds: int = 8,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gumbel-max over logits [B, V] after each row's top-k, top-p and min-p (sampler.filter_logits'
    order) -> (token_ids [B], logprobs [B] under the filtered distribution, floors [B]: sampler.logit_floors,
    halfway between the lowest kept and the highest excluded tempered logit, -inf where nothing is excluded).

    Cost: a row of V logits is read twice (its max and key range; the draw), once more for top-p's total
    mass (top-p after top-k: once for both masses and the top k's list), and once per bisection round of
    each filter it uses until the keys left in the bracket fit in `capacity` (float32 scratch of [B,
    capacity]; 0: never): later rounds read that list. Up to `value_rounds` rounds over the row split the
    bracket's values (~3 for top-k 50 on a normal row, ~5-6 for top-p 0.9), the others its keys (at most
    the log2 of its distinct logit values: ~16 for bf16 logits, ~32 for float32). Never sorted. tile,
    num_warps: one program's tile of the row and its warps. The defaults were the fastest of bench/decode.py
    --only sampler --sweep's 18 settings on an H200 for top-p 0.9 and for top-k 50 (1.22-1.25x the last
    defaults, 2048 and 4096; figures: bench/RESULTS.md)."""
    batch, vocab_size = logits.shape
    shift = {torch.bfloat16: 16, torch.float16: 13}.get(logits.dtype, 0)
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    floors = torch.empty(batch, dtype=torch.float32, device=logits.device)
    lists = torch.empty(batch, max(capacity, 1), dtype=torch.float32, device=logits.device)
    _sample_filtered_kernel[(batch,)](
        logits, temperatures, top_k, top_p, min_p, keys, tokens, logprobs, floors, lists,
        logits.stride(0), vocab_size, CAPACITY=capacity, SHIFT=shift, TILE=tile, VALUE_ROUNDS=value_rounds, FAST_LOG=FAST_LOG, num_warps=num_warps,
    )  # fmt: skip
    return tokens, logprobs, floors
