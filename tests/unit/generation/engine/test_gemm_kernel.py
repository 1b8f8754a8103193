"""The decode GEMM (layers/gemm_kernel.py) against torch in float32, in triton's interpreter on CPU (where
triton is installed; skipped in CI): plain, split-K (run twice: the last program of each tile resets its
counter, so a second launch on the same cached counters must give the same output) and gated (silu, tanh-GELU)
against the matmul then activation.gated's torch equivalent. float32 inputs with IEEE products: only the
order of the float32 sums differs from torch, so a tolerance of 1e-4 relative to the output's scale."""

from __future__ import annotations

import importlib.util
import os

import numpy
import pytest
import torch
import torch.nn.functional as F

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (CI)")
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel's module is imported: it runs on CPU tensors
    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):  # its range() over loaded bounds fails there
        needs_triton = pytest.mark.skip(reason="triton's interpreter needs numpy < 2.4")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = 1e-4  # of the largest |output|: float32 sums in another order


def _close(out: torch.Tensor, expected: torch.Tensor) -> bool:
    return out.shape == expected.shape and (out - expected).abs().max().item() <= TOLERANCE * expected.abs().max().item()


def _problem(rows: int, width: int, depth: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=generator)
    weight = torch.randn(width, depth, generator=generator) * depth**-0.5
    return x.to(DEVICE), weight.to(DEVICE)


@needs_triton
@pytest.mark.parametrize(
    "rows, width, depth, block_n, block_k, split_k",
    [
        (3, 64, 64, 32, 32, 1),  # one K step, rows padded to 16
        (16, 96, 256, 32, 64, 1),  # a column tile of its own past 64
        (33, 80, 160, 32, 64, 1),  # rows padded to 64, N and K not multiples of the tiles
        (3, 96, 256, 32, 64, 2),
        (16, 64, 256, 64, 32, 2),
        (33, 80, 160, 32, 32, 2),  # uneven K: the second split is shorter
        (16, 64, 192, 32, 64, 4),  # 3 K steps in 4 splits: one split is empty and still counts
    ],
)
def test_decode_linear_equals_the_matmul(rows, width, depth, block_n, block_k, split_k):
    from tandemrl.generation.engine.layers.gemm_kernel import _WORKSPACES, decode_linear

    x, weight = _problem(rows, width, depth, seed=rows * width + depth + split_k)
    expected = x @ weight.T
    settings = dict(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=2)
    first = decode_linear(x, weight, **settings)
    assert _close(first, expected)
    if split_k > 1:
        counters = _WORKSPACES[(x.device, rows, width, split_k)][1]
        assert not counters.any()  # every tile's last program set its counter back to 0
        second = decode_linear(x, weight, **settings)  # on the same (cached) counters and partials
        assert torch.equal(second, first)


@needs_triton
def test_rows_past_one_tile_are_tiled():
    from tandemrl.generation.engine.layers.gemm_kernel import decode_linear

    x, weight = _problem(40, 64, 128, seed=7)
    for split_k in (1, 2):
        out = decode_linear(x, weight, block_m=16, block_n=32, block_k=64, split_k=split_k, num_warps=4, num_stages=2)
        assert _close(out, x @ weight.T)


@needs_triton
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows, inner, depth", [(3, 64, 128), (33, 48, 96)])
def test_gated_decode_linear_equals_matmul_then_activation(activation, rows, inner, depth):
    from tandemrl.generation.engine.layers.gemm_kernel import decode_linear

    x, weight = _problem(rows, 2 * inner, depth, seed=rows + inner)
    gate, up = (x @ weight.T).chunk(2, dim=-1)  # [gate | up] rows of the fused weight
    expected = (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up
    out = decode_linear(x, weight, block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=2, gated=activation)
    assert _close(out, expected)


@needs_triton
def test_gated_split_k_and_unknown_activations_are_refused():
    from tandemrl.generation.engine.layers.gemm_kernel import decode_linear

    x, weight = _problem(4, 64, 64, seed=0)
    with pytest.raises(ValueError, match="split_k 1"):
        decode_linear(x, weight, block_n=32, block_k=32, split_k=2, num_warps=4, num_stages=2, gated="silu")
    with pytest.raises(ValueError, match="no fused kernel"):
        decode_linear(x, weight, block_n=32, block_k=32, split_k=1, num_warps=4, num_stages=2, gated="relu")


@needs_triton
@pytest.mark.parametrize("rows", [128, 256, 512])
@pytest.mark.parametrize("width, depth, gated", [(4096, 4096, False), (6144, 4096, False), (28672, 4096, True), (4096, 14336, False), (1152, 896, False)])
def test_candidate_configs_are_few_and_fill_the_gpu(rows, width, depth, gated):
    from tandemrl.generation.engine.layers.gemm_kernel import candidate_configs

    configs = candidate_configs(rows, width, depth, gated=gated)
    assert 4 <= len(configs) <= 16
    assert len({tuple(sorted(c.items())) for c in configs}) == len(configs)
    for c in configs:
        assert c["block_n"] in (32, 64, 128) and c["block_k"] in (64, 128, 256) and c["split_k"] in (1, 2, 4, 8)
        assert c["num_warps"] in (4, 8) and c["num_stages"] in (3, 4, 5)
        assert c["split_k"] == 1 or not gated
