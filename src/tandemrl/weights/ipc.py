"""CUDA IPC for weight sync when the trainer and a rollout server share one GPU: the server shares its
staging buffer's device memory by handle and the trainer maps it, so no byte crosses a socket.

The handle travels as plain JSON (never pickled): the trainer rebuilds the tensor with torch's own
`rebuild_cuda_tensor`, on its local index of the same physical GPU (matched by UUID). On CPU the same
protocol runs through a file-backed buffer (a shared mapping of a temporary file), so tests and the
bench check it without a GPU.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


def device_uuid(device: torch.device) -> str | None:
    """The GPU's UUID (equal across processes whatever CUDA_VISIBLE_DEVICES says), None off GPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def shared_buffer(num_bytes: int, device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    """A new uint8 buffer another process can map, and its handle; the handle is valid while the buffer lives."""
    if device.type == "cuda":
        flat = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        return flat, share(flat)
    fd, path = tempfile.mkstemp(prefix="tandem-staging-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.close(fd)
    flat = torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
    weakref.finalize(flat, _unlink, path)
    return flat, {"path": path, "size": num_bytes, "uuid": None}


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def share(flat: torch.Tensor) -> dict[str, Any]:
    """A JSON-safe handle of a CUDA tensor; valid while its owner keeps `flat` alive."""
    _, args = reduce_tensor(flat)
    (_, size, stride, offset, _, dtype, _, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset, event, sync) = args
    return {
        "size": list(size),
        "stride": list(stride),
        "offset": offset,
        "dtype": str(dtype).removeprefix("torch."),
        "handle": handle.hex(),
        "storage_bytes": storage_bytes,
        "storage_offset": storage_offset,
        "ref_handle": ref_handle.hex(),
        "ref_offset": ref_offset,
        "event": event.hex() if event else "",
        "event_sync": sync,
        "uuid": device_uuid(flat.device),
    }


def open_shared(shared: dict[str, Any], device: torch.device) -> torch.Tensor:
    """Maps a tensor shared by `share` (or `shared_buffer`) in another process on the same physical GPU as
    `device` (or in host memory)."""
    if shared["uuid"] != device_uuid(device):
        raise ValueError(f"CUDA IPC needs one GPU: the server's is {shared['uuid']}, this trainer's {device_uuid(device)}")
    if "path" in shared:
        return torch.from_file(shared["path"], shared=True, size=shared["size"], dtype=torch.uint8)
    dtype = getattr(torch, shared["dtype"])
    assert isinstance(dtype, torch.dtype)
    return rebuild_cuda_tensor(
        torch.Tensor,
        tuple(shared["size"]),
        tuple(shared["stride"]),
        shared["offset"],
        torch.storage.TypedStorage,
        dtype,
        device.index if device.index is not None else torch.cuda.current_device(),
        bytes.fromhex(shared["handle"]),
        shared["storage_bytes"],
        shared["storage_offset"],
        False,
        bytes.fromhex(shared["ref_handle"]),
        shared["ref_offset"],
        bytes.fromhex(shared["event"]) if shared["event"] else None,
        shared["event_sync"],
    )
