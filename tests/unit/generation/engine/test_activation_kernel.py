"""The fused gated activation (layers/activation.py) against the torch path of models/llama.py's MLP: silu and
tanh-GELU, in triton's interpreter on CPU (where triton is installed; tests/gpu checks it on a GPU)."""

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
    if tuple(int(x) for x in numpy.__version__.split(".")[:2]) >= (2, 4):
        needs_triton = pytest.mark.skip(reason="triton's interpreter needs numpy < 2.4")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation_equals_the_torch_path(activation):
    from tandemrl.generation.engine.layers.activation import gated

    torch.manual_seed(0)
    gate_up = torch.randn(5, 2 * 1500, device=DEVICE) * 3  # a width past one block of 1024, rows of mixed signs
    gate, up = gate_up.chunk(2, dim=-1)
    expected = (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up
    assert torch.allclose(gated(gate_up, activation), expected, atol=1e-5, rtol=1e-5)


@needs_triton
def test_an_activation_without_a_kernel_is_refused():
    from tandemrl.generation.engine.layers.activation import gated

    with pytest.raises(ValueError, match="no fused kernel"):
        gated(torch.zeros(1, 4, device=DEVICE), "relu")
