"""Floors: the least time a benchmark row could take on this device. A decode step must move the
bytes below through memory at least once, so its floor is those bytes over the copy rate measured
in the same run; a prefill must compute the FLOPs below, so its floor is those FLOPs over the
matmul rate measured in the same run. Everything is derived here, from `ModelConfig` and the
levers (activation dtype, kv_dtype, gdn_state_dtype), in one place.

Bytes one decode step at batch B with context C (tokens each sequence attends to) must read:
  weights  every linear once: GPTQ-Int8 codes 1 byte/param + one scale per (group, output) in the
           activation dtype (+ as many zeros when asymmetric); dense linears in the activation dtype;
           the lm_head once (the B sampled rows share it); norms, GDN gate vectors (fp32) and conv
           filters (activation dtype); B rows of the embedding table, never the whole table.
  KV       each attention layer reads C x kv_heads x head_dim x 2 (K and V) elements of the kv
           dtype per sequence, plus an fp32 scale per token and KV head for K and V when int8.
  state    each GDN layer reads and writes its recurrent state hv x dk x dv (fp32 4 bytes; fp16 and
           int16 2, int16 plus an fp32 scale per (head, column)) and its conv state
           (W-1) x conv_dim in the activation dtype, per sequence.
Activations and logits are left out (a few MB against the weights' GBs).

FLOPs of a prefill of T tokens (one sequence):
  linears    2 x T x (linear params, embeddings excluded) + 2 x lm_head params (one sampled row)
  attention  2 x T^2 x head_dim x num_attention_heads per attention layer (QK^T and PV are
             4 T^2 d h each over the full square; causal keeps half)
  GDN        ~6 x T x hv x dk x dv per GDN layer: an approximation of the recurrent form (state
             decay and k^T S, the rank-1 update, q S); the chunked form does a little more
Whether a linear is GPTQ follows the quantization config's rules (what qv's loaders follow too).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from qv.config import ModelConfig
from qv.engine.build import resolve_kv_dtype
from qv.model.cache import STATE_DTYPES, gdn_bytes_per_slot, kv_bytes_per_block
from qv.model.weights import QuantRules

VECTOR_BYTES = 4  # norms, A_log and dt_bias are held in fp32 whatever the activation dtype


@dataclass(frozen=True)
class LinearShape:
    name: str  # the checkpoint's module name
    out_features: int
    in_features: int
    quantized: bool
    group_size: int  # rows per GPTQ group (in_features for one group); 0 when dense
    sym: bool
    bits: int = 8  # bits per GPTQ code (8 or 4)


@dataclass(frozen=True)
class Footprint:
    """What one row must move (bytes) and compute (FLOPs)."""

    weight_bytes: int
    kv_bytes: int
    state_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.state_bytes


@dataclass(frozen=True)
class Ceilings:
    """Rates measured in the run: the floors divide by these."""

    copy_bytes_per_s: float  # device-to-device copy, read + write bytes
    matmul_flops_per_s: float  # one large matmul in the activation dtype
    matmul_dtype: str


def text_linears(cfg: ModelConfig) -> list[LinearShape]:
    """Every linear of the text model (lm_head included), with whether GPTQ stores it."""
    rules = QuantRules(cfg.quant, cfg.architecture) if cfg.quant is not None else None
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv, hv = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.linear_num_value_heads
    shapes: list[tuple[str, int, int]] = []
    for i, kind in enumerate(cfg.layer_types):
        lp = f"{cfg.weight_prefix}layers.{i}."
        if kind == "full_attention":
            a = lp + "self_attn."
            shapes += [(a + "q_proj", 2 * nh * d, h), (a + "k_proj", nkv * d, h), (a + "v_proj", nkv * d, h),
                       (a + "o_proj", h, nh * d)]
        else:
            g = lp + "linear_attn."
            shapes += [(g + "in_proj_qkv", cfg.linear_conv_dim, h), (g + "in_proj_z", cfg.linear_value_dim, h),
                       (g + "in_proj_b", hv, h), (g + "in_proj_a", hv, h), (g + "out_proj", h, cfg.linear_value_dim)]
        m = lp + "mlp."
        shapes += [(m + "gate_proj", inter, h), (m + "up_proj", inter, h), (m + "down_proj", h, inter)]
    shapes.append(("lm_head", cfg.vocab_size, h))
    out = []
    for name, n, k in shapes:
        quantized = rules is not None and not (name == "lm_head" and cfg.tie_word_embeddings)
        mq = rules.resolve(name) if quantized else None
        quantized = mq is not None and mq.excluded_by is None
        group = (k if mq.group_size == -1 else mq.group_size) if quantized else 0
        if quantized and cfg.quant.method == "fp8":  # one scale per 128x128 block: about one per output row
            group = k
        out.append(LinearShape(name, n, k, quantized, group, cfg.quant.sym if quantized else True,
                               mq.bits if quantized else 8))
    return out


class ModelFloors:
    """Bytes and FLOPs of decode steps and prefills for one model under one set of levers."""

    def __init__(self, cfg: ModelConfig, act_dtype: torch.dtype, kv_dtype: torch.dtype, state_dtype: torch.dtype):
        self.cfg, self.act_dtype, self.act_bytes = cfg, act_dtype, act_dtype.itemsize
        self.kv_dtype, self.state_dtype = kv_dtype, state_dtype
        self.linears = text_linears(cfg)

    @classmethod
    def from_levers(cls, cfg: ModelConfig, act_dtype: torch.dtype, kv_dtype: str,
                    gdn_state_dtype: str) -> "ModelFloors":
        """kv_dtype/gdn_state_dtype: the levers' values, resolved as the engine resolves them."""
        return cls(cfg, act_dtype, resolve_kv_dtype(kv_dtype, act_dtype), STATE_DTYPES[gdn_state_dtype])

    # -- weights -------------------------------------------------------------------------------
    def linear_bytes(self, lin: LinearShape) -> int:
        n, k = lin.out_features, lin.in_features
        if not lin.quantized:
            return n * k * self.act_bytes
        groups = k // lin.group_size
        per_group = 1 if lin.sym else 2  # scales, plus zeros when asymmetric
        return n * k * lin.bits // 8 + per_group * groups * n * self.act_bytes

    def vector_bytes(self) -> int:
        """Norms, GDN gate vectors and conv filters: small, but read every step."""
        cfg = self.cfg
        total = cfg.hidden_size * VECTOR_BYTES  # final norm
        for kind in cfg.layer_types:
            total += 2 * cfg.hidden_size * VECTOR_BYTES  # input and post-attention norms
            if kind == "full_attention":
                total += 2 * cfg.head_dim * VECTOR_BYTES  # q_norm, k_norm
            else:
                hv = cfg.linear_num_value_heads
                total += (2 * hv + cfg.linear_value_head_dim) * VECTOR_BYTES  # A_log, dt_bias, gated norm
                total += cfg.linear_conv_dim * cfg.linear_conv_kernel_dim * self.act_bytes
        return total

    def weight_bytes(self, rows: int) -> int:
        """Weights one forward reads, with `rows` rows of the embedding table."""
        linears = sum(self.linear_bytes(lin) for lin in self.linears)
        return linears + self.vector_bytes() + rows * self.cfg.hidden_size * self.act_bytes

    def linear_params(self, lm_head: bool) -> int:
        return sum(lin.out_features * lin.in_features for lin in self.linears if lm_head or lin.name != "lm_head")

    # -- caches --------------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across every attention layer (the cache's own layout, scales included)."""
        return kv_bytes_per_block(self.cfg, 1, self.kv_dtype)

    def state_bytes_per_seq(self) -> int:
        """Recurrent and conv state of one sequence across every GDN layer (one pass over it): a state slot."""
        return gdn_bytes_per_slot(self.cfg, self.act_dtype, self.state_dtype)

    # -- rows ----------------------------------------------------------------------------------
    def decode(self, batch: int, context: float) -> Footprint:
        """One decode step of `batch` sequences, each attending to `context` tokens (mean)."""
        cfg = self.cfg
        attn = len(cfg.attention_layer_ids) * 4 * cfg.head_dim * cfg.num_attention_heads * context
        gdn = len(cfg.gdn_layer_ids) * 6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        flops = batch * (2 * self.linear_params(lm_head=True) + attn + gdn)
        return Footprint(weight_bytes=self.weight_bytes(batch),
                         kv_bytes=round(self.kv_bytes_per_token() * batch * context),
                         state_bytes=2 * batch * self.state_bytes_per_seq(),  # read and written
                         flops=round(flops))

    def prefill(self, tokens: int) -> Footprint:
        """A prefill of one `tokens`-long prompt up to its first sampled token. Its bytes (weights
        once, the prompt's KV written, the state written) are shown beside it; the floor is FLOPs."""
        cfg = self.cfg
        t = tokens
        attn = len(cfg.attention_layer_ids) * 2 * t * t * cfg.head_dim * cfg.num_attention_heads
        gdn = len(cfg.gdn_layer_ids) * 6 * t * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
        lm_head = cfg.vocab_size * cfg.hidden_size
        flops = 2 * t * self.linear_params(lm_head=False) + 2 * lm_head + attn + gdn
        return Footprint(weight_bytes=self.weight_bytes(t), kv_bytes=self.kv_bytes_per_token() * t,
                         state_bytes=self.state_bytes_per_seq(), flops=flops)


def floor_s(kind: str, fp: Footprint, ceilings: Ceilings) -> float:
    """Decode steps are bound by bytes over the copy rate, prefills by FLOPs over the matmul rate."""
    if kind == "decode":
        return fp.bytes / ceilings.copy_bytes_per_s
    return fp.flops / ceilings.matmul_flops_per_s


# ---------------------------------------------------------------------------------------------
# ceilings measured in the run
# ---------------------------------------------------------------------------------------------

GPU_COPY_BYTES = 1 << 30  # per buffer: far past every cache, so the copy runs at DRAM speed
CPU_COPY_BYTES = 64 << 20
GPU_MATMUL_N, CPU_MATMUL_N = 8192, 1024
REPS = 10


def _best_seconds(fn, device: torch.device, reps: int) -> float:
    """Fastest of `reps` calls after a warm-up (CUDA events on the GPU, the wall clock on CPU)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best


def measure_ceilings(device: torch.device, dtype: torch.dtype) -> Ceilings:
    """Copy and matmul rates of `device`, the matmul in the activation `dtype` (bf16 on sm_80+:
    8192^3 on the GPU); run before the engine takes its memory."""
    cuda = device.type == "cuda"
    nbytes = GPU_COPY_BYTES if cuda else CPU_COPY_BYTES
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), device, REPS if cuda else 3)
    del src, dst
    n = GPU_MATMUL_N if cuda else CPU_MATMUL_N
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    mm_s = _best_seconds(lambda: torch.mm(a, b, out=out), device, REPS if cuda else 3)
    del a, b, out
    if cuda:
        torch.cuda.empty_cache()  # give the buffers back before the engine plans its memory
    return Ceilings(copy_bytes_per_s=2 * nbytes / copy_s, matmul_flops_per_s=2 * n**3 / mm_s,
                    matmul_dtype=str(dtype).removeprefix("torch."))
