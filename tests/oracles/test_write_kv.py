"""write_kv (paged cache store, int8 quantization) against the reference: the whole cache and
its scale tables after the call, so skipped rows (-1) and untouched blocks are checked too."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DEV, K, paged_layout, randn, run_reference, run_triton, slots_for


def _check(act_dtype, kv_dtype, hkv, d, seq_lens, block_size, skip_every=0):
    bt, tables, nb = paged_layout(seq_lens, block_size)
    slots = slots_for(tables, [0] * len(seq_lens), seq_lens, block_size)
    if skip_every:
        slots[::skip_every] = -1
    t = slots.numel()
    k, v = randn(t, hkv, d, dtype=act_dtype, scale=3.0), randn(t, hkv, d, dtype=act_dtype)
    shape = (nb, block_size, hkv, d)
    if kv_dtype == torch.int8:  # random prior contents, so rows the op must not touch are checked
        caches = [torch.randint(-127, 128, shape, dtype=torch.int8, device=DEV) for _ in range(2)]
        scales = [torch.rand(shape[:3], device=DEV) for _ in range(2)]
    else:
        caches = [randn(*shape, dtype=kv_dtype) for _ in range(2)]
        scales = [None, None]
    ours = [c.clone() for c in caches] + [None if s is None else s.clone() for s in scales]
    ref = [c.clone() for c in caches] + [None if s is None else s.clone() for s in scales]
    run_triton(K.write_kv, k, v, *ours[:2], slots, *ours[2:])
    run_reference(K.write_kv, k, v, *ref[:2], slots, *ref[2:])
    if kv_dtype != torch.int8:
        for name, a, b in zip(("k", "v"), ours, ref):
            assert torch.equal(a, b), f"{name}: {(a.float() - b.float()).abs().max().item()} max difference"
        return
    # On CUDA torch divides by a Python scalar as a multiply by its reciprocal, so the reference's
    # scale amax / 127 can differ from the kernel's IEEE division by an ulp, and a code sitting on a
    # rounding boundary by one step: allow exactly that, rarely.
    for name, a, b in zip(("k_scale", "v_scale"), ours[2:], ref[2:]):
        assert ((a - b).abs() <= 2e-7 * b.abs()).all(), f"{name}: max rel diff {((a - b).abs() / b.abs()).max()}"
    for name, a, b in zip(("k", "v"), ours[:2], ref[:2]):
        diff = (a.int() - b.int()).abs()
        assert diff.max() <= 1 and diff.float().mean() < 1e-3, f"{name}: codes differ ({diff.float().mean():.2e})"


@pytest.mark.parametrize("act_dtype,kv_dtype,hkv,d", [
    (torch.float32, torch.float32, 1, 16),
    (torch.bfloat16, torch.bfloat16, 3, 24),
    (torch.float16, torch.float16, 2, 64),
    (torch.float32, torch.int8, 3, 40),
    (torch.bfloat16, torch.int8, 1, 256),
])
def test_write_kv(act_dtype, kv_dtype, hkv, d):
    _check(act_dtype, kv_dtype, hkv, d, [5, 0, 1, 19], block_size=8, skip_every=3)


@pytest.mark.gpu
@pytest.mark.parametrize("act_dtype,kv_dtype", [(torch.bfloat16, torch.int8), (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.int8), (torch.float32, torch.float32)])
def test_write_kv_real_shapes(act_dtype, kv_dtype):
    _check(act_dtype, kv_dtype, 4, 256, [1000, 1, 2047, 333], block_size=16, skip_every=7)
