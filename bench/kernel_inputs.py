"""Random inputs at Qwen3.5-27B layer shapes for bench/kernels.py (never zeros: they run faster)."""

from __future__ import annotations

import torch

from qv.kernels.linear import GPTQWeight

HQ, HKV, D = 24, 4, 256  # full attention
HK, HV, DK = 16, 48, 128  # Gated DeltaNet
BS = 16  # KV block size


def _paged(n_tokens_per_seq: int, batch: int, dev, dtype):
    """K/V caches holding `batch` sequences of n tokens in shuffled blocks, and their block tables."""
    per = (n_tokens_per_seq + BS - 1) // BS
    nb = per * batch + 1
    shape = (nb, BS, HKV, D)
    if dtype == torch.int8:
        kc = torch.randint(-127, 128, shape, dtype=torch.int8, device=dev)
        vc = torch.randint(-127, 128, shape, dtype=torch.int8, device=dev)
        ks = torch.rand(shape[:3], device=dev) * 0.02
        vs = torch.rand(shape[:3], device=dev) * 0.02
    else:
        kc, vc = torch.randn(shape, device=dev, dtype=dtype), torch.randn(shape, device=dev, dtype=dtype)
        ks = vs = None
    bt = torch.randperm(nb - 1, device=dev)[:per * batch].view(batch, per).to(torch.int32)
    return kc, vc, ks, vs, bt


def attention_inputs(n: int, dev):
    q = torch.randn(n, HQ, D, device=dev, dtype=torch.bfloat16)
    kc, vc, _, _, bt = _paged(n, 1, dev, torch.bfloat16)
    cu = torch.tensor([0, n], dtype=torch.int32, device=dev)
    sl = torch.tensor([n], dtype=torch.int32, device=dev)
    # SDPA peer: the same keys as dense [1, H, n, D]
    pos = torch.arange(n, device=dev)
    rows = bt[0, pos // BS].long() * BS + pos % BS
    k_new, v_new = kc.view(-1, HKV, D)[rows], vc.view(-1, HKV, D)[rows]  # [n, HKV, D]: what write_kv was given
    k, v = k_new.transpose(0, 1)[None].contiguous(), v_new.transpose(0, 1)[None].contiguous()
    # the engine's call: the cache plus the chunk's own K/V (read contiguously by the prefill kernel)
    return dict(paged=(q, kc, vc, bt, cu, sl, D ** -0.5, None, None, n, n, k_new, v_new),
                sdpa=(q.transpose(0, 1)[None].contiguous(), k, v))


def decode_inputs(ctx: int, batch: int, dev, q_len: int = 1):
    """`batch` sequences of `ctx` cached keys, each with q_len query tokens (> 1: speculative rows)."""
    kc, vc, ks, vs, bt = _paged(ctx, batch, dev, torch.int8)
    q = torch.randn(batch * q_len, HQ, D, device=dev, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=dev) * q_len
    sl = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    return (q, kc, vc, bt, cu, sl, D ** -0.5, ks, vs, q_len, ctx)


GDN_INDEX_ARGS = slice(8, 11)  # cu_seqlens, slots, has_initial_state in gdn_inputs(...)["ours"]


def gdn_inputs(n: int, batch: int, dev, dtype, state_dtype=torch.float32):
    """`batch` sequences of n tokens; ours: args without max_query_len; fla: [B, T, H, D] tensors."""
    t = n * batch
    q = torch.randn(t, HK, DK, device=dev, dtype=dtype)
    k = torch.randn(t, HK, DK, device=dev, dtype=dtype)
    v = torch.randn(t, HV, DK, device=dev, dtype=dtype)
    a = torch.randn(t, HV, device=dev, dtype=dtype)
    b = torch.randn(t, HV, device=dev, dtype=dtype)
    A_log = torch.rand(HV, device=dev) * 2 - 1
    dt_bias = torch.rand(HV, device=dev)
    h = torch.randn(batch, HV, DK, DK, device=dev) * 0.05
    scale = None
    if state_dtype == torch.int16:
        scale = h.abs().amax(2) / 32767.0
        state = torch.round(h / scale[:, :, None, :]).to(torch.int16)
    else:
        state = h.to(state_dtype)
    cu = torch.arange(0, t + 1, n, dtype=torch.int32, device=dev)
    slots = torch.arange(batch, device=dev)
    init = torch.full((batch,), n == 1, dtype=torch.bool, device=dev)
    ours = (q, k, v, a, b, A_log, dt_bias, state, cu, slots, init, None, scale, None)
    shape = lambda x: x.view(batch, n, *x.shape[1:])  # noqa: E731
    fla = (shape(q), shape(k), shape(v), shape(a), shape(b), A_log, dt_bias, h if n == 1 else None)
    return dict(ours=ours, fla=fla)


def gptq_inputs(k: int, n: int, m: int, dev):
    w = GPTQWeight(torch.randint(0, 256, (k, n), dtype=torch.uint8, device=dev),
                   (torch.rand(k // 128, n, device=dev) * 0.002 + 1e-4).half(), None,
                   torch.arange(k, dtype=torch.int32, device=dev) // 128, 128)
    x = torch.randn(m, k, device=dev, dtype=torch.float16)
    return w, x
