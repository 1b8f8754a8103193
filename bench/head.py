"""The logprob head alone, forward + backward: ours (torch path, Triton path) against Liger Kernel's fused
linear ops on the same tensors (issue 11: "Liger Kernel's fused linear ops, or your own Triton kernel
measured against it").

Workload: the trained tokens of one GRPO step, 512 sequences x 256 completion tokens = 131,072 rows of
hidden states (bf16, as the trainer's bf16 twin hands them over) through a Qwen2.5 head (vocab 151,936),
the gradients of the hidden states and of the head's weight. Variants:
- ours_torch / ours_triton: algo/logprobs.py, loss = -sum(advantage x logprob) / N, with and without
  entropy (the trainer computes it when it logs it); logits and the weight's gradient in float32.
- liger_flce: LigerFusedLinearCrossEntropyLoss, reduction "sum" (the same linear + log-softmax + gather;
  no per-token weights, no entropy); its default accumulates the weight's gradient in the input's dtype.
- liger_grpo: LigerFusedLinearGRPOLoss (what TRL runs with use_liger_kernel), beta 0, on [512, 256, H].
Prints one JSON line per variant (seconds per forward + backward, mean of --iters after --warmup; peak
memory above the inputs; |loss - float32 reference| / |reference| where comparable) and ratio lines.

    python bench/head.py --shapes 0.5b,1.5b        # H200 (liger-kernel from .whl)
    python bench/head.py --toy --device cpu        # CPU check: ours_torch only, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tandemrl.algo.logprobs import logprobs_and_entropy, set_triton

SHAPES = {"0.5b": 896, "1.5b": 1536, "7b": 3584, "toy": 64}
VOCAB = {"toy": 512}


def inputs(shape: str, seqs: int, tokens: int, device: str, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden_size, vocab = SHAPES[shape], VOCAB.get(shape, 151936)
    hidden = (torch.randn(seqs * tokens, hidden_size, generator=generator)).to(device, dtype)
    weight = (torch.randn(vocab, hidden_size, generator=generator) * hidden_size**-0.5).to(device, dtype)
    targets = torch.randint(0, vocab, (seqs * tokens,), generator=generator).to(device)
    advantages = torch.randn(seqs, generator=generator).to(device)
    return hidden, weight, targets, advantages


def ours(hidden, weight, targets, advantages, *, with_entropy: bool, chunk_size: int):
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
    head.weight = torch.nn.Parameter(weight)
    per_token = advantages.repeat_interleave(hidden.shape[0] // advantages.shape[0])

    def step():
        logprobs, entropy = logprobs_and_entropy(hidden, head, targets, chunk_size=chunk_size, with_entropy=with_entropy)
        loss = -(per_token * logprobs).sum() / hidden.shape[0]
        if with_entropy:
            loss = loss - 0.0 * entropy.sum()  # its backward runs, as with an entropy bonus
        loss.backward()
        return loss

    return step, head.weight


def liger_flce(hidden, weight, targets, advantages):
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss_fn = LigerFusedLinearCrossEntropyLoss(reduction="sum")

    def step():
        loss = loss_fn(weight, hidden, targets)
        loss.backward()
        return loss

    return step, weight


def liger_grpo(hidden, weight, targets, advantages):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    seqs = advantages.shape[0]
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo")
    shaped, ids = hidden.view(seqs, -1, hidden.shape[-1]), targets.view(seqs, -1)
    mask = torch.ones_like(ids)

    def step():
        loss = loss_fn(shaped, weight, ids, mask, advantages)[0]
        loss.backward()
        return loss

    return step, weight


def timed(name: str, make, shape: str, args, reference: float | None) -> dict:
    hidden, weight, targets, advantages = inputs(shape, args.seqs, args.tokens, args.device, torch.bfloat16 if args.device != "cpu" else torch.float32)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    step, trained = make(hidden, weight, targets, advantages)
    cuda = args.device != "cpu"

    def sync():
        if cuda:
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        hidden.grad = trained.grad = weight.grad = None
        loss = step()
    sync()
    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.iters):
        hidden.grad = trained.grad = weight.grad = None
        loss = step()
    sync()
    seconds = (time.perf_counter() - start) / args.iters
    row = {"bench": "head", "shape": shape, "variant": name, "rows": hidden.shape[0], "seconds": round(seconds, 5),
           "peak_extra_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 2) if cuda else None, "loss": float(loss.detach())}  # fmt: skip
    if reference is not None:
        row["rel_diff_vs_float32"] = abs(float(loss) - reference) / max(abs(reference), 1e-12)
    print(json.dumps(row), flush=True)
    del hidden, weight, trained, step
    if cuda:
        torch.cuda.empty_cache()
    return row


def reference_loss(shape: str, args, kind: str) -> float:
    """The same loss in float32 on the same tensors (torch path): the yardstick of each variant's result."""
    hidden, weight, targets, advantages = inputs(shape, args.seqs, args.tokens, args.device, torch.float32)
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    head.weight = torch.nn.Parameter(weight)
    with torch.no_grad():
        set_triton(False)
        logprobs, _ = logprobs_and_entropy(hidden, head, targets, chunk_size=args.chunk_size, with_entropy=False)
    if kind == "flce":
        return float(-logprobs.sum())
    per_token = advantages.repeat_interleave(hidden.shape[0] // advantages.shape[0])
    return float(-(per_token * logprobs).sum() / hidden.shape[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seqs", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--chunk_size", type=int, default=2048, help="ours: rows of logits at once (the trainer's default)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--toy", action="store_true", help="shape toy, 8 x 16 rows (CPU check)")
    args = parser.parse_args()
    if args.toy:
        args.shapes, args.seqs, args.tokens = "toy", 8, 16
    for shape in args.shapes.split(","):
        ref_grpo, ref_flce = reference_loss(shape, args, "grpo"), reference_loss(shape, args, "flce")
        rows = {}
        variants = [("ours_torch", False, False), ("ours_torch_entropy", False, True), ("ours_triton", True, False), ("ours_triton_entropy", True, True)]
        for name, triton, entropy in variants:
            if triton and args.device == "cpu":
                continue
            set_triton(triton)
            rows[name] = timed(name, lambda h, w, t, a, e=entropy: ours(h, w, t, a, with_entropy=e, chunk_size=args.chunk_size), shape, args, ref_grpo)
        set_triton(False)
        for name, make, ref in (("liger_flce", liger_flce, ref_flce), ("liger_grpo", liger_grpo, None)):
            try:
                rows[name] = timed(name, make, shape, args, ref)
            except (ImportError, RuntimeError, AssertionError, TypeError, ValueError) as error:  # no liger or no CUDA: say so, go on
                print(json.dumps({"bench": "head", "shape": shape, "variant": name, "error": f"{type(error).__name__}: {str(error)[:200]}"}), flush=True)
        best = rows.get("ours_triton") or rows.get("ours_torch")
        for other in ("liger_flce", "liger_grpo"):
            if best and other in rows:
                print(f"ratio {shape} head fwd+bwd: ours {best['variant']} {best['seconds']:.4f} s vs {other} {rows[other]['seconds']:.4f} s = {rows[other]['seconds'] / best['seconds']:.2f}x")


if __name__ == "__main__":
    main()
