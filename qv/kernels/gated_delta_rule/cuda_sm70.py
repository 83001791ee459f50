"""Gated DeltaNet for Volta (the "sm70" backend). Prefill runs chunked in raw CUDA on the m8n8k4 tensor cores
(gdn_chunk_m884.cu: prep, scan and output kernels over 64-token chunks, fp16 activations, fp32 state),
compiled at first use by NVRTC through CuPy and launched on torch's current stream.

Decode, speculative verification (per-position states) and queries of up to RECURRENT_MAX_LEN tokens run
Triton's token-by-token kernel (triton_recurrent.py: CUDA-core arithmetic, no tl.dot), which also takes every
call the CUDA kernels do not apply to (no CuPy, activations other than fp16, head dims over 128, state pools
other than fp32 / fp16 / int16, a CUDA graph captured before the kernels were built). Never the Triton chunked
kernels: tl.dot has no tensor-core path below sm_80 and has given wrong results there (sglang #7467).
"""

from __future__ import annotations

import numpy as np
import torch

from qv.kernels.cuda_build import KernelBuild, cupy_or_none, kernel_for, launch, pointer
from qv.kernels.gated_delta_rule.configs import RECURRENT_MAX_LEN
from qv.kernels.gated_delta_rule.triton_recurrent import gdn_recurrent

SOURCE = "gated_delta_rule/gdn_chunk_m884.cu"  # under qv/kernels (cuda_build.KERNEL_DIR)
BT = 64  # tokens a chunk (the .cu's BT)
BV = 32  # state columns a scan program: 42 KB of shared memory at dk 128, under the 48 KB static limit
KEY_TILES = (16, 32, 64, 128)  # dk padded to one of these
_STATE_KINDS = {torch.float32: 0, torch.float16: 1, torch.int16: 2}  # the .cu's STATE_F32, _F16, _I16


def kernel_names(bk: int) -> tuple[str, str, str]:
    """The prep, scan and output instantiations for k's head dim padded to bk."""
    return f"gdn_prep_m884<{bk}>", f"gdn_scan_m884<{bk}, {BV}>", f"gdn_out_m884<{bk}, {BV}>"


BUILDS: tuple[KernelBuild, ...] = (
    KernelBuild(SOURCE, tuple(name for bk in KEY_TILES for name in kernel_names(bk)), tensor_cores=True),
)


def key_tile(dk: int) -> int | None:
    return next((bk for bk in KEY_TILES if dk <= bk), None)


def gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state,
                     scale=None, state_scale=None, intermediate_states=None, max_query_len=None):
    """The op (arguments as in __init__.py): the CUDA chunked kernels for prefill, where they apply; the
    token-by-token kernel otherwise (also when max_query_len is unknown the chunked path runs: no host sync)."""
    scale = q.shape[2] ** -0.5 if scale is None else scale
    if state.stride(-1) != 1:
        raise ValueError("gated_delta_rule: the state pool needs a unit inner stride")
    short = max_query_len is not None and max_query_len <= RECURRENT_MAX_LEN
    if intermediate_states is None and not short:
        out = gdn_chunked_cuda(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state,
                               scale, state_scale)
        if out is not None:
            return out
    return token_by_token(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state, scale,
                          state_scale, intermediate_states, max_query_len == 1)


def token_by_token(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state, scale,
                   state_scale, intermediate_states, one_token):
    """Triton's gdn_recurrent (no tl.dot) on the layouts it reads: q and k with equal strides, unit inner
    strides."""
    if q.stride() != k.stride() or q.stride(-1) != 1:
        q, k = q.contiguous(), k.contiguous()
    v, a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (v, a, b))
    return gdn_recurrent(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state, scale,
                         state_scale, intermediate_states, one_token=one_token)


def chunked_applies(q, k, v, a, b, state, state_scale) -> bool:
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 7 and cupy_or_none() is not None
            and key_tile(q.shape[2]) is not None and all(x.dtype == torch.float16 for x in (q, k, v, a, b))
            and state.dtype in _STATE_KINDS
            and (state.dtype != torch.int16 or (state_scale.dtype == torch.float32 and state_scale.stride(-1) == 1)))


def gdn_chunked_cuda(q, k, v, a, b, A_log, dt_bias, state, cu_seqlens, state_slots, has_initial_state, scale,
                     state_scale):
    """The op through the three CUDA kernels; None (nothing launched, the state untouched) where they do not
    apply or did not build."""
    if not chunked_applies(q, k, v, a, b, state, state_scale):
        return None
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    n_seq = cu_seqlens.shape[0] - 1
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if n_seq == 0:
        return out
    bk = key_tile(dk)
    built = [kernel_for(SOURCE, name, q.device, k.nbytes + v.nbytes, {}) for name in kernel_names(bk)]
    if any(x is None for x in built):
        return None
    prep, scan, output = (kernel for kernel, _ in built)
    q, k, v, a, b = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, a, b))
    cu = cu_seqlens.to(torch.int32)
    slots = state_slots.to(torch.int64)
    init = has_initial_state.to(torch.uint8)
    a_log, dtb = A_log.float().contiguous(), dt_bias.float().contiguous()
    dv_pad = -(-dv // BV) * BV
    n_tiles = t // BT + n_seq  # virtual chunk tiles: sequence i owns cu[i] // BT + i, ...
    dev = q.device
    tb = torch.empty((t, hv, BT), dtype=torch.float16, device=dev)
    gc = torch.empty((t, hv), dtype=torch.float32, device=dev)
    rk = torch.empty((t, hv), dtype=torch.float32, device=dev)
    vnew = torch.empty((t, hv, dv_pad), dtype=torch.float16, device=dev)
    h_all = torch.empty((n_tiles, hv, bk, dv_pad), dtype=torch.float16, device=dev)
    i32, i64 = np.int32, np.int64
    common = (i32(hv), i32(hv // hk), i32(dk))
    if t:
        launch(prep, (n_tiles, hv, 1), (128, 1, 1),
               (pointer(k), pointer(a), pointer(b), pointer(a_log), pointer(dtb), pointer(cu), pointer(tb),
                pointer(gc), pointer(rk), i32(n_seq), *common, i64(k.stride(0)), i64(k.stride(1)),
                i64(a.stride(0)), i64(b.stride(0))), dev)
    int16 = state.dtype == torch.int16
    sc = state_scale if int16 else None
    launch(scan, (n_seq, hv, dv_pad // BV), (128, 1, 1),
           (pointer(k), pointer(v), pointer(tb), pointer(gc), pointer(rk), pointer(vnew), pointer(h_all),
            pointer(state), pointer(sc), pointer(cu), pointer(slots), pointer(init), *common, i32(dv), i32(dv_pad),
            i64(k.stride(0)), i64(k.stride(1)), i64(v.stride(0)), i64(v.stride(1)), i64(state.stride(0)),
            i64(state.stride(1)), i64(state.stride(2)), i64(sc.stride(0) if int16 else 0),
            i64(sc.stride(1) if int16 else 0), i32(_STATE_KINDS[state.dtype])), dev)
    if t:
        launch(output, (n_tiles, hv, 1), (128, 1, 1),
               (pointer(q), pointer(k), pointer(vnew), pointer(h_all), pointer(gc), pointer(rk), pointer(out),
                pointer(cu), i32(n_seq), *common, i32(dv), i32(dv_pad), np.float32(scale), i64(q.stride(0)),
                i64(q.stride(1)), i64(k.stride(0)), i64(k.stride(1)), i64(out.stride(0)), i64(out.stride(1))), dev)
    return out
