"""paged_attention under the "sm70" backend (cuda_sm70.py, paged_decode_m884.cu, paged_prefill_m884.cu) against the
fp32 reference on the same cache: fp16 queries over int8 (NaN scales and random codes outside the sequences)
and fp16 (NaN outside) caches, the 27B's GQA (24 q / 4 kv heads, head dim 256) and small ones (3 / 6 heads a
KV head, head dims 64 and 32), sequences of 1, 17, 255, 1037 and 4099 keys in shuffled pages of 16 to 64 keys
(table padding pointing at a poisoned page), decode rows, speculative rows (k = 3), prefill chunks with and
without a cached prefix (their own keys from k_new, the cache's copies poisoned, for fp16 caches), split
counts from one to many, a dominant key at split edges, and CUDA-graph replay. Outputs and split partials
are NaN before the kernels write; each GPU test requires that the kernels ran (the fallback raises) and that
no Triton kernel did. Where the kernels do not apply the fp32 fallback must give the reference's answer.

On CPU: every BUILDS instantiation compiles for compute_70 with CUDA 12's NVRTC (when installed), its PTX
targets sm_70 and holds m8n8k4 MMAs, and ptxas reports no spills; a NumPy model of the PTX fragment layouts
checks the kernels' lane mappings (which key, head dim and row each lane feeds and gets back); the kernels
transliterated at warp level (m884_attention_model.py) run against the reference; and the host side's launches, run
by that model, pass every argument where the .cu's signature expects it."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import m884_attention_model as M
from kernel_cases import DEV, K, capture_graph, cu_seqlens, nan_empty, paged_layout, randn, run_reference, slots_for
from util import assert_close

from qv.kernels.paged_attention import cuda_sm70

BOUND = 1e-2  # fp16 activations (DESIGN.md), relative RMS per sequence
needs_cupy = pytest.mark.skipif(not torch.cuda.is_available() or cuda_sm70.cupy_or_none() is None,
                                reason="needs a CUDA GPU and CuPy (the gpu extra)")


# ---------------------------------------------------------------------------------------------------- CPU

# the sm_70 builds of BUILDS (NVRTC 12, ptxas, spills, MMA counts): tests/test_kernels_aot.py


def test_prefill_smem_fits_volta():
    """The prefill's dynamic shared memory at each head dim fits the 96 KiB a V100 block may opt into."""
    assert all(cuda_sm70.prefill_smem_bytes(d) <= 96 << 10 for d in cuda_sm70.HEAD_DIMS)


# The PTX ISA's m8n8k4 fragments, element by element (m884_attention_model.mma884 is the vectorized twin the kernel
# models use): four 8x8x4 products a warp, quad pair qp = lanes 4 qp .. 4 qp + 3 and 16 + 4 qp ..

def _mma(a, b, c, a_row: bool, b_row: bool):
    """d = A B + C per quad pair, from fragments a [32, 4], b [32, 4], c [32, 8] (every element placed once)."""
    d = c.copy()
    for qp in range(4):
        lanes = [4 * qp + t for t in range(4)] + [16 + 4 * qp + t for t in range(4)]
        A, B, C = np.full((8, 4), np.nan), np.full((4, 8), np.nan), np.full((8, 8), np.nan)
        for lane in lanes:
            t, hi = lane % 4, lane >> 4
            for i in range(4):
                A[(t + 4 * hi, i) if a_row else (i + 4 * hi, t)] = a[lane, i]
                B[(t, i + 4 * hi) if b_row else (i, t + 4 * hi)] = b[lane, i]
            for i in range(8):
                C[M.c_pos(lane, i)] = c[lane, i]
        assert not (np.isnan(A).any() or np.isnan(B).any() or np.isnan(C).any())
        D = A @ B + C
        for lane in lanes:
            for i in range(8):
                d[lane, i] = D[M.c_pos(lane, i)]
    return d


def _lane(lane):
    return lane & 3, (lane >> 2) & 3, lane >> 4  # t, qp, hi


def _decode_b_dim(d, qp, hi, j, i):  # decode's V slice: dims (2 qp + hi) D/8 + 4 j + i
    return (2 * qp + hi) * (d // 8) + 4 * j + i


def _prefill_b_dim(d, qp, hi, j, i):  # prefill's V granule 8 j + 2 qp + hi
    return 4 * (8 * j + 2 * qp + hi) + i


def test_vectorized_mma_model():
    rng = np.random.default_rng(0)
    for b_row in (False, True):
        a, b, c = rng.standard_normal((32, 4)), rng.standard_normal((32, 4)), rng.standard_normal((32, 8))
        d = c.copy()
        M.mma884(d, a, b, b_row)
        assert np.allclose(d, _mma(a, b, c, True, b_row))


@pytest.mark.parametrize("d", [32, 64, 256])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_fragment_model(d, kind):
    """S = Q K^T (row.col, lane feeds key 8 qp + t + 4 hi) lands at (row, key_of(i)); the P tile written from
    S's layout reads back as P V's A fragments; O += P V (row.row, lane t feeds key 4 ks + t at the kernel's
    head dims) lands at (row, *_dim(j, i)), covering the 8 x D output once."""
    rng = np.random.default_rng(d)
    q, k, v = rng.standard_normal((8, d)), rng.standard_normal((32, d)), rng.standard_normal((32, d))
    s = np.zeros((32, 8))
    for st in range(d // 4):
        a = np.array([q[_lane(L)[0] + 4 * _lane(L)[2], 4 * st:4 * st + 4] for L in range(32)])
        b = np.array([k[8 * _lane(L)[1] + _lane(L)[0] + 4 * _lane(L)[2], 4 * st:4 * st + 4] for L in range(32)])
        s = _mma(a, b, s, a_row=True, b_row=False)
    scores = q @ k.T
    for L in range(32):
        for i in range(8):
            assert np.isclose(s[L, i], scores[M.c_pos(L, i)[0], M.key_of(i, L)])
    p_tile = np.full((8, cuda_sm70.P_STRIDE), np.nan)  # what softmax_step stores, from S's layout
    for L in range(32):
        for i in range(8):
            p_tile[(L & 1) + 4 * (L >> 4) + (i & 2), M.key_of(i, L)] = s[L, i]
    assert np.allclose(p_tile[:, :32], scores)
    b_dim, c_dim = ((_decode_b_dim, M.decode_dim) if kind == "decode"
                    else (_prefill_b_dim, lambda d, j, i, lane: M.prefill_dim(j, i, lane)))
    acc = np.zeros((d // 32, 32, 8))
    for ks in range(8):
        a = np.array([p_tile[_lane(L)[0] + 4 * _lane(L)[2], 4 * ks:4 * ks + 4] for L in range(32)])
        for j in range(d // 32):
            b = np.array([[v[4 * ks + _lane(L)[0], b_dim(d, _lane(L)[1], _lane(L)[2], j, i)] for i in range(4)]
                          for L in range(32)])
            acc[j] = _mma(a, b, acc[j], a_row=True, b_row=True)
    o = scores @ v
    seen = np.zeros((8, d), dtype=int)
    for j in range(d // 32):
        for L in range(32):
            for i in range(8):
                row, col = M.c_pos(L, i)[0], c_dim(d, j, i, L)
                assert np.isclose(acc[j, L, i], o[row, col])
                seen[row, col] += 1
    assert (seen == 1).all()


def _banks(byte_offsets):
    """Whether 8-byte shared loads at these offsets (one half warp) touch each bank once."""
    words = [w for off in byte_offsets for w in (off // 4 % 32, (off // 4 + 1) % 32)]
    return len(set(words)) == len(words)


@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_prefill_smem_layouts(d):
    """The prefill's K row order and V granule swizzle are permutations (nothing overwritten or lost), and at
    d >= 64 the fragment reads of each half warp (Q, K, V, P) hit distinct banks."""
    k_row = [(n % 8) * 4 + n // 8 for n in range(32)]
    assert sorted(k_row) == list(range(32))

    def v_granule(g, key):
        return g ^ (((key & 1) | ((key & 2) << 2)) & (d // 4 - 1))

    for key in range(32):
        assert sorted(v_granule(g, key) for g in range(d // 4)) == list(range(d // 4))
    if d < 64:
        return
    for half in (range(16), range(16, 32)):
        for st in (0, d // 8):
            q_rows = [(L & 3) + 4 * (L >> 4) for L in half]
            assert _banks(sorted({r * (d + 4) * 2 + 8 * st for r in q_rows}))  # quad pairs share (broadcast)
            assert _banks([k_row[8 * _lane(L)[1] + _lane(L)[0] + 4 * _lane(L)[2]] * (d + 4) * 2 + 8 * st
                           for L in half])
        for ks in (0, 5):
            for j in range(d // 32):
                assert _banks([(4 * ks + _lane(L)[0]) * d * 2
                               + 8 * v_granule(8 * j + 2 * _lane(L)[1] + _lane(L)[2], 4 * ks + _lane(L)[0])
                               for L in half])
            p_rows = sorted({(L & 3) + 4 * (L >> 4) for L in half})
            assert _banks([r * cuda_sm70.P_STRIDE * 2 + 8 * ks for r in p_rows])


# ---------------------------------------------------------------------------------------------------- GPU

def _inputs(kv_dtype, hkv, rep, d, q_lens, ctx, block_size=16, slack=0, pad_page=None):
    """Fresh random inputs: a cache holding each sequence's keys (written by the reference write_kv) and poison
    elsewhere (int8: random codes, NaN scales; fp16: NaN), table padding pointing at a poisoned spare page (or
    pad_page, no page at all); max_seq_len `slack` above the longest sequence. Returns the op's arguments and
    the new rows' K / V (k_new, v_new)."""
    seq_lens = [c + n for c, n in zip(ctx, q_lens)]
    bt, tables, nb = paged_layout(seq_lens, block_size)
    spare = sorted(set(range(nb)) - {p for table in tables for p in table})[0]
    for i, table in enumerate(tables):
        bt[i, len(table):] = spare if pad_page is None else pad_page
    shape = (nb, block_size, hkv, d)
    if kv_dtype == torch.int8:
        kc, vc = (torch.randint(-128, 128, shape, dtype=torch.int8, device=DEV) for _ in range(2))
        ks, vs = (torch.full(shape[:3], float("nan"), device=DEV) for _ in range(2))
    else:
        kc, vc = (torch.full(shape, float("nan"), dtype=kv_dtype, device=DEV) for _ in range(2))
        ks = vs = None
    k, v = randn(sum(seq_lens), hkv, d, dtype=torch.float16), randn(sum(seq_lens), hkv, d, dtype=torch.float16)
    run_reference(K.write_kv, k, v, kc, vc, slots_for(tables, [0] * len(seq_lens), seq_lens, block_size), ks, vs)
    starts = [0] + torch.tensor(seq_lens).cumsum(0).tolist()[:-1]
    rows = torch.cat([torch.arange(s + c, s + c + n) for s, c, n in zip(starts, ctx, q_lens)]).to(DEV)
    q = randn(sum(q_lens), hkv * rep, d, dtype=torch.float16)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    args = (q, kc, vc, bt, cu_seqlens(q_lens), sl, d ** -0.5, ks, vs, max(q_lens), max(seq_lens) + slack)
    return args, (k[rows], v[rows]), tables


@pytest.fixture
def kernels_only(monkeypatch):
    """The fp32 fallback and every Triton kernel raise: what runs is the m8n8k4 kernels."""
    import triton

    def refuse(*a, **kw):
        raise AssertionError("not the m8n8k4 kernels")

    monkeypatch.setattr(cuda_sm70, "reference_attention", refuse)
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", refuse)


def _run(args, **kw):
    with K.backend("sm70"), nan_empty():
        return K.paged_attention(*args, **kw)


def _check(name, out, args, ref=None):
    q, kc, vc, bt, cu, sl, scale, ks, vs, max_q, max_kv = args
    if ref is None:
        ref = run_reference(K.paged_attention, q, kc, vc, bt, cu, sl, scale, ks, vs)
    for i in range(cu.shape[0] - 1):  # sequence by sequence: a short one must not hide in a long one's error
        s, e = int(cu[i]), int(cu[i + 1])
        if e > s:
            assert_close(f"{name}, sequence {i}", out[s:e], ref[s:e], BOUND)


def _case(name, kv_dtype, hkv, rep, d, q_lens, ctx, block_size=16, slack=0, new_kv=False, pad_page=None):
    """The op under the sm70 backend vs the reference; a second call gives the same bits. new_kv: the
    chunk's own K / V passed as k_new / v_new too; for fp16 caches their copies in the pages are then
    poisoned (NaN), so a kernel that reads them from the pages fails."""
    args, (k_new, v_new), tables = _inputs(kv_dtype, hkv, rep, d, q_lens, ctx, block_size, slack, pad_page)
    q, kc, vc, bt, cu, sl, scale, ks, vs, max_q, max_kv = args
    ref = run_reference(K.paged_attention, q, kc, vc, bt, cu, sl, scale, ks, vs)
    kw = dict(k_new=k_new, v_new=v_new) if new_kv else {}
    if new_kv and kv_dtype == torch.float16:
        slots = slots_for(tables, ctx, [c + n for c, n in zip(ctx, q_lens)], block_size)
        kc.view(-1, hkv, d)[slots] = float("nan")
        vc.view(-1, hkv, d)[slots] = float("nan")
    out = _run(args, **kw)
    _check(name, out, args, ref)
    assert torch.equal(_run(args, **kw), out), f"{name}: a second call gave other bits"


SHAPES = [(4, 6, 256), (2, 3, 64), (1, 6, 32)]  # (KV heads, q heads a KV head, head dim): the 27B's, small ones


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float16], ids=["int8", "fp16"])
@pytest.mark.parametrize("hkv,rep,d", SHAPES)
def test_sm70_decode_gpu(kernels_only, kv_dtype, hkv, rep, d):
    _case("decode", kv_dtype, hkv, rep, d, [1] * 5, [0, 16, 254, 1036, 4098])  # 1, 17, 255, 1037, 4099 keys
    _case("decode, slack", kv_dtype, hkv, rep, d, [1] * 3, [20000, 2, 600], slack=333)  # most splits empty for some
    _case("speculative k=3", kv_dtype, hkv, rep, d, [4, 4, 4, 4], [13, 251, 1033, 3], block_size=32)
    _case("mixed rows", kv_dtype, hkv, rep, d, [2, 1, 8, 5], [63, 500, 4000, 9], block_size=64)


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float16], ids=["int8", "fp16"])
@pytest.mark.parametrize("hkv,rep,d", SHAPES)
def test_sm70_prefill_gpu(kernels_only, kv_dtype, hkv, rep, d):
    _case("prefill, no prefix", kv_dtype, hkv, rep, d, [1000, 255, 17], [0, 0, 0])
    _case("prefill over a prefix", kv_dtype, hkv, rep, d, [777, 33, 9, 1, 4], [500, 3000, 17, 40, 0])
    _case("prefill, own keys from k_new", kv_dtype, hkv, rep, d, [300, 64, 11], [1037, 0, 254], new_kv=True)


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("splits", [1, 3, 40])
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_sm70_forced_splits_gpu(kernels_only, path, splits):
    """One split (the kernel stores the output), a few, and more splits than short sequences have tiles;
    table padding that is no page at all (-1)."""
    fn = cuda_sm70.decode_m884 if path == "decode" else cuda_sm70.prefill_m884
    q_lens = [1, 4, 1] if path == "decode" else [100, 40, 1]
    for kv_dtype in (torch.int8, torch.float16):
        args, _, _ = _inputs(kv_dtype, 4, 6, 256, q_lens, [3000, 129, 5], block_size=32, slack=200, pad_page=-1)
        with nan_empty():
            out = fn(*args[:3], args[7], args[8], *args[3:7], *args[9:], torch.empty_like(args[0]), splits=splits)
        _check(f"{path}, {splits} splits", out, args)
    torch.cuda.synchronize()  # an illegal address would surface here at the latest


@pytest.mark.gpu
@needs_cupy
@pytest.mark.parametrize("pos", [0, 1023, 1024, 2047, 3070])
@pytest.mark.parametrize("q_len", [1, 40])
def test_sm70_needle_gpu(kernels_only, pos, q_len):
    """One key whose score dominates (at a split's first or last key, or the sequence's last before the
    chunk): the last query row's output must be that key's value. A norm-wise bound over thousands of diffuse
    keys cannot see one key read from the wrong place; this can."""
    args, _, tables = _inputs(torch.int8, 4, 1, 256, [q_len], [3071], block_size=16)
    q, kc, vc, bt, cu, sl, scale, ks, vs, max_q, max_kv = args
    k = q[-1:].float() * 2.0  # score 2 |q|^2 / 16 ~ 32 against ~N(0, 1) for the others
    v = randn(1, 4, 256) * 4.0
    slot = torch.tensor([tables[0][pos // 16] * 16 + pos % 16], device=DEV)
    run_reference(K.write_kv, k, v, kc, vc, slot, ks, vs)
    fn = cuda_sm70.decode_m884 if q_len == 1 else cuda_sm70.prefill_m884
    with nan_empty():
        out = fn(q, kc, vc, ks, vs, bt, cu, sl, scale, max_q, max_kv, torch.empty_like(q), splits=3)
    _check("needle", out, args)
    needle = vc[slot // 16, slot % 16].float() * vs[slot // 16, slot % 16][..., None]
    assert_close("output vs the dominant key's value", out[-1:].float(), needle, 2e-2)


@pytest.mark.gpu
@needs_cupy
def test_sm70_decode_graph_gpu(kernels_only):
    """The same bits under CUDA-graph replay; seq_lens shortened in place between replays give the new answer."""
    args, _, _ = _inputs(torch.int8, 4, 6, 256, [1, 4], [3000, 700], slack=100)
    eager = _run(args)
    with K.backend("sm70"):
        graph, out = capture_graph(lambda: K.paged_attention(*args))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    args[5].sub_(torch.tensor([50, 699], dtype=torch.int32, device=DEV))
    graph.replay()
    torch.cuda.synchronize()
    _check("graph replay, shorter sequences", out, args)


@pytest.mark.gpu
@needs_cupy
def test_sm70_fallback_gpu(monkeypatch):
    """Where the kernels do not apply (bf16 queries, head dim 16, pages of 12 keys) the op gives the fp32
    reference's answer without Triton, and inside a CUDA graph capture it raises naming the cause."""
    import triton

    def refuse(*a, **kw):
        raise AssertionError("a Triton kernel ran")

    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", refuse)
    for d, block_size, dtype in ((64, 16, torch.bfloat16), (16, 16, torch.float16), (64, 12, torch.float16)):
        args, _, _ = _inputs(torch.int8, 2, 3, d, [1, 5], [40, 9], block_size=block_size)
        args = (args[0].to(dtype),) + args[1:]
        assert cuda_sm70.unsupported(*args[:3], args[7], args[8], *args[3:6]) is not None
        out = _run(args)
        ref = run_reference(K.paged_attention, *args)
        assert torch.equal(out, ref)
    with K.backend("sm70"), pytest.raises(RuntimeError, match="bfloat16 queries"):
        bf16 = (args[0].to(torch.bfloat16),) + args[1:]
        capture_graph(lambda: K.paged_attention(*bf16))


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float16], ids=["int8", "fp16"])
@pytest.mark.parametrize("hkv,rep,d", [(2, 3, 32), (1, 6, 64)])
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_model_decode(kv_dtype, hkv, rep, d, splits):
    """The decode kernel and combine_splits as m884_attention_model transliterates them, on CPU, against the reference:
    decode and speculative rows, 1 to 87 keys, pages of 16, poison outside the sequences."""
    if DEV.type != "cpu":
        pytest.skip("a CPU model")
    args, _, _ = _inputs(kv_dtype, hkv, rep, d, [1, 1, 4, 3], [0, 86, 37, 16], block_size=16)
    q, kc, vc, bt, cu, sl, scale, ks, vs, max_q, max_kv = args
    n_splits, split_len = cuda_sm70.split_length(max_kv, splits, cuda_sm70.TILE)
    np_ = (lambda x: None if x is None else x.numpy())
    out = M.decode(q.double().numpy(), np_(kc), np_(vc), np_(ks), np_(vs), bt.numpy(), cu.numpy(), sl.numpy(),
                   scale, max_q, n_splits, split_len)
    _check("decode model", torch.from_numpy(out), args)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float16], ids=["int8", "fp16"])
@pytest.mark.parametrize("hkv,rep,d", [(2, 3, 32), (1, 6, 64)])
@pytest.mark.parametrize("splits,new_kv", [(1, False), (2, True)])
def test_kernel_model_prefill(kv_dtype, hkv, rep, d, splits, new_kv):
    """The prefill kernel (virtual tiles, shared-memory layouts, causal N32 tiles) and combine_splits as
    m884_attention_model transliterates them, against the reference: chunks with and without a prefix beside a decode
    row, pages of 16 and 32; new_kv: the chunk's keys from k_new (fp16 caches: the pages' copies NaN)."""
    if DEV.type != "cpu":
        pytest.skip("a CPU model")
    q_lens, ctx, bs = [45, 9, 1, 12], [0, 50, 20, 33], 32 if new_kv else 16
    args, (k_new, v_new), tables = _inputs(kv_dtype, hkv, rep, d, q_lens, ctx, block_size=bs)
    q, kc, vc, bt, cu, sl, scale, ks, vs, max_q, max_kv = args
    ref = run_reference(K.paged_attention, q, kc, vc, bt, cu, sl, scale, ks, vs)
    kn = vn = None
    if new_kv and kv_dtype == torch.float16:
        slots = slots_for(tables, ctx, [c + n for c, n in zip(ctx, q_lens)], bs)
        kc.view(-1, hkv, d)[slots] = float("nan")
        vc.view(-1, hkv, d)[slots] = float("nan")
        kn, vn = k_new.numpy(), v_new.numpy()
    n_splits, split_len = cuda_sm70.split_length(max_kv, splits, cuda_sm70.TILE)
    np_ = (lambda x: None if x is None else x.numpy())
    out = M.prefill(q.double().numpy(), np_(kc), np_(vc), np_(ks), np_(vs), bt.numpy(), cu.numpy(), sl.numpy(),
                    scale, n_splits, split_len, kn, vn)
    _check("prefill model", torch.from_numpy(out), args, ref)


def _signature(kernel: str) -> list[str]:
    """Parameter names of a __global__ kernel of the .cu, in order."""
    from qv.kernels.cuda_build import KERNEL_DIR

    src = "".join((KERNEL_DIR / s).read_text() for s in (cuda_sm70.DECODE_SOURCE, cuda_sm70.PREFILL_SOURCE))
    params = re.search(rf"\b{kernel}\((.*?)\)\s*{{", src, re.S).group(1)
    return [p.split()[-1].lstrip("*") for p in params.split(",")]


class _FakeKernel:
    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize("case", ["decode", "prefill_new_kv", "prefill_int8"])
def test_host_launches_on_model(monkeypatch, case):
    """cuda_sm70's host side on CPU with each launch run by m884_attention_model instead of the GPU: every argument,
    bound by name from the .cu's signature, names the right tensor or agrees with the tensors' shapes and
    strides; grid, block and shared memory are the kernels'; the combine runs where splits > 1; and the
    op's answer is the reference's. (Default split choices, with num_sms 4 on CPU.)"""
    if DEV.type != "cpu":
        pytest.skip("a CPU model")
    tensors, launched = {}, []

    def pointer(t):
        if t is None:
            return np.uint64(0)
        tensors[t.data_ptr()] = t
        return np.uint64(t.data_ptr())

    def launch(kernel, grid, block, args, device, shared_mem=0):
        base = kernel.name.split("<")[0]
        names = _signature(base)
        assert len(names) == len(args), base
        a = dict(zip(names, args))
        ten = {n: tensors[int(v)] for n, v in a.items() if isinstance(v, np.uint64) and int(v)}
        launched.append((base, grid, a))
        np_ = (lambda n: ten[n].numpy() if n in ten else None)
        if base == "combine_splits":
            part, out = ten["part"], ten["out"]
            assert grid == (part.shape[1], part.shape[2], 1) and block == (64, 1, 1) and a["n_splits"] == part.shape[0]
            assert (a["B"], a["T"], a["HQ"]) == (ten["cu_q"].shape[0] - 1, out.shape[0], out.shape[1])
            assert (a["stride_ot"], a["stride_oh"]) == out.stride()[:2]
            out.copy_(torch.from_numpy(M.combine(np_("part"), np_("lse"), np_("cu_q"), np_("kv_lens"),
                                                 int(a["split_len"]))))
            return
        q, kc, out = ten["q"], ten["kc"], ten["out"]
        assert (a["T"], a["HQ"], a["rep"]) == (q.shape[0], q.shape[1], q.shape[1] // kc.shape[2])
        assert (a["stride_qt"], a["stride_qh"], a["stride_ot"], a["stride_oh"]) == q.stride()[:2] + out.stride()[:2]
        assert (a["stride_kb"], a["stride_ks"], a["stride_kh"]) == kc.stride()[:3] == ten["vc"].stride()[:3]
        if kc.dtype == torch.int8:
            assert (a["stride_sb"], a["stride_ss"]) == ten["ks"].stride()[:2] == ten["vs"].stride()[:2]
        assert a["stride_bt"] == ten["block_tables"].stride(0) and a["bt_cols"] == ten["block_tables"].shape[1]
        assert (1 << int(a["page_shift"]), a["n_pages"]) == (kc.shape[1], kc.shape[0])
        common = (q.double().numpy(), kc.numpy(), np_("vc"), np_("ks"), np_("vs"), np_("block_tables"),
                  np_("cu_q"), np_("kv_lens"), float(a["qk_scale"]))
        n_seq, hkv, splits = ten["cu_q"].shape[0] - 1, kc.shape[2], grid[2]
        if base == "paged_decode_m884":
            assert grid[:2] == (n_seq * a["chunks"], hkv) and block == (128, 1, 1) and shared_mem == 0
            o, p, l = M.decode_kernel(*common, int(a["chunks"]), splits, int(a["split_len"]))
        else:
            assert a["B"] == n_seq and a["bq"] == M.PREFILL_ROWS // a["rep"]
            assert grid[:2] == (q.shape[0] // a["bq"] + n_seq, hkv) and block == (256, 1, 1)
            assert shared_mem == cuda_sm70.prefill_smem_bytes(q.shape[2])
            kn = vn = None
            if a["use_new"]:
                kn, vn = np_("kn"), np_("vn")
                assert (a["stride_nt"], a["stride_nh"]) == ten["kn"].stride()[:2] == ten["vn"].stride()[:2]
            o, p, l = M.prefill_kernel(*common, int(a["bq"]), splits, int(a["split_len"]), kn, vn)
        if splits > 1:
            ten["part"].copy_(torch.from_numpy(p))
            ten["lse"].copy_(torch.from_numpy(l))
        else:
            out.copy_(torch.from_numpy(o))

    monkeypatch.setattr(cuda_sm70, "pointer", pointer)
    monkeypatch.setattr(cuda_sm70, "launch", launch)
    monkeypatch.setattr(cuda_sm70, "unsupported", lambda *a: None)
    monkeypatch.setattr(cuda_sm70, "_kernels", lambda kernels, device, shared_mem=0: [(_FakeKernel(n), 128)
                                                                                      for _, n in kernels])
    kv_dtype, hkv, rep, q_lens, ctx, new_kv = {
        "decode": (torch.int8, 1, 6, [1, 4], [599, 40], False),
        "prefill_new_kv": (torch.float16, 1, 6, [12], [600], True),
        "prefill_int8": (torch.int8, 2, 3, [45, 9, 1], [0, 50, 20], False),
    }[case]
    args, (k_new, v_new), tables = _inputs(kv_dtype, hkv, rep, 32, q_lens, ctx, block_size=16)
    q, kc, vc, bt, cu, sl, scale, ks, vs, max_q, max_kv = args
    ref = run_reference(K.paged_attention, q, kc, vc, bt, cu, sl, scale, ks, vs)
    kw = dict(k_new=k_new, v_new=v_new) if new_kv else {}
    if new_kv:
        slots = slots_for(tables, ctx, [c + n for c, n in zip(ctx, q_lens)], 16)
        kc.view(-1, hkv, 32)[slots] = float("nan")
        vc.view(-1, hkv, 32)[slots] = float("nan")
    with nan_empty():
        out = cuda_sm70.paged_attention(q, kc, vc, bt, cu, sl, scale, ks, vs, max_q, max_kv, **kw)
    _check(case, out, args, ref)
    kinds = [base for base, _, _ in launched]
    splits = launched[0][1][2]
    assert kinds == ([kinds[0], "combine_splits"] if splits > 1 else [kinds[0]])
    assert (splits > 1) == (case != "prefill_int8"), "the cases mean to cover one split and several"
    assert bool(launched[0][2].get("use_new", 0)) == new_kv
