"""The wire format of weight sync: named tensors flattened into uint8 buckets, by Hugging Face name.

Invariant: every tensor starts at an ALIGN-byte offset of its bucket, so `unpack_bucket` returns views
of any dtype without copying.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch import Tensor

ALIGN = 64  # bytes: every tensor starts aligned in its bucket, so `view(dtype)` is legal for any dtype
Named = list[tuple[str, "Tensor"]]


def pack_buckets(weights: Iterable[tuple[str, Tensor]], bucket_bytes: int, device: torch.device | None = None) -> Iterator[tuple[list[dict], Tensor]]:
    """Flattens named tensors into uint8 buckets of at most `bucket_bytes` (a bigger tensor goes alone).

    Example: [("a", float32[2]), ("b", float32[1])], 1 MB -> one bucket:
      [{"name": "a", "dtype": "float32", "shape": [2], "offset": 0}, {..., "name": "b", "offset": 64}], uint8[68]
    """
    items: Named = []
    end = 0
    for name, tensor in weights:
        nbytes = tensor.numel() * tensor.element_size()
        start = end + (-end % ALIGN)
        if items and start + nbytes > bucket_bytes:
            yield _flatten(items, device)
            items, start = [], 0
        items.append((name, tensor.detach()))
        end = start + nbytes
    if items:
        yield _flatten(items, device)


def _flatten(items: Named, device: torch.device | None) -> tuple[list[dict], Tensor]:
    meta, offset = [], 0
    for name, tensor in items:
        offset += -offset % ALIGN
        meta.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape), "offset": offset})
        offset += tensor.numel() * tensor.element_size()
    flat = torch.empty(offset, dtype=torch.uint8, device=device or items[0][1].device)  # [bytes]
    for m, (_, tensor) in zip(meta, items):
        data = tensor.contiguous().reshape(-1).view(torch.uint8)
        flat[m["offset"] : m["offset"] + data.numel()].copy_(data)
    return meta, flat


def unpack_bucket(meta: list[dict], flat: Tensor) -> Named:
    """The named tensors of one bucket, as views into `flat` (the inverse of `_flatten`)."""
    out = []
    for m in meta:
        dtype = getattr(torch, m["dtype"])
        assert isinstance(dtype, torch.dtype), m["dtype"]
        nbytes = math.prod(m["shape"]) * dtype.itemsize
        out.append((m["name"], flat[m["offset"] : m["offset"] + nbytes].view(dtype).view(m["shape"])))
    return out

