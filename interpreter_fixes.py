"""Fixes for two numerics bugs of Triton 3.6's CPU interpreter (TRITON_INTERPRET=1).

Our CPU tests run the GPU kernels under the interpreter, so its arithmetic must match the GPU's:
1. `tl.dot` on bfloat16 operands multiplies the raw uint16 bit patterns (the interpreter stores bf16
   as uint16 and hands them to numpy.matmul as integers).
2. float down-casts (float32 -> fp8/bf16/fp16) round the mantissa without carrying into the exponent
   (7.9 -> fp8 e4m3 gives 4, not 8) and float32 -> bf16 truncates.
`apply()` patches the interpreter's builder so both behave like the GPU (round to nearest even, via
torch's own casts). It is a no-op unless the interpreter is in use. Tests in
tests/cpu/test_interpreter_fixes.py show each bug and the fix.
"""
import os

import numpy as np
import torch

_APPLIED = False


def interpreter_active() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _torch_dtype(tl_dtype):
    import triton.language as tl

    return {
        tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2,
        tl.float8e4b8: torch.float8_e4m3fnuz, tl.float8e5b16: torch.float8_e5m2fnuz,
    }.get(tl_dtype)


def _bits_dtype(torch_dtype):
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32}[torch_dtype.itemsize]


def _as_torch(data: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the interpreter's numpy storage (floats or raw bits) as a torch tensor of dtype."""
    raw = torch.from_numpy(np.ascontiguousarray(data).view(_bits_np(dtype)).copy())
    return raw.view(dtype)


def _bits_np(dtype: torch.dtype):
    return {1: np.uint8, 2: np.uint16, 4: np.uint32}[dtype.itemsize]


def _to_storage(t: torch.Tensor, np_dtype) -> np.ndarray:
    return t.view(_bits_dtype(t.dtype)).numpy().view(np_dtype)


def apply() -> None:
    """Patch the interpreter builder once; safe to call many times."""
    global _APPLIED
    if _APPLIED or not interpreter_active():
        return
    import triton.language as tl
    from triton.runtime import interpreter

    builder_cls = interpreter.InterpreterBuilder
    original_cast, original_fp_to_fp, original_dot = (
        builder_cls.cast_impl, builder_cls.create_fp_to_fp, builder_cls.create_dot)

    def float_cast(self, src, dst_type, fallback, *args):
        src_t, dst_t = _torch_dtype(src.dtype.scalar), _torch_dtype(dst_type.scalar)
        if src_t is None or dst_t is None:
            return fallback(self, src, dst_type, *args)
        out = _as_torch(src.data, src_t).to(dst_t)
        return interpreter.TensorHandle(
            _to_storage(out, interpreter._get_np_dtype(dst_type)), dst_type.scalar)

    def cast_impl(self, src, dst_type):
        return float_cast(self, src, dst_type, original_cast)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        return float_cast(self, src, dst_type, original_fp_to_fp, rounding_mode)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar):
            return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        a32, b32 = (_as_torch(x.data, _torch_dtype(x.dtype.scalar)).float().numpy() for x in (a, b))
        return interpreter.TensorHandle(
            np.matmul(a32, b32, dtype=d.data.dtype) + d.data, d.dtype.scalar)

    builder_cls.cast_impl = cast_impl
    builder_cls.create_fp_to_fp = create_fp_to_fp
    builder_cls.create_dot = create_dot
    _APPLIED = True
