"""The raw-CUDA decode attention (qv/kernels/paged_attention/paged_decode_mma.cu) against the fp32 reference
over the same int8 cache: head dims 128 and 256, GQA groups of 1 to 8 query rows, speculative rows (several tokens a
sequence, in chunks of 8 rows a block), pages of 16 to 64 keys in shuffled order, contexts not multiples
of the tile, split counts from one to many, fp16 and bf16 queries, and one dominant key at split edges
and at the end. The cache outside the sequences is poisoned (random codes, NaN scales; table padding
points there) and the output is NaN before the call; the kernel must report that it ran. On CPU the
source is compiled by NVRTC for sm_80 and sm_90 when a libnvrtc is installed."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import (BOUND, DEV, K, capture_graph, cu_seqlens, nan_empty, needs_cuda_kernels, paged_layout, randn,
                          run_reference, slots_for)
from nvrtc_compile import compile_ptx, nvrtc
from util import assert_close


@pytest.mark.parametrize("arch", [80, 90])
def test_source_compiles(arch):
    from qv.kernels.cuda_build import source_text
    from qv.kernels.paged_attention.cuda_sm90 import HEAD_DIMS, SOURCE

    lib = nvrtc()
    if lib is None:
        pytest.skip("no libnvrtc installed")
    names = [f"paged_decode_mma<{d}, {mb}>" for d in HEAD_DIMS for mb in (1, 2)]
    rc, log, ptx = compile_ptx(lib, source_text(SOURCE), names, arch)
    assert rc == 0, log
    assert ptx.count(b"movmatrix.sync.aligned.m8n8.trans.b16") >= len(names)


def test_default_decode_kind(monkeypatch):
    """On sm_90 decode runs the CUDA kernel, unless the config names a setting only the Triton kernel
    reads (which the CUDA kernel would silently ignore); elsewhere the Triton kernel."""
    from qv.kernels.paged_attention.configs import decode_kind

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert decode_kind(cuda, {}) == "cuda" and decode_kind(cuda, {"waves": 2}) == "cuda"
    assert all(decode_kind(cuda, {key: 1}) == "split" for key in ("stages", "BLOCK_N", "words", "num_warps"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert decode_kind(cuda, {}) == "split"
    assert decode_kind(torch.device("cpu"), {}) == "split"


def _inputs(dtype, hkv, rep, d, q_lens, ctx, block_size, slack, padded=False, pad_page=None):
    """A poisoned int8 cache holding each sequence's keys, and the decode arguments (max_seq_len `slack`
    above the longest sequence, as under graph capture). padded: caches, scale tables and q are views into
    larger tensors (every stride differs from the packed layout's). Table padding points at a poisoned
    spare page, or holds pad_page (a number that is no page at all)."""
    seq_lens = [c + n for c, n in zip(ctx, q_lens)]
    bt, tables, nb = paged_layout(seq_lens, block_size)
    spare = sorted(set(range(nb)) - {p for table in tables for p in table})[0]
    for i, table in enumerate(tables):  # table padding points at a poisoned page, not a used one
        bt[i, len(table):] = spare if pad_page is None else pad_page
    pad = 1 if padded else 0
    codes = torch.randint(-128, 128, (2, nb, 1 + pad, block_size, hkv + pad, d + 16 * pad), dtype=torch.int8,
                          device=DEV)
    kc, vc = codes[0, :, 0, :, :hkv, :d], codes[1, :, 0, :, :hkv, :d]
    scales = torch.full((2, nb, block_size, hkv + pad), float("nan"), device=DEV)
    ks, vs = scales[0, :, :, :hkv], scales[1, :, :, :hkv]
    k, v = randn(sum(seq_lens), hkv, d), randn(sum(seq_lens), hkv, d)
    run_reference(K.write_kv, k, v, kc, vc, slots_for(tables, [0] * len(seq_lens), seq_lens, block_size), ks, vs)
    q = randn(sum(q_lens), hkv * rep + pad, d + 64 * pad, dtype=dtype)[:, :hkv * rep, :d]
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return q, kc, vc, ks, vs, bt, cu_seqlens(q_lens), sl, d ** -0.5, max(q_lens), max(seq_lens) + slack


def _run(args, cfg):
    from qv.kernels.paged_attention.configs import decode_cuda_config
    from qv.kernels.paged_attention.cuda_sm90 import decode_cuda

    with nan_empty():
        out = decode_cuda(*args, {**decode_cuda_config(DEV), "eager_min_bytes": 0, **(cfg or {})})
    assert out is not None, "the CUDA decode kernel did not run"
    return out


def _case(dtype, hkv, rep, d, q_lens, ctx, block_size=16, cfg=None, slack=0, padded=False, pad_page=None):
    args = _inputs(dtype, hkv, rep, d, q_lens, ctx, block_size, slack, padded, pad_page)
    q, kc, vc, ks, vs, bt, cu, sl, scale, max_q, max_kv = args
    out = _run(args, cfg)
    ref = run_reference(K.paged_attention, q, kc, vc, bt, cu, sl, scale, ks, vs, max_q, max_kv)
    for i in range(len(q_lens)):  # sequence by sequence: a short one must not hide in a long one's error
        s, e = int(cu[i]), int(cu[i + 1])
        if e > s:
            assert_close(f"CUDA decode sequence {i}", out[s:e], ref[s:e], BOUND[dtype])
    return args, out


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("rep", [1, 3, 6, 8])
def test_cuda_decode_gpu(dtype, d, rep):
    hkv = 2 if rep == 8 else 4
    _case(dtype, hkv, rep, d, [1, 1, 1, 1, 1], [1, 15, 16, 17, 1000])  # tile edges, a one-key sequence
    _case(dtype, hkv, rep, d, [1] * 3, [40000, 3, 777], slack=37)  # many splits, most empty for short rows
    # speculative rows (row j of k + 1 sees seq_len - (k - j) keys), one or more blocks of 8 rows each
    _case(dtype, hkv, rep, d, [2, 1, 2], [63, 500, 4000])
    _case(dtype, hkv, rep, d, [4, 3, 8], [90, 33, 2100])
    # rows on both sides of a split edge (keys 16 and 32): some rows see nothing of the last split
    _case(dtype, hkv, rep, d, [8, 4], [12, 30], cfg=dict(splits=3))
    _case(dtype, hkv, rep, d, [1, 1], [300, 77], cfg=dict(splits=1))  # one split: the kernel stores the output


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("pad_page", [-1, 1 << 30])
def test_cuda_decode_table_padding_out_of_range_gpu(pad_page):
    """Table entries past a sequence that are no page (-1, or past the cache): each warp's first tile loads
    before the lengths are known, from its table entry clamped to the cache, so these must neither fault nor
    leak into the output (short sequences in many splits: most splits lie past their ends)."""
    _case(torch.bfloat16, 4, 6, 256, [1, 1, 2], [3000, 5, 40], slack=700, pad_page=pad_page, cfg=dict(splits=40))
    _case(torch.float16, 2, 3, 128, [1, 1], [100, 17], block_size=64, slack=300, pad_page=pad_page)
    torch.cuda.synchronize()  # an illegal address would surface here at the latest


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("block_size", [32, 64])
@pytest.mark.parametrize("splits", [1, 3, 40])
def test_cuda_decode_pages_and_splits_gpu(block_size, splits):
    """Pages longer than a tile, and a forced split count: one block per sequence (the direct store), a
    few, and more splits than some sequences have tiles."""
    _case(torch.bfloat16, 4, 6, 256, [1, 1, 1, 1], [5000, 129, 64, 2], block_size=block_size,
          cfg=dict(splits=splits))
    _case(torch.float16, 2, 3, 128, [1, 2, 1], [700, 90, 3], block_size=block_size, cfg=dict(splits=splits),
          padded=True)  # every stride its own


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("splits", [1, 7])
def test_cuda_decode_rerun_and_graph_gpu(splits):
    """The same bits on a second call and under CUDA-graph replay (seq_lens changed in place between
    replays must give the new sequences' answer)."""
    from qv.kernels.paged_attention.configs import decode_cuda_config
    from qv.kernels.paged_attention.cuda_sm90 import decode_cuda

    cfg = dict(decode_cuda_config(DEV), eager_min_bytes=0, splits=splits)
    args, out = _case(torch.bfloat16, 4, 6, 256, [1, 1], [3000, 700], cfg=cfg, slack=100)
    assert torch.equal(_run(args, cfg), out)
    graph, graph_out = capture_graph(lambda: decode_cuda(*args, cfg))
    assert graph_out is not None
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, out)
    q, kc, vc, ks, vs, bt, cu, sl, scale, max_q, max_kv = args
    sl -= torch.tensor([50, 699], dtype=torch.int32, device=DEV)  # shorter sequences, same graph
    graph.replay()
    torch.cuda.synchronize()
    ref = run_reference(K.paged_attention, q, kc, vc, bt, cu, sl, scale, ks, vs, max_q, max_kv)
    assert_close("CUDA decode graph replay, shorter sequences", graph_out, ref, BOUND[torch.bfloat16])


@pytest.mark.gpu
@needs_cuda_kernels
def test_cuda_decode_declines_gpu():
    """Where the kernel does not apply it returns None and launches nothing (the caller runs Triton)."""
    from qv.kernels.paged_attention.configs import decode_cuda_config
    from qv.kernels.paged_attention.cuda_sm90 import decode_cuda

    cfg = dict(decode_cuda_config(DEV), eager_min_bytes=0)
    q, kc, vc, ks, vs, bt, cu, sl, scale, max_q, max_kv = _inputs(torch.bfloat16, 2, 6, 64, [1], [100], 16, 0)
    assert decode_cuda(q, kc, vc, ks, vs, bt, cu, sl, scale, max_q, max_kv, cfg) is None  # head dim 64
    q, kc, vc, ks, vs, bt, cu, sl, scale, max_q, max_kv = _inputs(torch.float32, 2, 6, 128, [2], [100], 16, 0)
    assert decode_cuda(q, kc, vc, ks, vs, bt, cu, sl, scale, max_q, max_kv, cfg) is None  # fp32 queries
    q, kc, vc, ks, vs, bt, cu, sl, scale, max_q, max_kv = _inputs(torch.bfloat16, 2, 3, 128, [1], [100], 8, 0)
    assert decode_cuda(q, kc, vc, ks, vs, bt, cu, sl, scale, max_q, max_kv, cfg) is None  # pages of 8 keys


@pytest.mark.gpu
@needs_cuda_kernels
def test_cuda_decode_eager_policy_gpu():
    """With the default settings a small eager call declines (a CuPy launch costs more host time than the
    Triton kernel's) after building the kernel, and a CUDA-graph capture of the same call runs it."""
    from qv.kernels.paged_attention.configs import decode_cuda_config
    from qv.kernels.paged_attention.cuda_sm90 import decode_cuda

    cfg = decode_cuda_config(DEV)
    args = _inputs(torch.bfloat16, 4, 6, 256, [1, 1], [3000, 700], 16, 0)
    assert decode_cuda(*args, cfg) is None
    graph, out = capture_graph(lambda: decode_cuda(*args, cfg))
    assert out is not None, "the kernel was not built by the eager call, or declined under capture"
    graph.replay()
    torch.cuda.synchronize()
    q, kc, vc, ks, vs, bt, cu, sl, scale, max_q, max_kv = args
    ref = run_reference(K.paged_attention, q, kc, vc, bt, cu, sl, scale, ks, vs, max_q, max_kv)
    assert_close("CUDA decode captured after an eager decline", out, ref, BOUND[torch.bfloat16])


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("pos", [0, 1023, 1024, 2047, 4094, 4095])
def test_cuda_decode_needle_gpu(pos):
    """One key (at a split's first or last position, or the sequence's last) whose score dominates: the
    output must be that key's value. A norm-wise bound over thousands of diffuse keys cannot see one key
    read from the wrong place; this can (it fails with the needle's value missing)."""
    args = _inputs(torch.bfloat16, 4, 1, 256, [1], [4095], 16, 0)
    q, kc, vc, ks, vs, bt, cu, sl, scale, max_q, max_kv = args
    k = q.float() * 2.0  # score 2 |q|^2 / 16 ~ 32 against ~N(0, 1) for the others
    v = randn(1, 4, 256) * 4.0
    slot = (bt[0, pos // 16] * 16 + pos % 16).reshape(1).long()
    run_reference(K.write_kv, k, v, kc, vc, slot, ks, vs)
    out = _run(args, dict(splits=4))  # splits of 1024 keys
    ref = run_reference(K.paged_attention, q, kc, vc, bt, cu, sl, scale, ks, vs, max_q, max_kv)
    assert_close("CUDA decode with a dominant key", out, ref, BOUND[torch.bfloat16])
    blk, off = slot // 16, slot % 16
    needle = vc[blk, off].float() * vs[blk, off][..., None]
    assert_close("CUDA decode output vs the dominant key's value", out.float(), needle, 2e-2)


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("d", [128, 256])
def test_cuda_decode_does_not_spill_gpu(d):
    """The default build fits its registers (255 at d 256): a spill would cost speed silently."""
    from qv.kernels.cuda_build import build, device_index
    from qv.kernels.paged_attention.configs import decode_cuda_config
    from qv.kernels.paged_attention.cuda_sm90 import SOURCE

    built = build(SOURCE, f"paged_decode_mma<{d}, {decode_cuda_config(DEV)['min_blocks']}>", device_index(DEV))
    assert built is not None
    assert built[0].local_size_bytes == 0, f"{built[1]} registers and {built[0].local_size_bytes} bytes of spills"
