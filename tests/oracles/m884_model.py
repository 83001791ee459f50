"""A NumPy model of PTX mma.sync.m8n8k4 (.row.col, fp16 inputs, fp32 accumulators) and of the lane arithmetic
of qv/kernels/linear/gptq_m884.cu, so that the kernels' fragment and index mapping is checked on the CPU
(where they cannot run). The instruction follows the PTX ISA's tables ("Matrix Fragments for mma.m8n8k4
with .f16", the same as CuTe's SM70_8x4_Row and SM70_8x8_32b layouts); the kernel functions below repeat
the .cu code's index expressions and byte permutes, bit for bit where they move bits."""

from __future__ import annotations

import numpy as np

LANES = np.arange(32)
QP = (LANES >> 2) & 3  # the quad pair of each lane
THREAD = (LANES & 3) + 4 * (LANES >> 4)  # its thread 0..7 within the quad pair
I8 = np.arange(8)
D_ROW = (LANES[:, None] & 1) + (I8[None, :] & 2) + 4 * (LANES[:, None] >> 4)  # D element i of lane L
D_COL = (I8[None, :] & 1) + (LANES[:, None] & 2) + (I8[None, :] & 4)


def mma_m8n8k4(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """One warp's m8n8k4 on per-lane fragment values: a [32, 4] (A row THREAD, k 0..3), b [32, 4] (B column
    THREAD, k 0..3), c [32, 8]; each quad pair multiplies its own matrices. Returns d [32, 8]."""
    A = np.zeros((4, 8, 4))
    B = np.zeros((4, 4, 8))
    C = np.zeros((4, 8, 8))
    A[QP, THREAD] = a
    B[QP, :, THREAD] = b
    C[QP[:, None], D_ROW, D_COL] = c
    D = A @ B + C
    return D[QP[:, None], D_ROW, D_COL]


# --- bits: prmt and fp16 pairs in u32 words ---------------------------------------------------------

def prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    return sum(src[(sel >> 4 * i) & 7] << 8 * i for i in range(4))


def halves(u: int) -> np.ndarray:
    return np.array([u & 0xFFFF, u >> 16], dtype=np.uint16).view(np.float16)


def pack(h: np.ndarray) -> int:
    bits = np.asarray(h, dtype=np.float16).view(np.uint16)
    return int(bits[0]) | int(bits[1]) << 16


def words(values16: np.ndarray) -> list[int]:
    """8 fp16 values as 4 u32 words (a U4 load)."""
    bits = np.asarray(values16, dtype=np.float16).view(np.uint16).astype(np.int64)
    return [int(bits[2 * i]) | int(bits[2 * i + 1]) << 16 for i in range(4)]


def code_words(codes: np.ndarray, k: int, n: int, ok: bool) -> tuple[int, int]:
    """load8 of codes[k, n .. n+7]: (word of columns n .. n+3, word of n+4 .. n+7)."""
    if not ok:
        return 0, 0
    c = codes[k, n:n + 8].astype(np.int64)
    return tuple(int(sum(int(c[4 * w + i]) << 8 * i for i in range(4))) for w in range(2))


def nibble_rows(p0: int, p1: int) -> list[int]:
    """The .cu's nibble_rows: packed byte rows r, r + 1 (one word, 4 columns) -> byte rows 2r .. 2r + 3."""
    return [p0 & 0x0F0F0F0F, (p0 >> 4) & 0x0F0F0F0F, p1 & 0x0F0F0F0F, (p1 >> 4) & 0x0F0F0F0F]


def code_rows(codes: np.ndarray, k0: int, n: int, ok: bool, bits: int) -> list[tuple[int, int]]:
    """The .cu's load_rows4: inputs k0 .. k0+3 of columns n .. n+7 as 4 (word 0..3, word 4..7) byte rows;
    `codes` is [K, N] at 8 bits, the packed [K/2, N] at 4."""
    if bits == 8:
        return [code_words(codes, k0 + r, n, ok) for r in range(4)]
    p0, p1 = code_words(codes, k0 // 2, n, ok), code_words(codes, k0 // 2 + 1, n, ok)
    lo, hi = nibble_rows(p0[0], p1[0]), nibble_rows(p0[1], p1[1])
    return [(lo[r], hi[r]) for r in range(4)]


def columns8(s_words: list[int], z_words: list[int]) -> tuple[list[int], list[int]]:
    """The .cu's columns8: off[c] = half2(1024 + z_c) twice, scale[c] = half2(s_c) twice."""
    off, scale = [0] * 8, [0] * 8
    for i in range(4):
        o = pack(halves(z_words[i]) + np.float16(1024))
        off[2 * i], off[2 * i + 1] = prmt(o, o, 0x1010), prmt(o, o, 0x3232)
        scale[2 * i], scale[2 * i + 1] = prmt(s_words[i], s_words[i], 0x1010), prmt(s_words[i], s_words[i], 0x3232)
    return off, scale


def dequant4(w: list[int], off: list[int], scale: list[int]) -> list[list[int]]:
    """The .cu's dequant4: rows k0..k0+3 (words w) of 4 columns to a[c] = [{k0, k0+1}, {k0+2, k0+3}]."""
    t01 = [prmt(w[0], w[1], 0x5140), prmt(w[0], w[1], 0x7362)]
    t23 = [prmt(w[2], w[3], 0x5140), prmt(w[2], w[3], 0x7362)]
    out = []
    for c in range(4):
        sel = 0x4342 if c & 1 else 0x4140
        pair = []
        for t in (t01, t23):
            h = halves(prmt(t[c >> 1], 0x64646464, sel))
            pair.append(pack((h - halves(off[c])) * halves(scale[c])))  # sub.rn then mul.rn, in fp16
        out.append(pair)
    return out


def fragment_values(pair: list[int]) -> np.ndarray:
    return np.concatenate([halves(pair[0]), halves(pair[1])]).astype(np.float64)


SYMMETRIC = {8: words(np.full(8, 128, dtype=np.float16)), 4: words(np.full(8, 8, dtype=np.float16))}


def _scale_words(scales, zeros, g, n, ok, bits):
    if not ok:
        return [0] * 4, SYMMETRIC[bits]
    return words(scales[g, n:n + 8]), (words(zeros[g, n:n + 8]) if zeros is not None else SYMMETRIC[bits])


# --- the GEMV ----------------------------------------------------------------------------------------

def gemv(x16, codes, scales, zeros, group, k_split=None, bits=8):
    """gptq_gemv_m884 over its whole grid, in float64 after fp16 dequantization: y [M, N] (NaN where no
    lane wrote, and an error if one is written twice). x16 [M, K] fp16, codes [K, N] uint8 (bits 8) or
    packed [K/2, N] (bits 4), scales/zeros [G, N] fp16 (zeros None: symmetric)."""
    M, K = x16.shape
    N = codes.shape[1]
    MT = (M + 7) // 8
    k_split = k_split or K
    y = np.zeros((M, N))
    written = np.zeros((M, N), dtype=int)
    for by in range((K + k_split - 1) // k_split):
        k_lo, k_hi = by * k_split, min(K, by * k_split + k_split)
        for bx in range((N + 255) // 256):
            acc = np.zeros((4, MT, 8, 32, 8))
            chunk = 128 if group % 128 == 0 else group
            for warp in range(4):
                for kg in range(k_lo + warp * chunk, k_hi, 4 * chunk):
                    cols = []
                    for lane in range(32):
                        n_lane = bx * 256 + 8 * lane
                        cols.append(columns8(*_scale_words(scales, zeros, kg // group, n_lane, n_lane < N, bits)))
                    for k0 in range(kg, kg + chunk, 4):
                        a = np.zeros((8, 32, 4))
                        b = np.zeros((MT, 32, 4))
                        for lane in range(32):
                            n_lane = bx * 256 + 8 * lane
                            q = code_rows(codes, k0, n_lane, n_lane < N, bits)
                            off, scale = cols[lane]
                            frag = (dequant4([w[0] for w in q], off[:4], scale[:4])
                                    + dequant4([w[1] for w in q], off[4:], scale[4:]))
                            for c in range(8):
                                a[c, lane] = fragment_values(frag[c])
                            for mt in range(MT):
                                m = 8 * mt + THREAD[lane]
                                if m < M:
                                    b[mt, lane] = x16[m, k0:k0 + 4]
                        for c in range(8):
                            for mt in range(MT):
                                acc[warp, mt, c] = mma_m8n8k4(a[c], b[mt], acc[warp, mt, c])
            total = acc[0] + ((acc[1] + acc[2]) + acc[3])
            for lane in range(32):
                for mt in range(MT):
                    for i in range(8):
                        m = 8 * mt + (lane & 2) + (i & 1) + (i & 4)
                        n = bx * 256 + 8 * ((lane & ~2) | (i & 2))
                        if m < M and n < N:
                            y[m, n:n + 8] += total[mt, :, lane, i]
                            written[m, n:n + 8] += 1
    splits = (K + k_split - 1) // k_split
    assert (written == splits).all(), f"outputs written {sorted(set(written.ravel()))} times, expected {splits}"
    return y


# --- the GEMM ----------------------------------------------------------------------------------------

BM, BN, BK, PITCH = 64, 128, 32, 36


def tile_of(pid: int, tiles_m: int, tiles_n: int) -> tuple[int, int]:
    """The .cu's tile order: 8 row tiles sweep the column tiles together."""
    per_group = 8 * tiles_n
    first_m = (pid // per_group) * 8
    size_m = min(tiles_m - first_m, 8)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


class _Loader:
    """One loader thread's registers across K steps (gemm_load / gemm_store), its cached group included."""

    def __init__(self, tid):
        self.tid, self.group_index, self.s, self.z = tid, -1, [0] * 4, [0] * 4

    def load_store(self, x16, codes, scales, zeros, group, m0, n0, kt, k_end, xs, ws, bits):
        M, N = x16.shape[0], codes.shape[1]
        for j in range(4):
            piece = self.tid + 128 * j
            m, k = m0 + piece // 8, kt + 4 * (piece % 8)
            xs[piece // 8, 4 * (piece % 8):4 * (piece % 8) + 4] = x16[m, k:k + 4] if m < M and k < k_end else 0
        k, n = kt + 4 * (self.tid % 8), n0 + 8 * (self.tid // 8)
        ok = k < k_end and n < N
        q = code_rows(codes, k, n, ok, bits)
        if ok and k // group != self.group_index:
            self.group_index = k // group
            self.s, self.z = _scale_words(scales, zeros, self.group_index, n, True, bits)
        off, scale = columns8(self.s if ok else [0] * 4, self.z if zeros is not None else SYMMETRIC[bits])
        frag = dequant4([w[0] for w in q], off[:4], scale[:4]) + dequant4([w[1] for w in q], off[4:], scale[4:])
        rq, co = self.tid % 8, self.tid // 8
        for c in range(8):
            ws[8 * co + c, 4 * rq:4 * rq + 4] = fragment_values(frag[c])


def gemm(x16, codes, scales, zeros, group, k_split=None, bits=8):
    """gptq_gemm_m884 over its whole grid, in float64 after fp16 dequantization (as gemv)."""
    M, K = x16.shape
    N = codes.shape[1]
    k_split = k_split or K
    tiles_m, tiles_n = (M + BM - 1) // BM, (N + BN - 1) // BN
    y = np.zeros((M, N))
    written = np.zeros((M, N), dtype=int)
    for by in range((K + k_split - 1) // k_split):
        k_lo, k_end = by * k_split, min(K, by * k_split + k_split)
        for pid in range(tiles_m * tiles_n):
            tile_m, tile_n = tile_of(pid, tiles_m, tiles_n)
            m0, n0 = tile_m * BM, tile_n * BN
            loaders = [_Loader(tid) for tid in range(128)]
            acc = np.zeros((4, 2, 4, 32, 8))
            for kt in range(k_lo, k_end, BK):
                xs, ws = np.full((BM, PITCH), np.nan), np.full((BN, PITCH), np.nan)
                for ld in loaders:
                    ld.load_store(x16, codes, scales, zeros, group, m0, n0, kt, k_end, xs, ws, bits)
                for ks in range(BK // 4):
                    for warp in range(4):
                        wm, wn = 32 * (warp & 1), 64 * (warp >> 1)
                        af = [xs[wm + 16 * mi + 8 * (QP & 1) + THREAD, 4 * ks:4 * ks + 4] for mi in range(2)]
                        bf = [ws[wn + 16 * ni + 8 * (QP >> 1) + THREAD, 4 * ks:4 * ks + 4] for ni in range(4)]
                        for mi in range(2):
                            for ni in range(4):
                                acc[warp, mi, ni] = mma_m8n8k4(af[mi], bf[ni], acc[warp, mi, ni])
            for warp in range(4):
                wm, wn = 32 * (warp & 1), 64 * (warp >> 1)
                for lane in range(32):
                    q = QP[lane]
                    for mi in range(2):
                        for ni in range(4):
                            for i in range(8):
                                m = m0 + wm + 16 * mi + 8 * (q & 1) + (lane & 1) + (i & 2) + 4 * (lane >> 4)
                                n = n0 + wn + 16 * ni + 8 * (q >> 1) + (lane & 2) + (i & 4) + (i & 1)
                                if m < M and n < N:
                                    y[m, n] += acc[warp, mi, ni, lane, i]
                                    written[m, n] += 1
    splits = (K + k_split - 1) // k_split
    assert (written == splits).all(), f"outputs written {sorted(set(written.ravel()))} times, expected {splits}"
    return y


def dequantized(codes, scales, zeros, group, bits=8) -> np.ndarray:
    """W [K, N] as the kernels round it: (c - z) exactly, times s rounded to fp16 (numpy's fp16 product).
    At 4 bits `codes` is the packed [K/2, N], unpacked here by a loop over rows (not the kernels' masks)."""
    if bits == 4:
        packed = codes
        codes = np.zeros((2 * packed.shape[0], packed.shape[1]), dtype=np.uint8)
        for r in range(packed.shape[0]):
            codes[2 * r], codes[2 * r + 1] = packed[r] % 16, packed[r] // 16
    g = np.arange(codes.shape[0]) // group
    z = np.full_like(scales, 1 << (bits - 1)) if zeros is None else zeros
    return ((codes.astype(np.float16) - z[g]) * scales[g]).astype(np.float16)
