"""CUDA IPC for weight sync when the trainer and a rollout server share one GPU: the trainer shares a
bucket's device memory by handle and the server maps it, so no byte crosses a socket.

The handle travels as plain JSON (never pickled): the server rebuilds the tensor with torch's own
`rebuild_cuda_tensor`, on its local index of the same physical GPU (matched by UUID).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


def device_uuid(device: torch.device) -> str | None:
    """The GPU's UUID (equal across processes whatever CUDA_VISIBLE_DEVICES says), None off GPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


def share(flat: torch.Tensor) -> dict[str, Any]:
    """A JSON-safe handle of a CUDA tensor; valid while the sender keeps `flat` alive."""
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
    """Maps a tensor shared by `share` in another process on the same physical GPU as `device`."""
    if shared["uuid"] != device_uuid(device):
        raise ValueError(f"CUDA IPC needs one GPU: the trainer's is {shared['uuid']}, this server's {device_uuid(device)}")
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
