"""A NumPy model of qv/kernels/paged_attention/paged_{decode,prefill}_m884.cu, for CPU tests: the PTX ISA's m8n8k4
fragment layouts (mma884), and the kernels transliterated line by line at warp level (arrays over the 32
lanes, shuffles as lane permutations, shared memory as arrays indexed by the kernels' own formulas). It
checks the kernels' index arithmetic (which key, head dim, row, page, split and smem slot each lane uses)
against the fp32 reference; it cannot see C++ typos the transliteration does not share, nor timing.

Loads the kernels predicate off (keys past k_end) read zeros here as there, so NaN poison in unused pages
reaches the output exactly where a kernel would read it."""

from __future__ import annotations

import numpy as np

L = np.arange(32)
T, QP, HI = L & 3, (L >> 2) & 3, L >> 4
ROW_A = (L & 1) + 4 * HI
TILE, P_STRIDE, DECODE_WARPS, PREFILL_WARPS = 32, 40, 4, 8
PREFILL_ROWS = 8 * PREFILL_WARPS


def c_pos(lane, i):
    """(row, column) of accumulator element c_i of `lane` in its quad pair's 8x8 (.f32)."""
    return (lane & 1) + (i & 2) + 4 * (lane >> 4), (i & 4) + (lane & 2) + (i & 1)


_I4, _I8 = np.arange(4)[None, :], np.arange(8)[None, :]
_CR, _CC = c_pos(L[:, None], _I8)


def mma884(d, a, b, b_row: bool):
    """d [32, 8] += A B per quad pair (A row-major from a [32, 4]; B row- or column-major from b [32, 4])."""
    A = np.zeros((4, 8, 4))
    B = np.zeros((4, 4, 8))
    C = np.zeros((4, 8, 8))
    qp = QP[:, None]
    A[qp, (T + 4 * HI)[:, None], _I4] = a
    if b_row:
        B[qp, T[:, None], _I4 + 4 * HI[:, None]] = b
    else:
        B[qp, _I4, (T + 4 * HI)[:, None]] = b
    C[qp, _CR, _CC] = d
    D = A @ B + C
    d[:] = D[qp, _CR, _CC]


def key_of(i, lane=L):
    return 8 * ((lane >> 2) & 3) + (i & 4) + (lane & 2) + (i & 1)


def key_slot(i):
    return 2 * (i >> 2) + (i & 1)


def decode_dim(d, j, i, lane=L):
    return (2 * ((lane >> 2) & 3) + (i >> 2)) * (d // 8) + 4 * j + (lane & 2) + (i & 1)


def prefill_dim(j, i, lane=L):
    return 32 * j + 8 * ((lane >> 2) & 3) + 4 * (i >> 2) + (lane & 2) + (i & 1)


def v_granule(d, g, key):
    return g ^ (((key & 1) | ((key & 2) << 2)) & (d // 4 - 1))


def h16(x):
    return np.asarray(x, dtype=np.float64).astype(np.float16).astype(np.float64)


def _shfl_xor_max(x):
    for m in (2, 4, 8):
        x = np.maximum(x, x[L ^ m])
    return x


def softmax_step(s, kscale, vscale, k0, k_end, qpos, qk_scale, acc, m_run, l_run, p_tile):
    with np.errstate(invalid="ignore"):
        for i in range(8):
            key = k0 + key_of(i)
            seen = (key < k_end) & (key <= qpos[:, (i >> 1) & 1])
            s[:, i] = np.where(seen, s[:, i] * kscale[:, key_slot(i)] * qk_scale, -np.inf)
    alpha = np.zeros((32, 2))
    for e in range(2):
        mx = _shfl_xor_max(np.max(s[:, [2 * e, 2 * e + 1, 2 * e + 4, 2 * e + 5]], axis=1))
        m_new = np.maximum(m_run[:, e], mx)
        m_use = np.where(m_new == -np.inf, 0.0, m_new)
        alpha[:, e] = np.exp2(m_run[:, e] - m_use)
        for c in range(4):
            i = 2 * e + (c & 1) + 4 * (c >> 1)
            s[:, i] = np.exp2(s[:, i] - m_use)
        l_run[:, e] = l_run[:, e] * alpha[:, e] + (s[:, 2 * e] + s[:, 2 * e + 1]) + (s[:, 2 * e + 4] + s[:, 2 * e + 5])
        m_run[:, e] = m_new
    for i in range(8):
        acc[:, :, i] *= alpha[None, :, (i >> 1) & 1]
    for i in range(8):
        p_tile[ROW_A + (i & 2), key_of(i)] = h16(s[:, i] * vscale[:, key_slot(i)])


def _lanes_sum(x):
    for m in (2, 4, 8):
        x = x + x[L ^ m]
    return x


def _page(bt_row, pos, shift, n_pages):
    return np.clip(bt_row[np.minimum(pos >> shift, bt_row.shape[0] - 1)], 0, n_pages - 1)


def _row(cache, page, off, kvh, valid, lo, hi):
    """Elements lo .. hi of the cache rows (page, off, kvh) as float64 (codes for int8), zeros where !valid."""
    rows = cache[np.where(valid, page, 0), np.where(valid, off, 0), kvh, lo:hi].astype(np.float64)
    return np.where(valid[:, None], rows, 0.0)


def decode(q, kc, vc, ks, vs, bt, cu_q, kv_lens, scale, max_q, splits, split_len):
    """paged_decode_m884 over its grid, then combine_splits when splits > 1: the fp16-rounded output."""
    rep = q.shape[1] // kc.shape[2]
    out, part, lse = decode_kernel(q, kc, vc, ks, vs, bt, cu_q, kv_lens, scale * 1.4426950408889634,
                                   -(-max_q * rep // 8), splits, split_len)
    return combine(part, lse, cu_q, kv_lens, split_len) if splits > 1 else out


def decode_kernel(q, kc, vc, ks, vs, bt, cu_q, kv_lens, qk, chunks, splits, split_len):
    """paged_decode_m884 over the grid (n_seq * chunks, HKV, splits): (out, partials, lse), NaN where unwritten."""
    t_all, hq, d = q.shape
    n_pages, bs, hkv, _ = kc.shape
    rep, n_seq, int8, nj = hq // hkv, cu_q.shape[0] - 1, kc.dtype == np.int8, d // 32
    shift, mask = bs.bit_length() - 1, bs - 1
    out = np.full(q.shape, np.nan)
    part = np.full((splits, t_all, hq, d), np.nan)
    lse = np.full((splits, t_all, hq), np.nan)
    for bx in range(n_seq * chunks):
        for kvh in range(hkv):
            for split in range(splits):
                b, r0 = bx // chunks, 8 * (bx % chunks)
                q_start, q_len, kv_len = cu_q[b], cu_q[b + 1] - cu_q[b], kv_lens[b]
                k_lo = split * split_len
                k_end = min(kv_len, k_lo + split_len)
                rows = min(8, q_len * rep - r0)
                if rows <= 0 or k_lo >= k_end:
                    continue
                s_q = np.zeros((8, d))
                for r in range(rows):
                    row = r0 + r
                    s_q[r] = q[q_start + row // rep, kvh * rep + row % rep]
                qpos = np.stack([np.where(ROW_A + 2 * e < rows, kv_len - q_len + (r0 + ROW_A + 2 * e) // rep, -1)
                                 for e in range(2)], axis=1)
                n_tiles = -(-(k_end - k_lo) // TILE)
                s_m, s_l = np.zeros((DECODE_WARPS, 8)), np.zeros((DECODE_WARPS, 8))
                accs = []
                for warp in range(DECODE_WARPS):
                    acc, m_run, l_run = np.zeros((nj, 32, 8)), np.full((32, 2), -np.inf), np.zeros((32, 2))
                    p_tile = np.full((8, P_STRIDE), np.nan)
                    for tile in range(warp, n_tiles, DECODE_WARPS):
                        k0 = k_lo + TILE * tile
                        key = k0 + L
                        valid = key < k_end
                        page = np.where(valid, _page(bt[b], key, shift, n_pages), 0)
                        k_sc = np.where(valid, ks[page, key & mask, kvh], 0.0) if int8 else None
                        v_sc = np.where(valid, vs[page, key & mask, kvh], 0.0) if int8 else None
                        src = 8 * QP + T + 4 * HI
                        kw = _row(kc, page[src], key[src] & mask, kvh, valid[src], 0, d)
                        vw = []
                        lo_v = (2 * QP + HI) * (d // 8)  # this lane's eighth of a value row
                        for kstep in range(TILE // 4):
                            src_v = 4 * kstep + T
                            rows_v = _row(vc, page[src_v], key[src_v] & mask, kvh, valid[src_v], 0, d)
                            vw.append(rows_v[L[:, None], lo_v[:, None] + np.arange(d // 8)[None, :]])
                        kscale = np.ones((32, 4))
                        vscale = np.ones((32, 4))
                        if int8:
                            for c in range(4):
                                src_s = 8 * QP + (L & 2) + 4 * (c >> 1) + (c & 1)
                                kscale[:, c], vscale[:, c] = k_sc[src_s], v_sc[src_s]
                        s = np.zeros((32, 8))
                        for st in range(d // 4):
                            mma884(s, s_q[T + 4 * HI, 4 * st:4 * st + 4], kw[:, 4 * st:4 * st + 4], b_row=False)
                        softmax_step(s, kscale, vscale, k0, k_end, qpos, qk, acc, m_run, l_run, p_tile)
                        for kstep in range(TILE // 4):
                            a = p_tile[T + 4 * HI, 4 * kstep:4 * kstep + 4]
                            for j in range(nj):
                                mma884(acc[j], a, vw[kstep][:, 4 * j:4 * j + 4], b_row=True)
                    l_run = np.stack([_lanes_sum(l_run[:, e]) for e in range(2)], axis=1)
                    for ln in (0, 1, 16, 17):
                        for e in range(2):
                            s_m[warp, ROW_A[ln] + 2 * e], s_l[warp, ROW_A[ln] + 2 * e] = m_run[ln, e], l_run[ln, e]
                    accs.append(acc)
                m = s_m.max(axis=0)
                m_use = np.where(m == -np.inf, 0.0, m)
                s_w = np.exp2(s_m - m_use)
                lsum = (s_l * s_w).sum(axis=0)
                with np.errstate(divide="ignore"):
                    inv = np.where(lsum > 0, 1.0 / np.where(lsum > 0, lsum, 1.0), 0.0)
                    lse_r = np.where(lsum > 0, m_use + np.log2(np.where(lsum > 0, lsum, 1.0)), -np.inf)
                s_o = np.zeros((8, d))
                for warp in range(DECODE_WARPS):
                    for j in range(nj):
                        for i in range(8):
                            r = ROW_A + (i & 2)
                            s_o[r, decode_dim(d, j, i)] += accs[warp][j][:, i] * s_w[warp, r]
                for r in range(rows):
                    row = r0 + r
                    tok, h = q_start + row // rep, kvh * rep + row % rep
                    if splits > 1:
                        part[split, tok, h] = s_o[r] * inv[r]
                        lse[split, tok, h] = lse_r[r]
                    else:
                        out[tok, h] = h16(s_o[r] * inv[r])
    return out, part, lse


def combine(part, lse, cu_q, kv_lens, split_len):
    splits, t_all, hq, d = part.shape
    out = np.full((t_all, hq, d), np.nan)
    for tok in range(t_all):
        b = max(i for i in range(cu_q.shape[0] - 1) if cu_q[i] <= tok)
        qpos = kv_lens[b] - (cu_q[b + 1] - cu_q[b]) + (tok - cu_q[b])
        n = max(1, min(qpos // split_len + 1, splits))
        for h in range(hq):
            m = lse[:n, tok, h].max()
            w = np.exp2(lse[:n, tok, h] - (0.0 if m == -np.inf else m))
            out[tok, h] = h16((w[:, None] * part[:n, tok, h]).sum(axis=0) / w.sum())
    return out


def prefill(q, kc, vc, ks, vs, bt, cu_q, kv_lens, scale, splits, split_len, k_new=None, v_new=None):
    """paged_prefill_m884 over its grid, then combine_splits when splits > 1: the fp16-rounded output."""
    bq = PREFILL_ROWS // (q.shape[1] // kc.shape[2])
    out, part, lse = prefill_kernel(q, kc, vc, ks, vs, bt, cu_q, kv_lens, scale * 1.4426950408889634, bq, splits,
                                    split_len, k_new, v_new)
    return combine(part, lse, cu_q, kv_lens, split_len) if splits > 1 else out


def prefill_kernel(q, kc, vc, ks, vs, bt, cu_q, kv_lens, qk, bq, splits, split_len, k_new=None, v_new=None):
    """paged_prefill_m884 over the grid (T // bq + n_seq, HKV, splits), shared memory by the kernel's layouts:
    (out, partials, lse), NaN where unwritten."""
    t_all, hq, d = q.shape
    n_pages, bs, hkv, _ = kc.shape
    rep, n_seq, int8, nj = hq // hkv, cu_q.shape[0] - 1, kc.dtype == np.int8, d // 32
    shift, mask = bs.bit_length() - 1, bs - 1
    eb = 1 if int8 else 2
    chunks_row = d * eb // 16
    use_new = k_new is not None
    out = np.full(q.shape, np.nan)
    part = np.full((splits, t_all, hq, d), np.nan)
    lse = np.full((splits, t_all, hq), np.nan)
    n_tiles_grid = t_all // bq + n_seq
    for bx in range(n_tiles_grid):
        for kvh in range(hkv):
            for split in range(splits):
                tile_id = n_tiles_grid - 1 - bx
                lo, hi = 0, n_seq - 1
                while lo < hi:
                    mid = (lo + hi + 1) >> 1
                    if cu_q[mid] // bq + mid <= tile_id:
                        lo = mid
                    else:
                        hi = mid - 1
                q_start, q_len = cu_q[lo], cu_q[lo + 1] - cu_q[lo]
                q_lo = (tile_id - (q_start // bq + lo)) * bq
                if q_lo >= q_len:
                    continue
                n_tok = min(bq, q_len - q_lo)
                n_rows, prefix, k_lo = n_tok * rep, kv_lens[lo] - q_len, split * split_len
                k_end = min(prefix + q_lo + n_tok, k_lo + split_len)
                if k_lo >= k_end:
                    continue
                s_q = np.zeros((PREFILL_ROWS, d + 4))
                for r in range(n_rows):
                    s_q[r, :d] = q[q_start + q_lo + r // rep, kvh * rep + r % rep]
                s_k, s_v, s_sc = np.full((TILE, d + 4), np.nan), np.full(TILE * d, np.nan), np.full(2 * TILE, np.nan)

                def load_store(k0):  # load_tile + store_tile: the tile's 16-byte chunks, then their granules
                    for c in range(2 * TILE * chunks_row):
                        which, key, chunk = c // (TILE * chunks_row), (c // chunks_row) % TILE, c % chunks_row
                        pos = k0 + key
                        n_el = 16 // eb
                        data = np.zeros(n_el)
                        if pos < k_end:
                            if use_new and pos >= prefix:
                                data = (v_new if which else k_new)[q_start + pos - prefix, kvh,
                                                                   n_el * chunk:n_el * (chunk + 1)].astype(np.float64)
                            else:
                                page = _page(bt[lo], np.array(pos), shift, n_pages)
                                data = (vc if which else kc)[page, pos & mask, kvh,
                                                             n_el * chunk:n_el * (chunk + 1)].astype(np.float64)
                        for gq in range(n_el // 4):
                            g = (n_el // 4) * chunk + gq
                            if which:
                                s_v[key * d + 4 * v_granule(d, g, key):][:4] = data[4 * gq:4 * gq + 4]
                            else:
                                s_k[(key & 7) * 4 + (key >> 3), 4 * g:4 * g + 4] = data[4 * gq:4 * gq + 4]
                    if int8:
                        for key in range(TILE):
                            pos = k0 + key
                            ok = pos < k_end
                            page = _page(bt[lo], np.array(pos), shift, n_pages) if ok else 0
                            s_sc[key] = ks[page, pos & mask, kvh] if ok else 0.0
                            s_sc[TILE + key] = vs[page, pos & mask, kvh] if ok else 0.0

                warps = []
                for warp in range(PREFILL_WARPS):
                    r = 8 * warp + ROW_A[:, None] + 2 * np.arange(2)[None, :]
                    qpos = np.where(r < n_rows, prefix + q_lo + r // rep, -1)
                    last = prefix + q_lo + min(8 * warp + 7, n_rows - 1) // rep if 8 * warp < n_rows else -1
                    warps.append([np.zeros((nj, 32, 8)), np.full((32, 2), -np.inf), np.zeros((32, 2)), qpos, last,
                                  np.full((8, P_STRIDE), np.nan)])
                for k0 in range(k_lo, k_end, TILE):
                    load_store(k0)
                    for warp, (acc, m_run, l_run, qpos, last, p_tile) in enumerate(warps):
                        if k0 > last:
                            continue
                        s = np.zeros((32, 8))
                        for st in range(d // 4):
                            a = s_q[8 * warp + T + 4 * HI, 4 * st:4 * st + 4]
                            mma884(s, a, s_k[(T + 4 * HI) * 4 + QP, 4 * st:4 * st + 4], b_row=False)
                        kscale, vscale = np.ones((32, 4)), np.ones((32, 4))
                        if int8:
                            for c in range(4):
                                key = 8 * QP + (L & 2) + 4 * (c >> 1) + (c & 1)
                                kscale[:, c], vscale[:, c] = s_sc[key], s_sc[TILE + key]
                        softmax_step(s, kscale, vscale, k0, k_end, qpos, qk, acc, m_run, l_run, p_tile)
                        for kstep in range(TILE // 4):
                            a = p_tile[T + 4 * HI, 4 * kstep:4 * kstep + 4]
                            key = 4 * kstep + T
                            for j in range(nj):
                                base = key * d + 4 * v_granule(d, 8 * j + 2 * QP + HI, key)
                                mma884(acc[j], a, s_v[base[:, None] + _I4], b_row=True)
                for warp, (acc, m_run, l_run, qpos, last, p_tile) in enumerate(warps):
                    l_run = np.stack([_lanes_sum(l_run[:, e]) for e in range(2)], axis=1)
                    for e in range(2):
                        r = 8 * warp + ROW_A + 2 * e
                        for ln in np.nonzero(qpos[:, e] >= 0)[0]:
                            tok, h = q_start + q_lo + r[ln] // rep, kvh * rep + r[ln] % rep
                            inv = 1.0 / l_run[ln, e] if l_run[ln, e] > 0 else 0.0
                            for j in range(nj):
                                for i in (2 * e, 2 * e + 4):
                                    dd = prefill_dim(j, i, ln)
                                    vals = acc[j][ln, i:i + 2] * inv
                                    if splits > 1:
                                        part[split, tok, h, dd:dd + 2] = vals
                                    else:
                                        out[tok, h, dd:dd + 2] = h16(vals)
                            if splits > 1 and (ln & 14) == 0:
                                lse[split, tok, h] = (m_run[ln, e] + np.log2(l_run[ln, e]) if l_run[ln, e] > 0
                                                      else -np.inf)
    return out, part, lse
