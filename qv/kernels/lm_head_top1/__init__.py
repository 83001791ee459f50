"""The vocabulary argmax of lm_head(x) without [rows, vocab] logits (the MTP drafter's greedy tokens), and the
compressed ranking copy of the lm_head weight it reads (built once at load). The lm_head is a 16/32-bit weight or
an int8 one with one scale per vocabulary row (a GPTQWeight of one symmetric group spanning H: QV_LM_HEAD_INT8);
the argmax is then exact for the int8 head's own logits.

Int4 is the default ranking copy: at 27B shapes (V 248,320 x H 5,120) it is 0.64 GB, read in about 0.15 ms at
HBM rate, against 0.30 ms for int8 and 0.60 ms for the bf16 weight itself, so three draft steps fit in well
under a millisecond. Its coarser scores only cost a longer shortlist to re-score exactly (configs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qv.kernels.linear import GPTQWeight
from qv.kernels.registry import impl

RANKING_BITS = (4, 8)
# row-wise clipping ratios tried at load; the one with the least squared error is kept (int4 gains most)
CLIP_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)


@dataclass(frozen=True)
class Top1Ranking:
    """A compressed copy of an lm_head weight [V, H] for ranking the vocabulary: symmetric codes with one scale
    per row, after each hidden channel is divided by its rms over the rows (col_scale). Without that, a few
    large channels set every row's scale and coarsen the rest: on random rows with 8 of 1,024 channels 6x
    larger, the int4 error is 0.27 unequalized and 0.11 equalized, and the exact best ranks past 8th in 11% of
    rows unequalized, 0.6% equalized. Pass 1 scores x * col_scale against the codes.

    codes     [V, WORDS] int32 - 32 // bits unsigned codes u = c + 2**(bits-1) per word, c in
                                 [-(2**(bits-1)-1), 2**(bits-1)-1]; code j of word k holds hidden index
                                 j * WORDS + k (each code slot of a word covers one contiguous stretch of the
                                 hidden size, zero-padded past H)
    scales    [V] fp32         - the weight is about scales[v] * c[v, h] * col_scale[h]
    col_scale [H] fp32         - each channel's rms over the rows, over their mean
    bits: 4 or 8; hidden: H
    """

    codes: torch.Tensor
    scales: torch.Tensor
    col_scale: torch.Tensor
    bits: int
    hidden: int

    @property
    def vocab(self) -> int:
        return self.codes.shape[0]

    @property
    def words(self) -> int:
        return self.codes.shape[1]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * 4 + self.scales.numel() * 4 + self.col_scale.numel() * 4

    def unpack(self, rows: slice = slice(None)) -> torch.Tensor:
        """The signed codes c of the rows, int64 [rows, H] (tests and benchmarks)."""
        words = self.codes[rows].long() & 0xFFFFFFFF
        shifts = torch.arange(0, 32, self.bits, device=words.device)
        u = (words[:, None, :] >> shifts[None, :, None]) & ((1 << self.bits) - 1)  # [rows, codes a word, WORDS]
        return u.reshape(words.shape[0], -1)[:, :self.hidden] - (1 << (self.bits - 1))

    def dequantize(self, rows: slice = slice(None)) -> torch.Tensor:
        """The weight rows as this copy holds them, fp32 [rows, H] (tests and benchmarks)."""
        return self.unpack(rows).float() * self.scales[rows, None] * self.col_scale[None, :]


def is_row_int8(weight) -> bool:
    """Whether `weight` is an int8 lm_head with one symmetric scale per vocabulary row: a GPTQWeight of 8 bits,
    no zero points and one group spanning the hidden size (scales [1, V])."""
    return (isinstance(weight, GPTQWeight) and weight.bits == 8 and weight.zeros is None
            and weight.scales.shape[0] == 1)


def weight_rows(weight: torch.Tensor | GPTQWeight, start: int, end: int) -> torch.Tensor:
    """fp32 rows [start, end) of an lm_head weight [V, H]: dense, or a row-int8 GPTQWeight dequantized."""
    if isinstance(weight, GPTQWeight):
        codes = weight.qweight[:, start:end].float() - weight.symmetric_zero  # [H, rows]
        return (codes * weight.scales[0, start:end].float()).t()
    return weight[start:end].float()


def build_top1_ranking(weight: torch.Tensor | GPTQWeight, bits: int = 4, chunk_rows: int = 8192) -> Top1Ranking:
    """The ranking copy of an lm_head weight [V, H] (any float dtype, or a row-int8 GPTQWeight), on the weight's
    device, `chunk_rows` rows at a time (the fp32 temporaries of a chunk are the only extra memory). Load-time
    work, not for graphs."""
    if bits not in RANKING_BITS:
        raise ValueError(f"build_top1_ranking: bits must be one of {RANKING_BITS}, got {bits}")
    if isinstance(weight, GPTQWeight):
        if not is_row_int8(weight):
            raise ValueError("build_top1_ranking: a quantized lm_head must be int8 with one symmetric scale per row "
                             f"(got {weight.bits} bits, {weight.scales.shape[0]} groups, "
                             f"{'asymmetric' if weight.zeros is not None else 'symmetric'})")
    elif weight.dim() != 2 or not weight.dtype.is_floating_point:
        raise ValueError(f"build_top1_ranking: weight must be a float [V, H] matrix, got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if 0 in weight.shape:
        raise ValueError(f"build_top1_ranking: weight {tuple(weight.shape)} is empty (no rows or no hidden size)")
    v, h = weight.shape
    device = weight.qweight.device if isinstance(weight, GPTQWeight) else weight.device
    per_word = 32 // bits
    words = -(-h // per_word)
    qmax = (1 << (bits - 1)) - 1
    codes = torch.empty(v, words, dtype=torch.int32, device=device)
    scales = torch.empty(v, dtype=torch.float32, device=device)
    shifts = torch.arange(0, 32, bits, device=device)
    col_scale = _channel_rms(weight, chunk_rows, device)
    for r0 in range(0, v, chunk_rows):
        w = weight_rows(weight, r0, r0 + chunk_rows) / col_scale
        c, s = _quantize_rows(w, qmax)
        u = torch.full((w.shape[0], per_word * words), qmax + 1, dtype=torch.int64, device=device)
        u[:, :h] = c + (qmax + 1)
        packed = (u.view(w.shape[0], per_word, words) << shifts[None, :, None]).sum(1)
        codes[r0:r0 + chunk_rows] = (packed - (packed >= 1 << 31).long() * (1 << 32)).to(torch.int32)
        scales[r0:r0 + chunk_rows] = s
    return Top1Ranking(codes, scales, col_scale, bits, h)


def _channel_rms(weight, chunk_rows: int, device) -> torch.Tensor:
    """Each column's rms over the rows, over their mean (an all-zero column gets 1)."""
    sq = torch.zeros(weight.shape[1], dtype=torch.float32, device=device)
    for r0 in range(0, weight.shape[0], chunk_rows):
        sq += weight_rows(weight, r0, r0 + chunk_rows).square().sum(0)
    rms = sq.sqrt()
    rms = torch.where(rms > 0, rms, rms.max().clamp_min(1e-30))
    return rms / rms.mean()


def _quantize_rows(w: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric codes [rows, H] int64 and scales [rows]: of the clipping ratios, each row keeps the one with
    the least squared error (a ranking error is a dot product of x with the row's error)."""
    amax = w.abs().amax(1).clamp_min(1e-30)
    best_c = best_s = best_err = None
    for ratio in CLIP_RATIOS:
        s = amax * (ratio / qmax)
        c = torch.clamp(torch.round(w / s[:, None]), -qmax, qmax)
        err = (c * s[:, None] - w).square().sum(1)
        if best_err is None:
            best_c, best_s, best_err = c, s, err
            continue
        better = err < best_err
        best_c = torch.where(better[:, None], c, best_c)
        best_s = torch.where(better, s, best_s)
        best_err = torch.minimum(err, best_err)
    return best_c.long(), best_s


def lm_head_top1(x: torch.Tensor, weight: torch.Tensor | GPTQWeight,
                 ranking: Top1Ranking | None = None) -> torch.Tensor:
    """argmax_v (x @ weight^T)[r, v] for each row r, ties to the lowest v. x [R, H]; weight [V, H] bf16/fp16/fp32
    (unit inner stride) or a row-int8 GPTQWeight (is_row_int8: the scores are the int8 head's logits); ranking:
    build_top1_ranking(weight), or None to rank a dense weight itself (exact, reads all of it; a quantized
    weight needs a ranking). Returns [R] int64. No host sync; launch shapes depend on R only (CUDA-graph
    capturable).

    With a ranking, each row's best candidates by the compressed copy are re-scored exactly in fp32 against
    `weight`: the result is the exact argmax unless the exact best is not on that shortlist (configs.py gives
    its length and the measured rate at which that happens)."""
    if isinstance(weight, GPTQWeight):
        if not is_row_int8(weight):
            raise ValueError("lm_head_top1: a quantized lm_head must be int8 with one symmetric scale per row")
        if ranking is None:
            raise ValueError("lm_head_top1: an int8 lm_head needs its ranking copy (build_top1_ranking)")
        if x.dim() != 2 or x.shape[1] != weight.shape[1]:
            raise ValueError(f"lm_head_top1: x [R, H] and weight [V, H] expected, got {tuple(x.shape)} and "
                             f"{tuple(weight.shape)}")
        if x.device != weight.qweight.device:
            raise ValueError(f"lm_head_top1: x on {x.device}, weight on {weight.qweight.device}")
        if (ranking.vocab, ranking.hidden) != tuple(weight.shape):
            raise ValueError(f"lm_head_top1: ranking copy of a [{ranking.vocab}, {ranking.hidden}] weight given for "
                             f"{tuple(weight.shape)}")
        return impl("lm_head_top1", x.device)(x, weight, ranking)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"lm_head_top1: x [R, H] and weight [V, H] expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.stride(1) != 1:
        raise ValueError(f"lm_head_top1: weight must be bf16/fp16/fp32 with unit inner stride, got {weight.dtype} "
                         f"strides {weight.stride()}")
    if not 0 < weight.shape[0] < 1 << 31:
        raise ValueError(f"lm_head_top1: vocabulary of {weight.shape[0]} rows (1 to 2**31 - 1 supported)")
    if weight.shape[1] == 0:
        raise ValueError("lm_head_top1: hidden size 0 (every score would be 0)")
    if ranking is not None and (ranking.vocab, ranking.hidden) != tuple(weight.shape):
        raise ValueError(f"lm_head_top1: ranking copy of a [{ranking.vocab}, {ranking.hidden}] weight given for "
                         f"{tuple(weight.shape)}")
    if ranking is not None and ranking.codes.device != weight.device:
        raise ValueError(f"lm_head_top1: ranking on {ranking.codes.device}, weight on {weight.device}")
    if x.device != weight.device:
        raise ValueError(f"lm_head_top1: x on {x.device}, weight on {weight.device}")
    return impl("lm_head_top1", x.device)(x, weight, ranking)
