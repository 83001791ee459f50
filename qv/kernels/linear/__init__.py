"""Linear layers over dense, GPTQ (8 or 4 bits), block-FP8 or 12-bit (W12) weights, and qv's runtime layouts of
the quantized weights."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qv.kernels.registry import impl


@dataclass
class GPTQWeight:
    """A GPTQ weight in qv's runtime layout (repacked once at load from the checkpoint's, GPTQ or AWQ).

    qweight uint8         - the integer codes, input-major like GPTQ's packed qweight:
                            bits 8: [K, N], one code a byte;
                            bits 4: [K/2, N], byte row r holds input 2r in its low nibble, 2r + 1 in its high
                            (GPTQ's int32 [K/8, N] qweight viewed as bytes, rows in order)
    scales  [G, N] fp     - per (group, output) scale, G = number of groups
    zeros   [G, N] fp | None - per (group, output) true zero point; None means symmetric (128, or 8 for 4 bits)
    g_idx   [K] int32     - group of each input row (k // group_size unless desc_act)
    group_size: int       - rows per group (K for a single group); informational when desc_act
    bits: int             - 8 or 4
    sequential: bool | None - whether g_idx is k // group_size; None until is_sequential() first checks
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor
    group_size: int
    bits: int = 8
    sequential: bool | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"GPTQWeight: bits={self.bits}; qv runs 8- and 4-bit weights")

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * (8 // self.bits)

    @property
    def symmetric_zero(self) -> int:
        """The zero point of a symmetric weight (zeros None): the middle code."""
        return 1 << (self.bits - 1)

    def codes(self) -> torch.Tensor:
        """The codes one a byte, uint8 [K, N] (a copy for 4 bits, the stored tensor for 8)."""
        if self.bits == 8:
            return self.qweight
        return unpack_nibbles(self.qweight)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def shape(self) -> tuple[int, int]:  # nn.Linear orientation [N, K]
        return (self.out_features, self.in_features)

    def is_sequential(self) -> bool:
        """Whether g_idx is k // group_size (no act-order): the kernels' fast paths need it. Checked once per
        weight (one host sync at first use) and kept in `sequential`."""
        if self.sequential is None:
            expect = torch.arange(self.in_features, device=self.g_idx.device, dtype=torch.int64) // self.group_size
            self.sequential = bool(torch.equal(self.g_idx.long(), expect))
        return self.sequential

    def to(self, device) -> "GPTQWeight":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return GPTQWeight(move(self.qweight), move(self.scales), move(self.zeros), move(self.g_idx), self.group_size,
                          self.bits)


@dataclass
class FP8Weight:
    """A block-FP8 weight as Qwen's FP8 checkpoints store it (DeepSeek's layout), kept as read.

    weight     float8_e4m3fn [N, K]  - nn.Linear orientation
    scale_inv  fp32 [ceil(N/bn), ceil(K/bk)] - the scale of each [bn, bk] block
    block      (bn, bk)              - `weight_block_size`
    w[n, k] = weight[n, k] * scale_inv[n // bn, k // bk]
    """

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    def __post_init__(self):
        if self.weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"FP8Weight: weight dtype {self.weight.dtype}; expected float8_e4m3fn")
        n, k = self.weight.shape
        bn, bk = self.block
        want = (-(-n // bn), -(-k // bk))
        if tuple(self.scale_inv.shape) != want:
            raise ValueError(f"FP8Weight: scale_inv shape {tuple(self.scale_inv.shape)}, expected {want} for a "
                             f"[{n}, {k}] weight in {bn}x{bk} blocks")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def to(self, device) -> "FP8Weight":
        return FP8Weight(self.weight.to(device), self.scale_inv.to(device), self.block)


W12_ZERO = 2048  # a W12 code c stores the integer c - 2048, in -2047..2047


@dataclass
class W12Weight:
    """A 12-bit integer weight (1.5 bytes a weight), symmetric with one fp32 scale per output row; qv packs
    it at load from a dense bf16/fp16 weight (pack_w12).

    lo     uint8 [N, K]          - the low 8 bits of each code
    hi     uint8 [N, ceil(K/2)]  - the high 4 bits: input 2j in the low nibble of byte j, 2j + 1 in the high
    scale  fp32 [N]              - max |w| of the row / 2047
    w[n, k] = (code[n, k] - 2048) * scale[n], code = hi nibble << 8 | lo
    """

    lo: torch.Tensor
    hi: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self):
        n, k = self.lo.shape
        if self.hi.shape != (n, (k + 1) // 2) or self.scale.shape != (n,):
            raise ValueError(f"W12Weight: hi {tuple(self.hi.shape)} / scale {tuple(self.scale.shape)} do not fit lo "
                             f"[{n}, {k}] (expected [{n}, {(k + 1) // 2}] / [{n}])")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.lo.shape)

    @property
    def in_features(self) -> int:
        return self.lo.shape[1]

    @property
    def out_features(self) -> int:
        return self.lo.shape[0]

    def codes(self) -> torch.Tensor:
        """The signed integers [N, K] int32 in -2047..2047."""
        k = self.in_features
        nibbles = torch.stack([self.hi & 15, self.hi >> 4], dim=2).reshape(self.hi.shape[0], -1)[:, :k]
        return (nibbles.to(torch.int32) << 8 | self.lo.to(torch.int32)) - W12_ZERO

    def to(self, device) -> "W12Weight":
        return W12Weight(self.lo.to(device), self.hi.to(device), self.scale.to(device))


def pack_w12(w: torch.Tensor) -> W12Weight:
    """Dense [N, K] -> W12Weight: per row, round(w / scale) with scale = max |w| / 2047."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp_min(1e-30) / (W12_ZERO - 1)
    codes = torch.round(wf / scale[:, None]).clamp(1 - W12_ZERO, W12_ZERO - 1).to(torch.int32) + W12_ZERO
    n, k = codes.shape
    high = torch.nn.functional.pad(codes >> 8, (0, k % 2)).to(torch.uint8)
    return W12Weight((codes & 255).to(torch.uint8), high[:, 0::2] | (high[:, 1::2] << 4), scale)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [R, N] of two 4-bit codes a byte (row 2r low nibble, 2r + 1 high) -> uint8 codes [2R, N]."""
    return torch.stack([packed & 15, packed >> 4], dim=1).reshape(2 * packed.shape[0], packed.shape[1])


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [K, N] in 0..15, K even -> uint8 [K/2, N]: the inverse of unpack_nibbles."""
    c = codes.to(torch.uint8).reshape(codes.shape[0] // 2, 2, codes.shape[1])
    return c[:, 0] | (c[:, 1] << 4)


def on_rows(x: torch.Tensor, n: int, run, row_align: int = 1) -> torch.Tensor:
    """Every implementation's frame: x [..., K] as 2-D rows with unit inner stride (and a row stride that is a
    multiple of row_align), an output [M, n] in x's dtype, run(x2, out) to fill it unless there are no rows, and
    the result shaped [..., n]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1 or x2.stride(0) % row_align:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        run(x2, out)
    return out.view(*shape[:-1], n)


def few_row_limit(weight, device: torch.device, dtype: torch.dtype) -> int | None:
    """The most rows the linear of `weight` takes on its few-row kernels where one more row switches it to the
    chunked dequantization ahead of cuBLAS (GPTQ weights, the Triton backend on sm_90: configs.CHUNKED_ROWS), whose
    every call writes and reads a whole 16-bit copy of the weight: a 64-layer 27B step's linears go from ~14 ms
    to ~47 ms there (H100); None where there is no such edge. A step planner keeps small steps within it."""
    from qv.kernels.linear.configs import CHUNKED_ROWS, gemv_kind
    from qv.kernels.registry import chain_for

    if not isinstance(weight, GPTQWeight) or device.type != "cuda" or chain_for(device)[0] != "triton":
        return None
    return CHUNKED_ROWS - 1 if gemv_kind(device, CHUNKED_ROWS, dtype) == "chunked" else None


def linear(x: torch.Tensor, weight: torch.Tensor | GPTQWeight | FP8Weight | W12Weight,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ bias). x [T, K]; weight dense [N, K], GPTQWeight (K x N codes), FP8Weight ([N, K] e4m3 with
    block scales) or W12Weight ([N, K] 12-bit codes, a scale per row); bias [N]; y [T, N]."""
    k = weight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"linear: x last dim {x.shape[-1]} != weight in_features {k}")
    return impl("linear", x.device)(x, weight, bias)
