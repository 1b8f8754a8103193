"""Paged attention: write this step's keys and values into their cache slots, then attend over the cache.

Legend: N new tokens of the step, B sequences, Q most new tokens of one sequence, C longest context,
H query heads, K key/value heads, D head dim.

Every layer writes the KV of all N tokens before any query reads, so a sequence may read blocks that
another sequence of the same step is filling (prefix sharing inside one prefill batch).
Four read paths, each with its own metadata type: `gather` (pure PyTorch: gather each sequence's context, masked SDPA; CPU, and
float32 prefill on GPU), `paged prefill` (GPU prefill in 16-bit, the default: a Triton kernel reads each
sequence's context through its block table straight from the cache, in tiles of one sequence's queries,
causal from the bottom right so a sequence whose prefix is cached attends to all of it), `varlen` (the
same prefill through torch's variable-length flash attention, which needs each layer's context copied
out of the cache first: kept as the baseline bench/prefill.py measures against) and the Triton paged
decode kernel (GPU decode, one query per sequence).
What differs between layers (a sliding window, a score scale, a tanh soft cap: Mistral, Gemma 2/3) is the
layer's `AttentionOptions`, applied by every path alike.
"""

from __future__ import annotations

import array
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """One layer's attention rule. `window` W > 0: a query at position p sees keys p - W + 1 .. p (its last W
    tokens, transformers' sliding window); `softcap` c > 0: scores become c * tanh(score / c) (Gemma 2)."""

    scale: float  # scores are q . k * scale (head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5)
    window: int = 0
    softcap: float = 0.0


@dataclass(slots=True)
class GatherMetadata:
    """The pure-PyTorch path: each sequence's context gathered and padded, then masked SDPA."""

    slot_mapping: Tensor  # [N] int64 cache slot of each new token
    query_index: Tensor  # [B, Q] row in N of each (sequence, query); padding points anywhere
    key_slots: Tensor  # [B, C] cache slot of each context position; padding -> slot 0
    mask: Tensor  # [B, 1, Q, C] True = may attend
    output_index: Tensor  # [N] row in B*Q of each new token
    distance: Tensor  # [B, 1, Q, C] query position - key position (a sliding window masks distance >= W)


@dataclass(slots=True)
class VarlenMetadata:
    """GPU prefill in 16-bit: contexts packed without padding, torch's variable-length flash attention."""

    slot_mapping: Tensor  # [N] int64 cache slot of each new token
    cu_seq_q: Tensor  # [B+1] int32 start of each sequence's queries in N
    cu_seq_k: Tensor  # [B+1] int32 start of each sequence's context in packed_key_slots
    packed_key_slots: Tensor  # [sum of context lengths] cache slot of each context position
    max_q: int
    max_k: int
    num_queries: int  # N: rows past it are the runner's padding (runner.padded_num_tokens)


@dataclass(slots=True)
class PagedPrefillMetadata:
    """GPU prefill in 16-bit: the Triton kernel reads each sequence's context through its block table.
    Query tiles: tile t computes queries tile_starts[t] .. + tile_queries of sequence tile_seqs[t]; tiles
    whose sequence is B (past the last) are spare (their count is known on the host, without a sync)."""

    slot_mapping: Tensor  # [N] int64 cache slot of each new token
    cu_seq_q: Tensor  # [B+1] int32 start of each sequence's queries in N
    context_lens: Tensor  # [B] int32 positions each sequence has, its new tokens included
    block_tables: Tensor  # [B, M] block of each sequence's every block_size positions
    tile_seqs: Tensor  # [T] int32
    tile_starts: Tensor  # [T] int32
    block_size: int
    tile_queries: int
    num_queries: int | None  # N: rows past it are the runner's padding (runner.padded_num_tokens); None: not known
    # on the host (a prefill graph's, prefill_graphs.py): the output starts as zeros, so padded rows stay zeros


@dataclass(slots=True)
class DecodeMetadata:
    """GPU decode: one query per sequence, read through its block table by the Triton kernel."""

    slot_mapping: Tensor  # [B] int64 cache slot of each new token
    block_tables: Tensor  # [B, M] int32
    context_lens: Tensor  # [B] int32
    block_size: int


# Where this step's tokens sit in the cache: built once per step by the runner, read by every layer;
# its type is the read path.
AttentionMetadata = GatherMetadata | PagedPrefillMetadata | VarlenMetadata | DecodeMetadata


def paged_attention(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata, *, cached: bool = False,
    options: AttentionOptions | None = None,
) -> Tensor:
    """q [N, H, D], k/v [N, K, D], caches [S, K, D] (S slots) -> [N, H, D]. `cached`: k and v are
    already in their slots (the GPU path writes them in its RoPE kernel). `options`: the layer's rule
    (None: causal over the whole context, scale D ** -0.5)."""
    options = options or AttentionOptions(scale=q.shape[-1] ** -0.5)
    if not cached:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    match meta:
        case DecodeMetadata():
            from tandemrl.generation.engine.layers.attention_kernel import decode_attention

            return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.block_size, options=options)
        case PagedPrefillMetadata():
            out = paged_prefill_attention(q, k_cache, v_cache, meta, options)
            if meta.num_queries is not None and len(q) > meta.num_queries:  # padded rows: zeros, not what torch.empty held
                out[meta.num_queries :] = 0  # (their KV lands in the scratch slot 0)
            return out
        case VarlenMetadata():
            out = varlen_attention(q, k_cache, v_cache, meta, options)
            if len(q) > meta.num_queries:  # padded rows: zeros, not what flash left there (their KV lands in the scratch slot 0)
                out[meta.num_queries :] = 0
            return out
        case GatherMetadata():
            return gather_attention(q, k_cache, v_cache, meta, options)


@functools.cache
def flash_varlen_available() -> bool:
    """Whether this torch was built with flash attention, whose variable-length form the GPU prefill calls."""
    return torch.backends.cuda.is_flash_attention_available()


def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: PagedPrefillMetadata, options: AttentionOptions | None = None) -> Tensor:
    """The Triton kernel (attention_kernel.prefill_attention): rows no tile covers are not written (zeros when
    meta.num_queries is None)."""
    from tandemrl.generation.engine.layers.attention_kernel import prefill_attention

    return prefill_attention(q, k_cache, v_cache, meta, options=options)


def varlen_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: VarlenMetadata, options: AttentionOptions | None = None) -> Tensor:
    if options is not None and (options.softcap or options.window or options.scale != q.shape[-1] ** -0.5):
        raise ValueError("the varlen prefill (runner.paged_prefill=False) serves plain causal attention only; keep paged_prefill on")
    keys, values = k_cache[meta.packed_key_slots], v_cache[meta.packed_key_slots]  # [sum C, K, D]
    # flash attention's own GQA: each key/value head is read once for its group of H / K query heads.
    # torch's varlen_attn wrapper (2.11) lacks enable_gqa, and repeating K/V to H heads first cost
    # 2 * H / K copies of every context position per layer (most of a cached-prefix prefill's attention);
    # the aten op below is what varlen_attn calls, its positional schema unchanged since torch 2.5.
    # is_causal aligns the mask bottom right: a sequence's queries see its whole cached prefix.
    out, *_ = torch.ops.aten._flash_attention_forward(
        q, keys, values, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k, 0.0, True, False
    )  # fmt: skip
    return out


def decode_chunks(context_len: int, splits: int, min_chunk: int, tile: int) -> list[tuple[int, int]]:
    """The key ranges [start, end) the split-KV decode kernel (attention_kernel.decode_attention) cuts one
    context's keys into (with a sliding window, the window's keys, counted from its first): min(splits,
    ceil(C / min_chunk)) chunks of whole tiles; a last one may be empty.

    Example: decode_chunks(1000, 4, 256, 64) -> [(0, 256), (256, 512), (512, 768), (768, 1000)];
    decode_chunks(100, 4, 256, 64) -> [(0, 100)] (one chunk: the short-context path, no merge)
    """
    num = min(splits, -(-context_len // min_chunk))
    chunk = -(-(-(-context_len // num)) // tile) * tile
    return [(min(s * chunk, context_len), min((s + 1) * chunk, context_len)) for s in range(num)]


def merge_chunks(outs: Tensor, lses: Tensor) -> Tensor:
    """Attention over a whole context from its chunks' (flash-decoding's reduction): outs [S, H, D] each
    chunk's softmax-normalised output, lses [S, H] the log-sum-exp of its scores (-inf for an empty chunk)
    -> [H, D], each chunk weighted by its share of the softmax mass, exp(lse_s - logsumexp_s lse_s).
    The kernel's _merge_splits_kernel computes the same."""
    weights = torch.softmax(lses, dim=0)  # [S, H]
    return (weights[:, :, None] * outs.nan_to_num()).sum(0)


def gather_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: GatherMetadata, options: AttentionOptions | None = None) -> Tensor:
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    batch, width = meta.query_index.shape
    options = options or AttentionOptions(scale=q.shape[-1] ** -0.5)
    queries = q[meta.query_index].transpose(1, 2)  # [B, H, Q, D]
    keys = _repeat_kv(k_cache[meta.key_slots], num_heads // num_kv_heads)  # [B, H, C, D]
    values = _repeat_kv(v_cache[meta.key_slots], num_heads // num_kv_heads)
    mask = meta.mask if not options.window else meta.mask & (meta.distance < options.window)  # [B, 1, Q, C]
    if options.softcap:  # SDPA has no soft cap: the scores written out (transformers' eager order: scale, cap, mask)
        scores = (queries @ keys.transpose(-1, -2)) * options.scale  # [B, H, Q, C]
        scores = torch.tanh(scores / options.softcap) * options.softcap
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1, dtype=torch.float32).to(q.dtype)
        out = probs @ values
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=options.scale)  # [B, H, Q, D]
    return out.transpose(1, 2).reshape(batch * width, num_heads, -1)[meta.output_index]


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    """[B, C, K, D] -> [B, K*groups, C, D]; query head h reads key head h // groups (as transformers)."""
    batch, ctx, num_kv_heads, dim = x.shape
    if groups > 1:
        x = x[:, :, :, None, :].expand(batch, ctx, num_kv_heads, groups, dim).reshape(batch, ctx, -1, dim)
    return x.transpose(1, 2)


def build_gather_metadata(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int, device: torch.device
) -> GatherMetadata:
    """Metadata of a step where sequence b computes its last query_lens[b] of context_lens[b] positions.

    Example: query_lens [2, 1], context_lens [2, 3], block_size 2, tables [[5], [7, 8]] ->
    slot_mapping [10, 11, 16]; sequence 1's query at position 2 sees slots [14, 15, 16].
    """
    width, ctx = max(query_lens), max(context_lens)
    positions = torch.arange(ctx)
    num_blocks = -(-ctx // block_size)
    tables = torch.tensor([t[:num_blocks] + [0] * (num_blocks - len(t[:num_blocks])) for t in block_tables])  # [B, M]
    key_slots = tables[:, positions // block_size] * block_size + positions % block_size  # [B, C]
    lens = torch.tensor(context_lens)
    qlens = torch.tensor(query_lens)
    key_slots = key_slots.masked_fill(positions[None, :] >= lens[:, None], 0)
    q_pos = (lens - qlens)[:, None] + torch.arange(width)[None, :]  # [B, Q] position of each query
    valid = torch.arange(width)[None, :] < qlens[:, None]  # [B, Q]
    q_pos = q_pos.masked_fill(~valid, 0)  # padded queries see position 0 only: no all-masked rows
    distance = q_pos[:, :, None] - positions[None, None, :]  # [B, Q, C]
    mask = distance >= 0
    starts = torch.cumsum(qlens, 0) - qlens
    query_index = (starts[:, None] + torch.arange(width)[None, :]).masked_fill(~valid, 0)
    output_index = (torch.arange(len(query_lens))[:, None] * width + torch.arange(width)[None, :])[valid]
    slot_mapping = key_slots.gather(1, ((lens - qlens)[:, None] + torch.arange(width)[None, :]).clamp(max=ctx - 1))
    return GatherMetadata(
        slot_mapping=slot_mapping[valid].to(device, non_blocking=True),
        query_index=query_index.to(device, non_blocking=True),
        key_slots=key_slots.to(device, non_blocking=True),
        mask=mask[:, None].to(device, non_blocking=True),
        output_index=output_index.to(device, non_blocking=True),
        distance=distance[:, None].to(device, non_blocking=True),
    )


def build_varlen_metadata(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int, device: torch.device
) -> VarlenMetadata:
    """As build_gather_metadata, for the varlen path: no padding, no mask; the same slot_mapping.

    Example: query_lens [2, 1], context_lens [2, 3], block_size 2, tables [[5], [7, 8]] ->
    packed_key_slots [10, 11, 14, 15, 16], cu_seq_k [0, 2, 5], cu_seq_q [0, 2, 3], slot_mapping [10, 11, 16].
    """
    qlens, lens = torch.tensor(query_lens, device=device), torch.tensor(context_lens, device=device)
    positions = token_positions(qlens, lens, sum(query_lens))
    tables = padded_tables(block_tables).to(device)
    return varlen_metadata(qlens, lens, tables, positions, block_size, max_q=max(query_lens), max_k=max(context_lens), num_keys=sum(context_lens))


def int_tensor(values: Iterable[int] | array.array, dtype: torch.dtype = torch.int64) -> Tensor:
    """A 1-D host tensor of `values` (an array.array of the dtype's typecode is taken as is, no copy).
    Through array.array: ~10x faster than torch.tensor on a list of ints (~5 ms for a prefill's 16k ids).

    Example: int_tensor([3, 1], torch.int32) -> tensor([3, 1], dtype=torch.int32)
    """
    typecode = _TYPECODES[dtype]
    values = values if isinstance(values, array.array) and values.typecode == typecode else array.array(typecode, values)
    return torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def padded_tables(block_tables: list[list[int]], dtype: torch.dtype = torch.int64) -> Tensor:
    """[B, M] on the host, each table padded with block 0 to the longest."""
    width = max(map(len, block_tables))
    flat, zeros = array.array(_TYPECODES[dtype]), [0] * width
    for table in block_tables:
        flat.extend(table)
        flat.extend(zeros[len(table) :])
    return int_tensor(flat, dtype).view(len(block_tables), width)


def token_positions(query_lens: Tensor, context_lens: Tensor, num_tokens: int) -> Tensor:
    """[N] position of each computed token: sequence b computes the last query_lens[b] of its
    context_lens[b] positions. On the lengths' device, without a sync (num_tokens = sum of query_lens).

    Example: query_lens [2, 1], context_lens [2, 3] -> [0, 1, 2]
    """
    ends = torch.cumsum(query_lens, 0)
    # row i of sequence b (its rows end at ends[b]) is position context_lens[b] - (ends[b] - i)
    return torch.arange(num_tokens, device=query_lens.device) + torch.repeat_interleave(context_lens - ends, query_lens, output_size=num_tokens)


def varlen_metadata(
    query_lens: Tensor, context_lens: Tensor, block_tables: Tensor, positions: Tensor, block_size: int, *, max_q: int, max_k: int, num_keys: int
) -> VarlenMetadata:
    """build_varlen_metadata from tensors on their device ([B] lengths, [B, M] tables, [N] positions
    from token_positions): a prefill's host sends lengths and tables, not the [N] and [sum C] slots;
    no sync (num_keys = sum of context_lens; max_q and max_k given)."""
    rows = torch.arange(len(query_lens), device=query_lens.device)
    q_owner = torch.repeat_interleave(rows, query_lens, output_size=len(positions))  # [N] sequence of each new token
    k_owner = torch.repeat_interleave(rows, context_lens, output_size=num_keys)  # [sum C] sequence of each context position
    k_ends = torch.cumsum(context_lens, 0)
    k_positions = torch.arange(num_keys, device=query_lens.device) - (k_ends - context_lens)[k_owner]
    return VarlenMetadata(
        slot_mapping=block_tables[q_owner, positions // block_size].to(torch.int64) * block_size + positions % block_size,
        cu_seq_q=F.pad(torch.cumsum(query_lens, 0), (1, 0)).to(torch.int32),
        cu_seq_k=F.pad(k_ends, (1, 0)).to(torch.int32),
        packed_key_slots=block_tables[k_owner, k_positions // block_size].to(torch.int64) * block_size + k_positions % block_size,
        max_q=max_q,
        max_k=max_k,
        num_queries=len(positions),
    )


def prefill_tile_queries(num_heads: int, num_kv_heads: int, head_dim: int = 128) -> int:
    """Queries of one sequence a paged prefill program computes: 128 rows of (query, query head of one
    key/value head's group, padded to a power of two), 16 queries at least; half the rows for a head dim
    over 128 (Gemma's 256: a program's rows x D accumulator stays the size of 128 x 128's).
    Example: 14 heads over 2 -> 16; 8 over 4 at head dim 256 -> 32."""
    group_rows = 1 << (num_heads // num_kv_heads - 1).bit_length()
    rows = 128 if head_dim <= 128 else 64
    return max(16, rows // group_rows)


def paged_prefill_metadata(
    query_lens: Tensor, context_lens: Tensor, block_tables: Tensor, positions: Tensor, block_size: int, *, tile_queries: int
) -> PagedPrefillMetadata:
    """PagedPrefillMetadata from tensors on their device ([B] lengths, [B, M] tables, [N] positions from
    token_positions), without a sync: the tile grid is sized for the worst case, ceil(N / tile_queries) + B.

    Example: query_lens [20, 3], tile_queries 16 -> tiles (sequence, first query) (0, 0), (0, 16), (1, 0), then 1 spare
    """
    num_seqs, num_tokens = len(query_lens), len(positions)
    rows = torch.arange(num_seqs, device=query_lens.device)
    q_owner = torch.repeat_interleave(rows, query_lens, output_size=num_tokens)  # [N] sequence of each new token
    tile_seqs, tile_starts = prefill_tiles(query_lens, num_tokens, tile_queries)
    return PagedPrefillMetadata(
        slot_mapping=block_tables[q_owner, positions // block_size].to(torch.int64) * block_size + positions % block_size,
        cu_seq_q=F.pad(torch.cumsum(query_lens, 0), (1, 0)).to(torch.int32),
        context_lens=context_lens.to(torch.int32),
        block_tables=block_tables,
        tile_seqs=tile_seqs,
        tile_starts=tile_starts,
        block_size=block_size,
        tile_queries=tile_queries,
        num_queries=num_tokens,
    )


def prefill_tiles(query_lens: Tensor, num_rows: int, tile_queries: int) -> tuple[Tensor, Tensor]:
    """The paged prefill kernel's query tiles ([T] int32 sequence, [T] int32 first query within it) for
    [B] query lengths of at most num_rows in all, on their device, without a sync: ceil(num_rows /
    tile_queries) + B tiles, those past the last real one with sequence B (spare).

    Example: query_lens [20, 0, 3], num_rows 23, tile_queries 16 -> sequences [0, 0, 2, 3, 3], firsts [0, 16, 0, ...]
    """
    num_seqs = len(query_lens)
    num_tiles = (query_lens + tile_queries - 1) // tile_queries  # [B]
    tile_ends = torch.cumsum(num_tiles, 0)
    tiles = torch.arange(-(-num_rows // tile_queries) + num_seqs, device=query_lens.device)  # [T]
    tile_seqs = torch.searchsorted(tile_ends, tiles, right=True)  # B past the last tile
    first_tile = (tile_ends - num_tiles)[tile_seqs.clamp(max=num_seqs - 1)]
    return tile_seqs.to(torch.int32), ((tiles - first_tile) * tile_queries).to(torch.int32)


def build_paged_prefill_metadata(
    query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int, device: torch.device, *, tile_queries: int = 16
) -> PagedPrefillMetadata:
    """As build_varlen_metadata, for the paged prefill kernel (the same slot_mapping)."""
    qlens, lens = torch.tensor(query_lens, device=device), torch.tensor(context_lens, device=device)
    positions = token_positions(qlens, lens, sum(query_lens))
    tables = padded_tables(block_tables).to(device)
    return paged_prefill_metadata(qlens, lens, tables, positions, block_size, tile_queries=tile_queries)


def decode_gather_metadata(block_tables: Tensor, context_lens: Tensor, slot_mapping: Tensor, block_size: int) -> GatherMetadata:
    """Gather metadata of a decode step (one query per row, at its last position) from device tensors.

    Equals build_gather_metadata([1] * B, context_lens, block_tables, ...); used by the pure-PyTorch
    path, whose decode inputs live in tensors (decode_state.py) rather than host lists.
    """
    batch = len(context_lens)
    positions = torch.arange(int(context_lens.max()), device=block_tables.device)  # [C]
    key_slots = block_tables[:, positions // block_size].to(torch.int64) * block_size + positions % block_size  # [B, C]
    valid = positions[None, :] < context_lens[:, None]  # [B, C]
    rows = torch.arange(batch, device=block_tables.device)
    return GatherMetadata(
        slot_mapping=slot_mapping,
        query_index=rows[:, None],
        key_slots=key_slots.masked_fill(~valid, 0),
        mask=valid[:, None, None, :],
        output_index=rows,
        distance=((context_lens - 1)[:, None] - positions[None, :])[:, None, None, :],
    )
