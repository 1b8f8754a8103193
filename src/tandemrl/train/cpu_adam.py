"""AdamW whose moments live in CPU memory (--cpu_optimizer; ZeRO-Offload's split): the GPU keeps the float32
masters and gradients, and never the moments (8 bytes a parameter).

The step streams the parameters in fixed-size chunks of their flat concatenation, in one of two forms
(--cpu_optimizer_compute):

- gpu (auto's choice on a GPU, for float32 weights): the moments stay in pinned CPU memory and the AdamW math
  runs on the GPU. A chunk's moments come to a device slot (one copy stream), the fused AdamW kernel updates
  the masters' views of the chunk and the moments in the slot (current stream), and the moments go back to
  their pinned home (another copy stream); three slots rotate, so the copies of chunk i+1 in and chunk i-1 out
  run beside the kernel on chunk i, both directions at once. 16 bytes a parameter cross PCIe and the CPU
  computes nothing: the step is bound by the link.
- cpu: the math runs on the CPU. A chunk's gradients go to pinned memory (copy stream), the CPU's fused AdamW
  kernel turns them into an update, and the update comes back (copy stream) and is added to the masters; the
  copies of chunk i+1 and i-1 overlap the CPU's work on chunk i. 8 bytes a parameter cross PCIe, but the step
  is bound by the host memory's bandwidth. The form for weights that are not float32 (the fused kernel takes
  moments of its weights' dtype, and the moments here are float32), and auto's choice off a GPU.

On the CPU (tests) both forms run their per-chunk code as on a GPU, the copies plain copies without streams
or events. Invariant: the weights after each step equal torch.optim.AdamW's on the same gradients (within
float32 rounding: tests/unit/train/test_cpu_adam.py), a parameter without a gradient skipped as AdamW skips
it; the state_dict is AdamW's (per-parameter exp_avg and exp_avg_sq, CPU tensors, and step: on the GPU in
the gpu form, as fused AdamW keeps it), and either form loads the other's, or AdamW's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from typing import Any, NamedTuple

import torch
from torch import Tensor

from tandemrl.memory import CPU_OPTIMIZER_CHUNK, CPU_OPTIMIZER_GPU_CHUNK, CPU_OPTIMIZER_GPU_SLOTS, cpu_optimizer_compute

CHUNK_NUMEL = CPU_OPTIMIZER_CHUNK  # the sizes are the memory plan's (memory.py says why each)
GPU_CHUNK_NUMEL = CPU_OPTIMIZER_GPU_CHUNK
GPU_SLOTS = CPU_OPTIMIZER_GPU_SLOTS

log = logging.getLogger(__name__)


class _Part(NamedTuple):
    """A parameter's flat elements [start, end) at offset `at` of a chunk."""

    param: Tensor
    start: int
    end: int
    at: int


class _Chunk(NamedTuple):
    """CHUNK elements of the parameters' flat concatenation from `start` (the moments' flat offset)."""

    start: int
    numel: int
    parts: list[_Part]


def choose_compute(compute: str, params: list[Tensor]) -> str:
    """Where the AdamW math runs for these weights: memory.cpu_optimizer_compute's rule."""
    on_gpu = bool(params) and params[0].device.type == "cuda"
    return cpu_optimizer_compute(compute, float32=all(p.dtype == torch.float32 for p in params), on_gpu=on_gpu)


class CpuAdamW(torch.optim.Optimizer):
    def __init__(
        self, params: list[Tensor], *, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
        weight_decay: float = 0.0, compute: str = "auto", chunk_numel: int | None = None,
    ) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        assert len(self.param_groups) == 1, "one parameter group (the trainer's)"
        self.params: list[Tensor] = list(self.param_groups[0]["params"])
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.compute = choose_compute(compute, self.params)
        gpu, cuda = self.compute == "gpu", self.device.type == "cuda"
        self.numel = sum(p.numel() for p in self.params)
        self.chunk_numel = min(chunk_numel or (GPU_CHUNK_NUMEL if gpu else CHUNK_NUMEL), max(1, self.numel))
        # the moments: one flat CPU buffer each, every parameter's state a view of it (AdamW's layout); page-locked
        # where the gpu form copies them, else the cpu form's kernel reads them where they are
        self._exp_avg, self._exp_avg_sq = (_host_zeros(self, self.numel, self.device if gpu and cuda else None) for _ in range(2))
        offset = 0
        for p in self.params:
            n = p.numel()
            self.state[p] = {
                # the gpu form's kernel reads the step on the GPU (as fused AdamW keeps it): no copy a step
                "step": torch.zeros((), dtype=torch.float32, device=self.device if gpu else "cpu"),
                "exp_avg": self._exp_avg[offset : offset + n].view_as(p), "exp_avg_sq": self._exp_avg_sq[offset : offset + n].view_as(p),
            }  # fmt: skip
            offset += n
        self._layout = _layout(self.params, self.chunk_numel)
        chunk, device = self.chunk_numel, self.device
        if gpu:
            # a slot: one chunk of each moment on the device; the moments come in on one stream and go out on another
            self._slots = [tuple(torch.empty(chunk, dtype=torch.float32, device=device) for _ in range(2)) for _ in range(GPU_SLOTS)]
            self._in, self._out = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)
        else:
            # two of each staging buffer: chunk i's copies run while the CPU works on chunk i +- 1
            self._grads = [torch.empty(chunk, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
            self._updates = [torch.empty(chunk, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
            self._staged = [torch.empty(chunk, dtype=torch.float32, device=device) for _ in range(2)]
            # gradients down on one stream, updates up (and applied) on another: both directions at once
            self._down, self._up = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if cuda else (None, None)

    def staging(self) -> list[Tensor]:
        """The buffers the step keeps on the device (the memory plan's "optimizer staging")."""
        return [t for slot in self._slots for t in slot] if self.compute == "gpu" else list(self._staged)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        assert closure is None, "no closure"
        group = self.param_groups[0]
        live = [p for p in self.params if p.grad is not None]  # AdamW skips a parameter without a gradient, step count too
        if not live:
            return
        torch._foreach_add_([self.state[p]["step"] for p in live], 1)
        chunks = [_Chunk(c.start, c.numel, parts) for c in self._layout if (parts := [x for x in c.parts if x.param.grad is not None])]
        beta1, beta2 = group["betas"]
        adam = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], amsgrad=False, maximize=False)
        if self.compute == "gpu":
            self._step_gpu(chunks, group["weight_decay"], adam)
        else:
            self._step_cpu(chunks, group["lr"], group["weight_decay"], adam)

    def _steps(self, parts: list[_Part]) -> list[Tensor]:
        return [self.state[x.param]["step"] for x in parts]

    # the gpu form: the moments travel, the math runs where the masters are

    def _step_gpu(self, chunks: list[_Chunk], wd: float, adam: dict[str, Any]) -> None:
        """Per chunk: its moments into a slot (in-stream), the fused kernel on the masters' views with AdamW's weight
        decay (current stream), the moments home (out-stream). The streams order themselves by events, so the host
        queues the whole step at once; a slot is refilled only after its last chunk's moments left it. Whole chunks
        travel: a part without a gradient comes back as it went."""
        current = torch.cuda.current_stream(self.device) if self._in is not None else None
        n_slots = len(self._slots)
        loaded: list[Any] = [None] * len(chunks)
        left: list[Any] = [None] * n_slots  # per slot: its last chunk's moments are home

        def load(i: int) -> None:
            chunk, (m, v) = chunks[i], self._slots[i % n_slots]
            with _on(self._in):
                _wait(self._in, left[i % n_slots])
                m[: chunk.numel].copy_(self._exp_avg[chunk.start : chunk.start + chunk.numel], non_blocking=True)
                v[: chunk.numel].copy_(self._exp_avg_sq[chunk.start : chunk.start + chunk.numel], non_blocking=True)
                loaded[i] = _record(self._in)

        ahead = n_slots - 1
        for i in range(min(ahead, len(chunks))):
            load(i)
        for i, chunk in enumerate(chunks):
            if i + ahead < len(chunks):
                load(i + ahead)  # into chunk i-1's slot, once its moments have gone
            m, v = self._slots[i % n_slots]
            _wait(current, loaded[i])
            parts = chunk.parts
            torch._fused_adamw_(
                [x.param.view(-1)[x.start : x.end] for x in parts], [x.param.grad.view(-1)[x.start : x.end] for x in parts],
                [m[x.at : x.at + x.end - x.start] for x in parts], [v[x.at : x.at + x.end - x.start] for x in parts], [],
                self._steps(parts), weight_decay=wd, **adam,
            )  # fmt: skip
            computed = _record(current)
            with _on(self._out):
                _wait(self._out, computed)
                self._exp_avg[chunk.start : chunk.start + chunk.numel].copy_(m[: chunk.numel], non_blocking=True)
                self._exp_avg_sq[chunk.start : chunk.start + chunk.numel].copy_(v[: chunk.numel], non_blocking=True)
                left[i % n_slots] = _record(self._out)
        for event in left:  # the moments are home before the host reads them (state_dict) or writes them (load_state_dict)
            _sync(event)

    # the cpu form: the gradients and updates travel, the math runs where the moments are

    def _step_cpu(self, chunks: list[_Chunk], lr: float, wd: float, adam: dict[str, Any]) -> None:
        sent = self._send(0, chunks[0]) if chunks else None
        applied: list[Any] = [None, None]
        for i, chunk in enumerate(chunks):
            slot = i % 2
            _sync(sent)  # chunk i's gradients are in pinned memory
            if i + 1 < len(chunks):
                sent_next = self._send((i + 1) % 2, chunks[i + 1])
            _sync(applied[slot])  # this slot's last update has left the pinned buffer
            self._adam(self._updates[slot], self._grads[slot], chunk, adam)
            applied[slot] = self._apply(slot, chunk, lr, wd)
            if i + 1 < len(chunks):
                sent = sent_next
        if self._up is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._up)
        for event in applied:  # the pinned updates are free again before the next step writes them
            _sync(event)

    def _send(self, slot: int, chunk: _Chunk) -> Any:
        """The chunk's gradients to pinned slot `slot` on the down-stream, after the current stream's work."""
        _wait_stream(self._down, self.device)
        with _on(self._down):
            for x in chunk.parts:
                self._grads[slot][x.at : x.at + x.end - x.start].copy_(x.param.grad.view(-1)[x.start : x.end], non_blocking=True)
            return _record(self._down)

    def _adam(self, update: Tensor, grads: Tensor, chunk: _Chunk, adam: dict[str, Any]) -> None:
        """update <- -lr x m_hat / (sqrt(v_hat) + eps), the chunk's moments updated in place (the fused CPU kernel on a
        zero "parameter", without weight decay: that acts on the GPU's masters)."""
        parts, start = chunk.parts, chunk.start
        update[: chunk.numel].zero_()
        views = lambda t, base: [t[base + x.at : base + x.at + x.end - x.start] for x in parts]  # noqa: E731
        torch._fused_adamw_(
            views(update, 0), views(grads, 0), views(self._exp_avg, start), views(self._exp_avg_sq, start), [], self._steps(parts),
            weight_decay=0.0, **adam,
        )  # fmt: skip

    def _apply(self, slot: int, chunk: _Chunk, lr: float, wd: float) -> Any:
        """The update to the device (up-stream) and into the masters: p <- p (1 - lr wd) + update (AdamW's order)."""
        staged = self._staged[slot]
        _wait_stream(self._up, self.device)
        with _on(self._up):
            staged[: chunk.numel].copy_(self._updates[slot][: chunk.numel], non_blocking=True)
            event = _record(self._up)
            for x in chunk.parts:
                flat = x.param.view(-1)[x.start : x.end]
                if wd:
                    flat.mul_(1 - lr * wd)
                flat.add_(staged[x.at : x.at + x.end - x.start])
        return event

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """AdamW's state_dict (this class's in either form, or torch.optim.AdamW's) into the CPU moments, in place."""
        self.param_groups[0].update({k: v for k, v in state_dict["param_groups"][0].items() if k != "params"})
        for index, p in enumerate(self.params):
            saved = state_dict["state"].get(index)
            if saved is None:
                continue
            state = self.state[p]
            state["exp_avg"].copy_(saved["exp_avg"].reshape(p.shape))
            state["exp_avg_sq"].copy_(saved["exp_avg_sq"].reshape(p.shape))
            state["step"].fill_(float(saved["step"]))


def _layout(params: list[Tensor], chunk_numel: int) -> list[_Chunk]:
    """The chunks of the parameters' flat concatenation (a parameter may span several)."""
    chunks: list[_Chunk] = []
    parts: list[_Part] = []
    start = filled = 0
    for p in params:
        a = 0
        while a < p.numel():
            b = min(p.numel(), a + chunk_numel - filled)
            parts.append(_Part(p, a, b, filled))
            filled += b - a
            a = b
            if filled == chunk_numel:
                chunks.append(_Chunk(start, filled, parts))
                start, parts, filled = start + filled, [], 0
    if parts:
        chunks.append(_Chunk(start, filled, parts))
    return chunks


def _host_zeros(owner: object, numel: int, device: torch.device | None) -> Tensor:
    """numel float32 zeros in CPU memory, page-locked for `device` (None: pageable) while `owner` lives. Locked in
    place, not through pin_memory=True: PyTorch's host allocator rounds each allocation up to a power of two (up to
    twice the moments' 8 bytes a parameter) and keeps it once freed; it is the fallback where locking fails."""
    buffer = torch.zeros(numel, dtype=torch.float32)
    if device is None or not numel:
        return buffer
    cudart = torch.cuda.cudart()
    if cudart.cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0) != cudart.cudaError.success:
        # CUDA keeps the failure as its last error, which the next kernel launch's check would raise: raised (and so cleared) here
        with contextlib.suppress(RuntimeError):
            torch.zeros(1, device=device).add_(1)
        log.warning("--cpu_optimizer: could not page-lock the moments in place; pinned through PyTorch's allocator (rounded up to a power of two)")
        return torch.zeros(numel, dtype=torch.float32, pin_memory=True)
    # the finalizer holds the buffer, so its memory outlives the registration (an error at exit, the context gone, changes nothing)
    weakref.finalize(owner, lambda locked: cudart.cudaHostUnregister(locked.data_ptr()), buffer)
    return buffer


def _on(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _record(stream: Any) -> Any:
    """An event at the stream's current end (None on the CPU, where every copy has happened already)."""
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _wait(stream: Any, event: Any) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)


def _wait_stream(stream: Any, device: torch.device) -> None:
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(device))


def _sync(event: Any) -> None:
    if event is not None:
        event.synchronize()


def cpu_state_bytes(numel: int) -> int:
    """Host memory of the moments of `numel` parameters (what --cpu_optimizer moves off the GPU)."""
    return 8 * numel


def num_chunks(numel: int, chunk_numel: int = CHUNK_NUMEL) -> int:
    return math.ceil(numel / chunk_numel)
