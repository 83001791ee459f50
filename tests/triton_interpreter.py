"""Make the Triton interpreter's bf16 match the GPU, for the CPU tests (conftest applies it when
TRITON_INTERPRET is set). The interpreter stores bf16 as raw uint16 and feeds those bits to np.matmul
(garbage), so tl.dot operands are upcast to fp32 (the GPU accumulates in fp32 too); and it truncates
fp32 -> bf16, which biases every recurrence, so that cast rounds to nearest-even here like the GPU.
(Integer -> bf16 casts are wrong too: the kernels go via fp32.) Its fp32 -> e4m3 cast rounds ties up and wraps
past 448; the GPU rounds to nearest-even and saturates, so that cast goes through torch here."""

from __future__ import annotations

import torch


def patch_bf16() -> None:
    try:
        import triton.language as tl
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:  # pragma: no cover - other triton layouts
        return
    if getattr(InterpreterBuilder, "_qv_bf16_dot", False):
        return
    original = InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args, **kwargs):
        if a.dtype.scalar == tl.bfloat16:
            a = self.cast_impl(a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = self.cast_impl(b, tl.float32)
        return original(self, a, b, d, *args, **kwargs)

    cast_original = InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(src.data.astype("float32")).to(torch.bfloat16).view(torch.int16).numpy()
            return TensorHandle(bits.view("uint16"), tl.bfloat16)
        return cast_original(self, src, dst_type)

    fp_to_fp_original = InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            values = torch.from_numpy(src.data.astype("float32")).clamp(-448., 448.)
            return TensorHandle(values.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), tl.float8e4nv)
        return fp_to_fp_original(self, src, dst_type, rounding_mode)

    InterpreterBuilder.create_dot = create_dot
    InterpreterBuilder.create_fp_to_fp = create_fp_to_fp
    InterpreterBuilder.cast_impl = cast_impl
    InterpreterBuilder._qv_bf16_dot = True
