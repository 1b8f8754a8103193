"""A Triton kernel that writes sampler_kernel's Gumbel noise of given hash values (tests/gpu only: CUDA)."""

import triton
import triton.language as tl

from tandemrl.generation.engine.layers.sampler_kernel import _gumbel


@triton.jit
def noise_kernel(bits_ptr, out_ptr, n, FAST: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + i, mask=i < n, other=0).to(tl.uint32)
    tl.store(out_ptr + i, _gumbel(bits, FAST), mask=i < n)
