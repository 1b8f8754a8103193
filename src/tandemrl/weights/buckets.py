"""The wire format of weight sync: named tensors laid out in flat uint8 windows, by Hugging Face name.

A window is what one metadata message describes: its tensors' names, dtypes, shapes and byte offsets,
and its buckets, the byte ranges that travel one collective each. An update is one window unless the
trainer streams more than `window_bytes`.

Invariant: every tensor starts at an ALIGN-byte offset of its window (and a bucket at a tensor's start),
so `unpack` returns views of any dtype without copying.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch import Tensor

ALIGN = 64  # bytes: every tensor starts aligned in its window, so `view(dtype)` is legal for any dtype
Named = list[tuple[str, "Tensor"]]


@dataclass(kw_only=True, slots=True)
class Window:
    """One metadata message's worth of tensors, as both sides see it (written by `plan_windows` alone)."""

    tensors: list[dict[str, Any]]  # {name, dtype, shape, offset}: offset in bytes from the window's start
    buckets: list[tuple[int, int, int, int]]  # (start byte, end byte, first tensor, end tensor): one collective each
    num_bytes: int
    last: bool  # no window follows in this update
    encoded: bytes = field(default=b"", repr=False, compare=False)  # to_json as sent, once `encode` ran
    views: dict[tuple[int, int, int], list[Tensor]] = field(default_factory=dict, repr=False, compare=False)  # by `views_of`

    def to_json(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "buckets": self.buckets, "num_bytes": self.num_bytes, "last": self.last}

    def encode(self) -> bytes:
        """The metadata message (JSON), encoded once per window: a reused window is sent as it was."""
        if not self.encoded:
            self.encoded = json.dumps(self.to_json()).encode()
        return self.encoded

    def views_of(self, flat: Tensor, bucket: int | None = None) -> list[Tensor]:
        """`views` of the window's tensors (or one bucket's) into `flat`, made once per buffer: an update
        into the same buffers as the last one reuses them."""
        key = (-1 if bucket is None else bucket, flat.data_ptr(), flat.numel())
        if key not in self.views:
            start, first, end = (0, 0, len(self.tensors)) if bucket is None else (self.buckets[bucket][0], *self.buckets[bucket][2:])
            self.views[key] = views(self.tensors[first:end], flat, start)
        return self.views[key]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Window:
        return cls(tensors=data["tensors"], buckets=[tuple(b) for b in data["buckets"]], num_bytes=data["num_bytes"], last=data["last"])


def plan_windows(weights: Iterable[tuple[str, Tensor]], bucket_bytes: int, window_bytes: int) -> Iterator[tuple[Window, list[Tensor]]]:
    """Lays named tensors out in windows of at most `window_bytes`, cut into buckets of at most
    `bucket_bytes` (a bigger tensor goes alone). Holds references to one window's tensors at a time.

    Example: [("a", float32[2]), ("b", float32[1])], bucket 64 B, window 1 MB -> one window, two buckets:
      tensors [{"name": "a", "dtype": "float32", "shape": [2], "offset": 0}, {..."b", "offset": 64}],
      buckets [(0, 8, 0, 1), (64, 68, 1, 2)], num_bytes 68, last True
    """
    stream = iter(weights)
    pending = next(stream, None)
    while pending is not None:
        meta: list[dict[str, Any]] = []
        tensors: list[Tensor] = []
        buckets: list[tuple[int, int, int, int]] = []
        start = end = first = 0
        while pending is not None:
            name, tensor = pending
            num_bytes = tensor.nbytes
            offset = end + (-end % ALIGN)
            if tensors and offset + num_bytes > window_bytes:
                break
            if tensors and offset + num_bytes - start > bucket_bytes:
                buckets.append((start, end, first, len(tensors)))
                start, first = offset, len(tensors)
            meta.append({"name": name, "dtype": _DTYPE_NAMES.get(tensor.dtype) or _dtype_name(tensor.dtype), "shape": list(tensor.shape), "offset": offset})
            tensors.append(tensor.detach())
            end = offset + num_bytes
            pending = next(stream, None)
        buckets.append((start, end, first, len(tensors)))
        yield Window(tensors=meta, buckets=buckets, num_bytes=end, last=pending is None), tensors


_DTYPE_NAMES: dict[torch.dtype, str] = {}  # torch.float32 -> "float32", filled as met (str(dtype) is slow)


def _dtype_name(dtype: torch.dtype) -> str:
    _DTYPE_NAMES[dtype] = name = str(dtype).removeprefix("torch.")
    return name


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype), name
    return dtype


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, size = [], 1
    for dim in reversed(shape):
        strides.append(size)
        size *= dim
    return strides[::-1]


def views(metas: list[dict[str, Any]], flat: Tensor, base: int = 0) -> list[Tensor]:
    """Each tensor of `metas` as a view into `flat`, which holds the window's bytes from `base` on. One
    op a tensor (as_strided into `flat` viewed as each dtype once): an update has ~300 tensors, and
    slicing and viewing each one three times was a fixed cost of every sync on both sides."""
    typed: dict[str, tuple[Tensor, int]] = {}  # dtype name -> (flat's whole dtype-sized bytes viewed as it, itemsize)
    out = []
    for m in metas:
        name = m["dtype"]
        if name not in typed:
            dtype = _dtype(name)
            typed[name] = (flat[: flat.numel() - flat.numel() % dtype.itemsize].view(dtype), dtype.itemsize)
        as_dtype, itemsize = typed[name]
        start = m["offset"] - base
        if start < 0 or start % itemsize or start + math.prod(m["shape"]) * itemsize > flat.numel():  # as_strided checks only the storage's bounds
            raise ValueError(f"tensor {m['name']} lies outside its window's {flat.numel()} bytes or off its alignment")
        offset = as_dtype.storage_offset() + start // itemsize
        out.append(as_dtype.as_strided(m["shape"], _contiguous_strides(m["shape"]), offset))
    return out


@torch.no_grad()
def pack(window: Window, tensors: list[Tensor], flat: Tensor, bucket: int | None = None) -> None:
    """Copies the window's tensors (or one bucket's) into `flat` (the window's bytes, or that bucket's)."""
    first, end = (0, len(tensors)) if bucket is None else window.buckets[bucket][2:]
    targets = window.views_of(flat, bucket)
    if targets and flat.is_cuda:  # one launch for the bucket; on CPU torch's foreach copy is erratic (engine/models/llama.py)
        torch._foreach_copy_(targets, tensors[first:end])
    else:
        for target, tensor in zip(targets, tensors[first:end]):
            target.copy_(tensor)


def unpack(window: Window, flat: Tensor) -> Named:
    """The named tensors of a window, as views into `flat` (the inverse of `pack`)."""
    return [(m["name"], t) for m, t in zip(window.tensors, window.views_of(flat))]


class Planner:
    """plan_windows that remembers the last update when it was one window (up to WINDOW_BUCKETS buckets'
    bytes: a 1.5B model at the default bucket size): an update with the same names, dtypes and shapes in
    the same order reuses that window, its encoded metadata and its views into buffers. Building them
    took ~10 us a tensor on each side, a large part of every sync's fixed cost (~340 tensors for a 1.5B).

    Example: two updates of [("a", float32[2]), ("b", float32[1])] -> the same Window object both times;
    a third with ("b", float32[3]) -> a new one.
    """

    def __init__(self, bucket_bytes: int, window_bytes: int):
        self.bucket_bytes, self.window_bytes = bucket_bytes, window_bytes
        self._last: tuple[Window, list[tuple[str, torch.dtype, torch.Size]]] | None = None

    def match(self, weights: Iterable[tuple[str, Tensor]]) -> tuple[tuple[Window, list[Tensor]] | None, Iterable[tuple[str, Tensor]]]:
        """((the last window, these tensors), the weights as a list) when `weights` are laid out as the
        last update; else (None, the same weights, none of them lost). Tensors are not detached: `pack`
        copies without autograd."""
        stream = iter(weights)
        if self._last is None:
            return None, stream
        window, keys = self._last
        items = list(itertools.islice(stream, len(keys) + 1))
        if len(items) == len(keys) and all(name == k[0] and t.dtype == k[1] and t.shape == k[2] for (name, t), k in zip(items, keys)):
            return (window, [t for _, t in items]), items
        return None, itertools.chain(items, stream)

    def windows(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[Window, list[Tensor]]]:
        matched, stream = self.match(weights)
        if matched is not None:
            yield matched
            return
        self._last = None
        for i, (window, tensors) in enumerate(plan_windows(stream, self.bucket_bytes, self.window_bytes)):
            if i == 0 and window.last:
                self._last = (window, [(m["name"], t.dtype, t.shape) for m, t in zip(window.tensors, tensors)])
            yield window, tensors
