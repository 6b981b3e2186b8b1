"""interpreter_fixes: each Triton 3.6 interpreter bug it patches, shown fixed against torch on the CPU."""
import pytest
import torch
import triton
import triton.language as tl

import interpreter_fixes

pytestmark = pytest.mark.skipif(not interpreter_fixes.interpreter_active(), reason="interpreter only")


@triton.jit
def _dot_kernel(A, B, C, N: tl.constexpr):
    rows = tl.arange(0, N)
    a = tl.load(A + rows[:, None] * N + rows[None, :])
    b = tl.load(B + rows[:, None] * N + rows[None, :])
    tl.store(C + rows[:, None] * N + rows[None, :], tl.dot(a, b))


@triton.jit
def _cast_kernel(X, Y, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(Y + offsets, tl.load(X + offsets).to(Y.dtype.element_ty))


def test_bf16_dot_multiplies_values_not_bit_patterns():
    a, b = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, 16)
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16])
def test_down_casts_round_to_nearest_even_like_torch(dtype):
    # 7.9 -> e4m3 must carry into the exponent (8, not 4); values near every binade edge
    x = torch.cat([torch.tensor([7.9, -7.9, 15.9, 0.0, -0.0, 1e-3]), torch.randn(4090) * 10])
    y = torch.empty(4096, dtype=dtype)
    _cast_kernel[(1,)](x, y, 4096)
    assert torch.equal(y.float(), x.to(dtype).float())


def test_apply_is_idempotent():
    interpreter_fixes.apply()
    interpreter_fixes.apply()
    a, b = torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16()
    c = torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, c, 16)
    assert torch.isfinite(c).all() and c.abs().max() < 1e3
