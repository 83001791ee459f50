"""paged_attention against the fp32 reference: prefill chunks over cached prefixes (FMHA path),
decode and speculative rows (split-K + reduce path), GQA 1/2/3/6, head dims incl. non powers of
two, contexts not multiples of the block, empty and single-token sequences; fp32/fp16/bf16 and
int8 caches (the reference dequantizes the same int8 cache, so the kernel bound is the
activation dtype's). A separate test bounds the int8 format error itself."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import BOUND, DEV, K, cu_seqlens, paged_layout, randn, run_reference, run_triton, slots_for
from qv.kernels.paged_attention.triton import paged_attention as paged_attention_triton
from util import assert_close, rel_err

INT8_FORMAT_BOUND = 2e-2  # int8 K/V (scale per token and head) vs unquantized, random normal data


def _cache(act_dtype, kv_dtype, hkv, d, seq_lens, block_size, bt_tables, nb):
    """A cache holding every sequence's keys (written by the reference write_kv)."""
    n = sum(seq_lens)
    k, v = randn(n, hkv, d, dtype=act_dtype), randn(n, hkv, d, dtype=act_dtype)
    shape = (nb, block_size, hkv, d)
    kc = torch.zeros(shape, dtype=kv_dtype, device=DEV)
    vc = torch.zeros(shape, dtype=kv_dtype, device=DEV)
    ks = vs = None
    if kv_dtype == torch.int8:
        ks = torch.zeros(shape[:3], device=DEV)
        vs = torch.zeros(shape[:3], device=DEV)
    run_reference(K.write_kv, k, v, kc, vc, slots_for(bt_tables, [0] * len(seq_lens), seq_lens, block_size), ks, vs)
    return kc, vc, ks, vs, k, v


def _case(act_dtype, kv_dtype, hkv, rep, d, q_lens, ctx, block_size=16, bound=None, new_kv=False, config=None,
          max_seq_slack=0, reruns=0, same_bits_as=None):
    """config: kernel settings (through paged_attention_triton, e.g. a forced split count).
    max_seq_slack: max_seq_len passed this much above the longest sequence (an upper bound, as under
    CUDA-graph capture). reruns: that many more calls must each give the same bits; same_bits_as: a
    config whose call must give the same bits too.
    new_kv: also pass the chunk's own K/V (k_new/v_new) and poison those positions in the cache
    with NaN afterwards (where they are read from k_new), so a kernel reading them from the pages fails."""
    seq_lens = [c + q for q, c in zip(q_lens, ctx)]
    bt, tables, nb = paged_layout(seq_lens, block_size)
    kc, vc, ks, vs, k, v = _cache(act_dtype, kv_dtype, hkv, d, seq_lens, block_size, tables, nb)
    q = randn(sum(q_lens), hkv * rep, d, dtype=act_dtype)
    args = (q, kc, vc, bt, cu_seqlens(q_lens), torch.tensor(seq_lens, dtype=torch.int32, device=DEV), d ** -0.5,
            ks, vs, max(q_lens), max(seq_lens) + max_seq_slack)
    ref = run_reference(K.paged_attention, *args)
    kw = {}
    if new_kv:
        starts = [0] + torch.tensor(seq_lens).cumsum(0).tolist()[:-1]
        rows = torch.cat([torch.arange(s + c, s + c + n) for s, c, n in zip(starts, ctx, q_lens)]).to(DEV)
        kw = dict(k_new=k[rows], v_new=v[rows])
        if kv_dtype != torch.int8:
            new_slots = slots_for(tables, ctx, seq_lens, block_size)
            kc.view(-1, hkv, d)[new_slots] = float("nan")
            vc.view(-1, hkv, d)[new_slots] = float("nan")
    if config is None:
        out = run_triton(K.paged_attention, *args, **kw)
    else:
        out = run_triton(paged_attention_triton, *args, **kw, config=config)
    err = assert_close("paged_attention", out, ref, bound or BOUND[act_dtype])
    for i in range(reruns):
        again = run_triton(paged_attention_triton, *args, **kw, config=config)
        assert torch.equal(again, out), f"paged_attention: call {i + 2} gave other bits ({rel_err(again, out):.1e})"
    if same_bits_as is not None:
        other = run_triton(paged_attention_triton, *args, **kw, config=same_bits_as)
        assert torch.equal(other, out), f"paged_attention: config {same_bits_as} gave other bits ({rel_err(other, out):.1e})"
    return err


@pytest.mark.parametrize("act_dtype,kv_dtype,rep,d,q_lens,ctx", [
    (torch.float32, torch.float32, 3, 32, [5, 0, 17, 1], [0, 3, 20, 40]),  # prefill path, empty seq
    (torch.float32, torch.float32, 1, 64, [1, 1, 1], [30, 70, 5]),  # decode, split-K
    (torch.float32, torch.int8, 6, 16, [3, 2], [50, 33]),  # speculative rows over int8
    (torch.bfloat16, torch.bfloat16, 2, 48, [9, 30], [0, 10]),  # head dim 48 (masked to 64)
    (torch.bfloat16, torch.int8, 6, 64, [9, 1], [0, 60]),
    (torch.float16, torch.float16, 3, 128, [20, 1], [13, 37]),
    (torch.float32, torch.float32, 1, 256, [4], [21]),
])
def test_paged_attention(act_dtype, kv_dtype, rep, d, q_lens, ctx):
    _case(act_dtype, kv_dtype, 2, rep, d, q_lens, ctx)


@pytest.mark.parametrize("act_dtype,kv_dtype,rep,d,q_lens,ctx,config", [
    (torch.float32, torch.float32, 3, 32, [5, 0, 17, 1, 40], [0, 3, 20, 40, 37], None),  # prefix tile boundaries
    (torch.bfloat16, torch.bfloat16, 6, 64, [33, 18], [16, 0], None),
    (torch.bfloat16, torch.int8, 6, 64, [20, 9], [5, 0], None),  # int8 cache: k_new ignored, pages read
    # split-K over the keys: split boundaries fall inside the new keys' tiles (which start at the prefix)
    (torch.float32, torch.float32, 1, 32, [40, 9, 23], [7, 50, 0], dict(splits=3)),
    (torch.bfloat16, torch.bfloat16, 3, 64, [30, 17], [21, 5], dict(splits=4)),
])
def test_paged_attention_new_kv(act_dtype, kv_dtype, rep, d, q_lens, ctx, config):
    """Prefill chunks reading their own keys from k_new/v_new: the new positions of the cache hold NaN."""
    _case(act_dtype, kv_dtype, 2, rep, d, q_lens, ctx, new_kv=True, config=config)


# paged_decode_kernel variants (kind="split": config= of _decode_attention, swept on the GPU by bench/kernels.py):
# forced split counts so the interpreter's tiny grid still crosses split, tile and page boundaries
DECODE_VARIANTS = [None] + [dict(kind="split", **c) for c in (dict(splits=5), dict(splits=5, stages=5),
                                                               dict(BLOCK_N=32, splits=3, stages=4),
                                                               dict(waves=24, stages=5, maxnreg=168))]


@pytest.mark.parametrize("config", DECODE_VARIANTS, ids=str)
@pytest.mark.parametrize("act_dtype,kv_dtype,rep,q_lens,ctx", [
    (torch.bfloat16, torch.int8, 6, [1, 1, 1], [90, 37, 0]),  # batch 3, odd lengths, a one-key sequence
    (torch.float16, torch.int8, 3, [4, 1, 2], [61, 100, 9]),  # speculative rows (k = 3, 0, 1)
    (torch.bfloat16, torch.bfloat16, 1, [1, 1], [101, 40]),  # GQA 1, 16-bit cache
])
def test_paged_decode_variants(config, act_dtype, kv_dtype, rep, q_lens, ctx):
    """Each decode variant against the reference (output poisoned with NaN first); a second call gives
    the same bits (the reduce merges the splits in a fixed order)."""
    _case(act_dtype, kv_dtype, 2, rep, 64, q_lens, ctx, config=config, max_seq_slack=5, reruns=1)


def test_int8_kv_format_error():
    """Attention over int8 K/V vs over the unquantized K/V (both exact fp32 reference)."""
    hkv, rep, d, bs = 2, 3, 64, 16
    q_lens, seq_lens = [1, 7], [90, 130]
    bt, tables, nb = paged_layout(seq_lens, bs)
    torch.manual_seed(1)
    kc8, vc8, ks, vs, k, v = _cache(torch.float32, torch.int8, hkv, d, seq_lens, bs, tables, nb)
    kc, vc = torch.zeros_like(kc8, dtype=torch.float32), torch.zeros_like(vc8, dtype=torch.float32)
    run_reference(K.write_kv, k, v, kc, vc, slots_for(tables, [0, 0], seq_lens, bs))
    q = randn(sum(q_lens), hkv * rep, d)
    common = (bt, cu_seqlens(q_lens), torch.tensor(seq_lens, dtype=torch.int32, device=DEV), d ** -0.5)
    exact = run_reference(K.paged_attention, q, kc, vc, *common)
    quant = run_triton(K.paged_attention, q, kc8, vc8, *common, ks, vs, max(q_lens), max(seq_lens))
    err = rel_err(quant, exact)
    assert 1e-4 < err < INT8_FORMAT_BOUND, f"int8 KV format error {err:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("act_dtype,kv_dtype", [(torch.bfloat16, torch.int8), (torch.bfloat16, torch.bfloat16),
                                                (torch.float16, torch.int8), (torch.float32, torch.float32)])
@pytest.mark.parametrize("rep,d", [(6, 256), (3, 128), (1, 64)])
def test_paged_attention_real_shapes(act_dtype, kv_dtype, rep, d):
    hkv = 4 if rep == 6 else 2
    _case(act_dtype, kv_dtype, hkv, rep, d, [1000, 777, 1, 0], [500, 0, 3000, 5])  # prefill over prefixes
    _case(act_dtype, kv_dtype, hkv, rep, d, [1000, 777, 9, 0], [500, 0, 3000, 5], new_kv=True)  # new keys from k_new
    _case(act_dtype, kv_dtype, hkv, rep, d, [1] * 16, [9000 - 555 * i for i in range(16)])  # decode batch
    _case(act_dtype, kv_dtype, hkv, rep, d, [4, 4, 4], [33000, 17, 4100])  # speculative rows (k=3)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("q_lens,ctx", [([96], [0]), ([160, 100], [0, 37]), ([255, 65, 1], [300, 0, 40])])
def test_prefill_chunks_under_the_cudnn_threshold_real_shapes(kv_dtype, q_lens, ctx):
    """Chunks of 65-255 rows (several key tiles each) at the 27B's heads take the Triton kernel below cuDNN's
    threshold. With a 16-bit cache the chunk's keys come from k_new: by plain loads (the default), and by TMA
    bulk copies in the pipelined loops where config asks (sm_90+). Each within the reference's bound and the
    same bits on 50 more calls, the two the same bits: a race in the pipelined copies shows as other bits on
    some call (the piecewise graphs' start-up check at 64 layers failed only with a 16-bit cache, at sizes of
    more than one key tile, while the default was TMA)."""
    _case(torch.bfloat16, kv_dtype, 4, 6, 256, q_lens, ctx, new_kv=True, config={}, reruns=50)
    if torch.cuda.get_device_capability()[0] >= 9:
        _case(torch.bfloat16, kv_dtype, 4, 6, 256, q_lens, ctx, new_kv=True, config={"tma": True}, reruns=50,
              same_bits_as={})


def _attention_with_lse(q, k, v, scale, causal):
    """fp32 stand-in for torch's cuDNN attention on the CPU: (out [L, Hq, D], natural-log lse [Hq, L])."""
    rep = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = torch.einsum("lhd,shd->hls", q.float(), kf) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("hls,shd->lhd", torch.exp(s - lse[..., None]), vf)
    return out.to(q.dtype), lse


@pytest.fixture
def cudnn_or_stand_in(monkeypatch):
    """On the GPU torch's cuDNN attention itself; on the CPU the fp32 stand-in above, so the gather of pages into
    pieces, the pieces' spans and the log-sum-exp merge run here too."""
    from qv.kernels.paged_attention import sdpa_prefill

    if DEV.type == "cpu":
        monkeypatch.setattr(sdpa_prefill, "cudnn_attention", _attention_with_lse)
    elif not sdpa_prefill.available(DEV):
        pytest.skip("torch's cuDNN attention does not run on this GPU")


@pytest.mark.parametrize("act_dtype,kv_dtype,q_lens,ctx,config", [
    # one long chunk: prefix keys in pieces of 32 (grain 16), the last 5 prefix keys in the causal call behind 5
    # discarded rows, 75 rows padded to 80
    (torch.bfloat16, torch.int8, [70], [101], dict(min_rows=16, piece_tokens=32, grain=16, bucket=8)),
    # decodes and short chunks around two long chunks: the short runs go to the Triton kernels
    (torch.bfloat16, torch.int8, [1, 40, 3, 1, 33, 2], [50, 9, 0, 17, 60, 5],
     dict(min_rows=16, piece_tokens=48, grain=16, bucket=16)),
    # a 16-bit cache: the chunk's own keys from k_new (their pages hold NaN), no whole grain of prefix
    (torch.float16, torch.float16, [37, 20], [0, 30], dict(min_rows=30, piece_tokens=16, grain=16, bucket=8)),
    (torch.bfloat16, torch.bfloat16, [24], [40], dict(min_rows=16, piece_tokens=1024, grain=8, bucket=32)),
    (torch.bfloat16, torch.int8, [19], [64], dict(min_rows=16, piece_tokens=64, grain=16, bucket=1)),  # one piece
    # 7 grains of prefix with pieces of 4: spans of 4, 2 and 1 grains, merged in fp32
    (torch.bfloat16, torch.int8, [20], [137], dict(min_rows=16, piece_tokens=64, grain=16, bucket=8)),
])
def test_paged_attention_cudnn_prefill(cudnn_or_stand_in, act_dtype, kv_dtype, q_lens, ctx, config):
    """Long chunks through cuDNN over pieces of the cache dequantized to a workspace, against the fp32
    reference over the same cache; the output starts poisoned."""
    torch.manual_seed(5)
    _case(act_dtype, kv_dtype, 2, 3, 64, q_lens, ctx, new_kv=True, config=dict(prefill="cudnn", **config))


def test_key_pieces_cover_the_prefix_in_few_sizes():
    """Every prefix of up to 200 grains is covered once, in order, by pieces whose sizes come from
    key_piece_sizes (6 sizes for the 27B's 32K pieces of 1,024-key grains, against 32 with pieces of any size)."""
    from qv.kernels.paged_attention import sdpa_prefill

    for piece_tokens, grain in ((32768, 1024), (48, 16), (64, 16), (16, 16)):
        sizes = set(sdpa_prefill.key_piece_sizes(piece_tokens, grain))
        seen = set()
        for whole in range(0, 200 * grain, grain):
            spans = sdpa_prefill.key_pieces(whole, piece_tokens, grain)
            bounds = [0] + [b for _, b in spans]
            assert [(a, b) for a, b in spans] == list(zip(bounds, bounds[1:])) and bounds[-1] == whole
            seen |= {b - a for a, b in spans}
            assert max((b - a for a, b in spans), default=0) <= max(piece_tokens // grain * grain, grain)
        assert seen == sizes, (piece_tokens, grain)
    assert len(sdpa_prefill.key_piece_sizes(32768)) == 6


def test_warm_plans_cover_every_shape_a_chunk_meets(monkeypatch):
    """Every cuDNN call chunk_attention makes for chunks of min_rows .. chunk_rows rows over any prefix (small grains
    and buckets, so all cases run) has a shape warm_plans planned: no plan is built, and no host memory is added, after
    start-up. The kernels around the calls are replaced by recorders (only shapes are checked)."""
    from qv.kernels.paged_attention import sdpa_prefill

    grain, bucket, piece_tokens, min_rows, chunk_rows, hq, hkv, d = 16, 8, 64, 20, 100, 2, 1, 4
    shapes = []
    monkeypatch.setattr(sdpa_prefill, "cudnn_attention", lambda q, k, v, scale, causal: (
        shapes.append((q.shape[0], k.shape[0], causal)) or (torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0]))))
    monkeypatch.setattr(sdpa_prefill, "gather_kv", lambda *a: None)
    monkeypatch.setattr(sdpa_prefill, "merge", lambda a, la, b, lb, out, want_lse: la)
    planned = sdpa_prefill.warm_plans(torch.device("cpu"), torch.float32, hq, hkv, d, chunk_rows, piece_tokens, False,
                                      min_rows, grain, bucket)
    warm = set(shapes)
    calls = 1 + len(sdpa_prefill.key_piece_sizes(piece_tokens, grain))  # a row count's causal call and its pieces
    assert planned == len(warm) == len(sdpa_prefill.row_counts(chunk_rows, min_rows, grain, bucket)) * calls
    shapes.clear()
    cache = torch.zeros(1, 16, hkv, d)
    for length in range(min_rows, chunk_rows + 1):
        for prefix in range(0, 7 * grain + 1, 3):
            q = torch.zeros(length, hq, d)
            sdpa_prefill.chunk_attention(q, cache, cache, None, None, None, prefix + length, 1.0, torch.empty_like(q),
                                         piece_tokens, grain=grain, bucket=bucket)
    assert set(shapes) <= warm and {r for r, _, _ in shapes} == {r for r, _, _ in warm}


@pytest.mark.gpu
def test_paged_attention_cudnn_real_shapes(cudnn_or_stand_in):
    """27B heads (24 query, 4 KV, d 256), an int8 cache: a 700-row chunk over 3,000 cached keys (two 1,024-key
    pieces, 952 in the causal call) beside a decode, and a 16-bit cache."""
    torch.manual_seed(6)
    _case(torch.bfloat16, torch.int8, 4, 6, 256, [700, 1], [3000, 500], new_kv=True,
          config=dict(prefill="cudnn", piece_tokens=1024))
    _case(torch.bfloat16, torch.bfloat16, 4, 6, 256, [300], [5000], new_kv=True, config=dict(prefill="cudnn"))
