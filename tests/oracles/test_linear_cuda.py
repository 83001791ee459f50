"""The raw-CUDA GPTQ GEMV (qv/kernels/linear/gptq_gemv_mma.cu) against the reference, for 8- and 4-bit codes:
every row count of one and two 8-row tiles, the three group sizes, zeros and bias, bf16 rows beyond fp16's range, columns that
end inside a warp's range, split-K with its ticketed reduce (deterministic, tickets left at zero) and
CUDA-graph replay. On CPU the source is compiled by NVRTC for sm_80 and sm_90 when a libnvrtc is
installed (the CUDA wheels that come with torch carry one)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, DEV, K, capture_graph, needs_cuda_kernels, randn, run_reference
from nvrtc_compile import compile_ptx, nvrtc
from test_linear import gptq_weight
from test_linear_int4 import int4_weight
from util import assert_close


@pytest.mark.parametrize("arch", [80, 90])
def test_source_compiles(arch):
    """NVRTC builds the instantiations the wrapper asks for by default (1-2 row tiles x 2/4/8 steps a
    group x warps along K or not)."""
    from qv.kernels.cuda_build import source_text
    from qv.kernels.linear.cuda_sm90 import GROUPS, SOURCE

    lib = nvrtc()
    if lib is None:
        pytest.skip("no libnvrtc installed")
    names = [f"gptq_gemv_mma<{mt}, {g // 16}, {4 - mt}, {wk}, {bits}>" for mt in (1, 2) for g in GROUPS for wk in (1, 4)
             for bits in (8, 4)]
    rc, log, ptx = compile_ptx(lib, source_text(SOURCE), names, arch)
    assert rc == 0, log
    assert ptx.count(b"mma.sync.aligned.m16n8k16") >= len(names)


def gemv_row_cases(test):
    """Every row count of one and two 8-row tiles, both dtypes, warps side by side (wk=1) or along K (wk=4)."""
    for mark in (pytest.mark.parametrize("wk", [1, 4]), pytest.mark.parametrize("m", [1, 3, 8, 9, 16]),
                 pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16]), needs_cuda_kernels,
                 pytest.mark.gpu):
        test = mark(test)
    return test


def _cuda_case(dtype, m, n, k, group, zeros=False, bias=False, cfg=None, x=None, bits=8):
    """The CUDA GEMV on NaN-poisoned output against the reference, row by row; it must report that it ran."""
    from qv.kernels.linear.configs import gemv_cuda_config
    from qv.kernels.linear.cuda_sm90 import gemv_cuda

    w = (gptq_weight if bits == 8 else int4_weight)(n, k, group, zeros, False, dtype)
    x = randn(m, k, dtype=dtype) if x is None else x
    b = randn(n, dtype=dtype) if bias else None
    out = torch.full((m, n), float("nan"), dtype=dtype, device=DEV)
    assert gemv_cuda(x, w, b, out, {**gemv_cuda_config(DEV), "eager_min_bytes": 0, **(cfg or {})}), \
        "the CUDA GEMV did not run"
    ref = run_reference(K.linear, x, w, b)
    for r in range(m):  # row by row: rows of very different size must each be right
        assert_close(f"CUDA GEMV row {r}", out[r], ref[r], BOUND[dtype])
    return x, w, b, out


@gemv_row_cases
def test_cuda_gemv_gpu(dtype, m, wk):
    """Warps side by side (wk=1) or along K (wk=4) at odd and real shapes."""
    cfg = dict(wk=wk)
    _cuda_case(dtype, m, 1040, 384, 128, zeros=m % 2 == 1, bias=m > 4, cfg=cfg)  # 1040: a block partly used
    _cuda_case(dtype, m, 48, 96, 32, bias=True, cfg=cfg)
    _cuda_case(dtype, m, 336, 320, 64, zeros=True, cfg=cfg)
    _cuda_case(dtype, m, 34816, 5120, 128, cfg=cfg)
    _cuda_case(dtype, m, 5120, 17408, 128, zeros=True, bias=True, cfg=cfg)
    _cuda_case(dtype, m, 1040, 128, 128, bias=True, cfg=cfg)  # one group: no split, bias in the direct store


@pytest.mark.gpu
@needs_cuda_kernels
def test_cuda_gemv_bf16_range_gpu():
    x = randn(3, 512, dtype=torch.float32)
    x[0, :128] *= 1e6
    x[1] *= 1e-6
    x[2, 256:384] *= 1e-30  # a group of zeros in fp16 next to normal groups
    _cuda_case(torch.bfloat16, 3, 256, 512, 128, x=x.to(torch.bfloat16))
    x = randn(16, 256, dtype=torch.float32)
    x *= torch.exp2(4.0 * torch.arange(16, device=DEV) - 30.0)[:, None]  # every row its own scale, 2^-30..2^30
    x[15] *= 1e-37 / x[15].abs().max()  # a row at 1e-37: 2^-136 as its scale would make 1/scale inf
    _cuda_case(torch.bfloat16, 16, 256, 256, 128, x=x.to(torch.bfloat16))


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("k", [128, 1024])
@pytest.mark.parametrize("wk", [1, 4])
def test_cuda_gemv_split_and_graph_gpu(k, wk):
    """One K range (one group), or many (the last block of a column range sums them): the same bits on a
    rerun and under CUDA-graph replay, and the tickets left at zero."""
    from qv.kernels.linear import triton_gemv
    from qv.kernels.linear.cuda_sm90 import gemv_cuda

    cfg = dict(waves=1, min_blocks=None, wk=wk)
    x, w, b, out = _cuda_case(torch.bfloat16, 5, 2064, k, 128, zeros=True, bias=True, cfg=cfg)
    again = torch.empty_like(out)
    assert gemv_cuda(x, w, b, again, cfg)
    assert torch.equal(again, out)
    graph_out = torch.empty_like(out)
    graph, ran = capture_graph(lambda: gemv_cuda(x, w, b, graph_out, cfg))
    assert ran
    for _ in range(2):
        graph_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(graph_out, out)
    assert all(int(t.abs().sum()) == 0 for t in triton_gemv._TICKETS.values())


def test_warp_layout_by_shape():
    """One row of x: the layout whose blocks fill more of a round (396 resident blocks, an H200 at the
    168-register cap): side by side for wide outputs, along K for narrow ones; more rows: along K."""
    from qv.kernels.linear.cuda_sm90 import _grid, warps_along_k

    assert _grid(5120, 34816, 128, 1, 396, 1) == (68, 5, 1024)
    assert _grid(5120, 34816, 128, 4, 396, 1) == (272, 1, 5120)
    assert _grid(17408, 5120, 128, 4, 396, 1) == (40, 9, 2048)
    assert _grid(17408, 5120, 128, 1, 396, 1) == (10, 34, 512)
    assert _grid(17408, 5120, 128, 4, 396, 1, splits=7) == (40, 7, 2560)  # a forced split count
    assert warps_along_k(1, 5120, 34816, 128, 396) == 1
    assert warps_along_k(1, 17408, 5120, 128, 396) == 4
    assert warps_along_k(4, 5120, 34816, 128, 396) == 4


def test_wk_is_checked():
    """Only the two warp layouts the kernel is built for are accepted (others would silently be wrong)."""
    from qv.kernels.linear.cuda_sm90 import gemv_cuda

    w = gptq_weight(64, 128, 128, False, False, torch.float16)
    with pytest.raises(ValueError, match="wk must be 1"):
        gemv_cuda(randn(2, 128, dtype=torch.float16), w, None, torch.empty(2, 64, dtype=torch.float16, device=DEV),
                  dict(waves=1, min_blocks=None, wk=2))


@pytest.mark.gpu
@needs_cuda_kernels
def test_cuda_gemv_eager_policy_gpu():
    """With the default settings an eager call on a small weight declines (the Triton GEMV's host time is
    the smaller) after building the kernel, and a CUDA-graph capture of the same call runs it."""
    from qv.kernels.linear.configs import gemv_cuda_config
    from qv.kernels.linear.cuda_sm90 import gemv_cuda

    cfg = gemv_cuda_config(DEV)
    w = gptq_weight(1024, 512, 128, False, False, torch.float16)
    x = randn(4, 512, dtype=torch.float16)
    out = torch.empty(4, 1024, dtype=torch.float16, device=DEV)
    assert not gemv_cuda(x, w, None, out, cfg)
    out.fill_(float("nan"))
    graph, ran = capture_graph(lambda: gemv_cuda(x, w, None, out, cfg))
    assert ran, "the kernel was not built by the eager call, or declined under capture"
    graph.replay()
    torch.cuda.synchronize()
    assert_close("CUDA GEMV captured after an eager decline", out, run_reference(K.linear, x, w, None),
                 BOUND[torch.float16])


@gemv_row_cases
def test_cuda_gemv_int4_gpu(dtype, m, wk):
    """4-bit codes (nibbles split after the loads): symmetric and with zeros, the three group sizes, odd column
    counts, split-K."""
    cfg = dict(wk=wk)
    _cuda_case(dtype, m, 1040, 384, 128, zeros=m % 2 == 1, bias=m > 4, cfg=cfg, bits=4)
    _cuda_case(dtype, m, 48, 96, 32, bias=True, cfg=cfg, bits=4)
    _cuda_case(dtype, m, 272, 2048, 64, zeros=True, cfg=dict(wk=wk, splits=4), bits=4)


@pytest.mark.gpu
@needs_cuda_kernels
def test_cuda_gemv_does_not_spill_gpu():
    """The builds the wrapper picks by default fit their register caps: a spill would cost speed silently."""
    from qv.kernels.cuda_build import build, device_index
    from qv.kernels.linear.cuda_sm90 import GROUPS, SOURCE

    for mt, wk in ((1, 1), (1, 4), (2, 4)):
        for group in GROUPS:
            for bits in (8, 4):
                name = f"gptq_gemv_mma<{mt}, {group // 16}, {3 if mt == 1 else 2}, {wk}, {bits}>"
                built = build(SOURCE, name, device_index(DEV))
                assert built is not None and built[0].local_size_bytes == 0, name
