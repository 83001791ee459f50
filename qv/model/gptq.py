"""Calibrated GPTQ for `qv quantize --method gptq` (Frantar et al., 2022): each linear's weight is quantized
column by column, and each column's rounding error is spread over the columns not yet quantized through the
inverse Hessian of the layer's inputs, H = 2/n X^T X over the calibration tokens.

Layer by layer, so a 27B model needs one decoder layer's weights on the device at a time: the calibration
tokens' hidden states enter layer i, a first pass over them records the Hessian of each linear's input (one
recorder per fused run of linears: q/k/v, gate/up and the GDN in-projections share an input), every planned
module is quantized, its dequantized weight replaces the dense one, and a second pass gives the hidden states
that enter layer i + 1, so later layers calibrate on what the quantized earlier layers produce. The layer
runs through qv's own DecoderLayer (the fp32 reference or Triton kernels, whichever backend the device has).

Options: damping (a share of the mean Hessian diagonal added to it), activation order (columns in order of
decreasing Hessian diagonal), static groups (the default of `qv quantize`: each group's scales fixed up front
on the natural column order, so g_idx stays k // group_size, which qv's fast kernels and tensor-parallel row
shards need; without them groups follow the activation order, g_idx is permuted and the config says
desc_act), group size (-1: one group), symmetric or asymmetric, 8 or 4 bits. Modules outside the
decoder layers (the MTP head's) are rounded to nearest: they have no calibration pass here.
"""

from __future__ import annotations

import json
import math
import random
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from qv.errors import ConfigError
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.layers import FusedLinear, Linear
from qv.model.qwen3_5 import LayerBuilder
from qv.model.weights import CheckpointReader
from qv.model_config import ModelConfig

BLOCK = 128  # columns whose errors are propagated together (GPTQ's lazy batch updates)
BATCH_TOKENS = 4096  # calibration tokens a layer pass runs at once (bounds the activations and the cache)
CACHE_BLOCK = 16

# Built-in calibration text: varied registers (prose, dialogue, code, lists, numbers, other scripts), for a
# quick run; a real calibration set (--calibration FILE) of a few hundred thousand tokens calibrates better.
BUILTIN_TEXT = """\
The river had risen in the night, and by morning the lower field was a sheet of brown water with fence posts
standing in it like the masts of sunken boats. Maria stood at the kitchen window with a cup of coffee going cold
in her hands and tried to remember whether the seed potatoes were still in the shed or already in the ground.

"You can't plant anything in that," her brother said from the doorway. "Give it a week. The ground will drain."
"A week is a long time in April," she said, and put the cup down.

Photosynthesis converts light energy into chemical energy. In the light-dependent reactions, water is split and
oxygen released; the energy captured is stored as ATP and NADPH, which the Calvin cycle then uses to fix carbon
dioxide into three-carbon sugars. The enzyme RuBisCO, which catalyses the first step of carbon fixation, is
thought to be the most abundant protein on Earth.

def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    \"\"\"Merge overlapping closed intervals; the result is sorted by start.\"\"\"
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged

SELECT customer_id, COUNT(*) AS orders, SUM(total) AS revenue
FROM orders WHERE created_at >= '2024-01-01' GROUP BY customer_id HAVING COUNT(*) > 3 ORDER BY revenue DESC;

Q: What is the derivative of x^3 * sin(x)?
A: By the product rule, d/dx [x^3 sin x] = 3x^2 sin x + x^3 cos x.

Shopping list: 2 kg flour, 12 eggs, 500 g butter, 1 litre milk, yeast, salt, 3 lemons, a bunch of parsley.

The committee's report, published on Tuesday, found that average waiting times had fallen from 41 to 29 days
between 2019 and 2023, although the improvement was uneven: rural districts saw almost no change, while the
three largest cities accounted for nearly 70 per cent of the reduction.

机器学习是人工智能的一个分支，它使计算机能够在没有明确编程的情况下从数据中学习。常见的方法包括监督学习、
无监督学习和强化学习。

La lumière du matin traversait les rideaux et dessinait sur le parquet des rectangles pâles. Elle se leva sans
bruit, prit son manteau et sortit dans la rue encore vide.

{"id": 4821, "name": "sensor-07", "readings": [21.4, 21.9, 22.3, 22.1], "unit": "celsius", "ok": true}

In 1854 John Snow traced a cholera outbreak in Soho to a single water pump on Broad Street by mapping the cases
street by street; when the pump handle was removed, new cases fell away. The episode is often told as the birth of
modern epidemiology, though the decline had begun before the handle came off.

To install the package, run `pip install qv`, then start the server with `qv serve --model /path/to/model`.
Requests follow the OpenAI API: POST /v1/chat/completions with a JSON body naming the model and the messages.

User: Can you help me write a polite email declining a meeting?
Assistant: Of course. "Dear Dr. Chen, thank you for the invitation to Thursday's meeting. Unfortunately I have a
prior commitment at that time and will not be able to attend. I would be glad to review the notes afterwards and
follow up with any questions. Best regards, Sam."
"""


def calibration_texts(source: str | None) -> list[str]:
    """The calibration documents: `source` a .jsonl file (one JSON object a line with a "text" string), any
    other text file (documents split at blank lines), or None for the built-in text."""
    if source is None:
        return [p for p in BUILTIN_TEXT.split("\n\n") if p.strip()]
    path = Path(source)
    if not path.is_file():
        raise ConfigError(f"--calibration {source}: no such file")
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--calibration {source} line {i}: not JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ConfigError(f"--calibration {source} line {i}: expected an object with a \"text\" string")
            texts.append(row["text"])
    else:
        texts = [p for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    if not texts:
        raise ConfigError(f"--calibration {source}: no text in it")
    return texts


def calibration_ids(tokenizer, texts: list[str], num_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """num_samples windows of seq_len token ids [S, L] from the documents' token stream (documents shuffled
    and joined by blank lines; windows at seeded random offsets, non-overlapping while the stream allows)."""
    if num_samples < 1 or seq_len < 2:
        raise ConfigError(f"calibration needs at least 1 sample of 2 tokens (got {num_samples} of {seq_len})")
    rng = random.Random(seed)
    docs = list(texts)
    rng.shuffle(docs)
    stream = tokenizer("\n\n".join(docs), add_special_tokens=False)["input_ids"]
    if len(stream) < seq_len:  # a short text repeats (the built-in one at long lengths)
        stream = stream * math.ceil(seq_len / max(len(stream), 1))
    windows = len(stream) // seq_len
    starts = [w * seq_len for w in range(windows)]
    rng.shuffle(starts)
    while len(starts) < num_samples:
        starts.append(rng.randrange(len(stream) - seq_len + 1))
    return torch.tensor([stream[s:s + seq_len] for s in starts[:num_samples]], dtype=torch.int64)


def load_calibration_tokenizer(src: Path):
    from transformers import AutoTokenizer

    if not any((src / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise ConfigError(f"{src} has no tokenizer: GPTQ tokenizes its calibration text with the checkpoint's "
                          "tokenizer (add its tokenizer files, or use --method rtn)")
    return AutoTokenizer.from_pretrained(str(src))


# ---------------------------------------------------------------------------------------------
# one weight
# ---------------------------------------------------------------------------------------------


def quant_params(x: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (fp16-representable, as stored) and true zero (float) [G, N] of groups x [G, g, N]: GPTQ's
    quantizer ranges, shared with round-to-nearest (qv/model/quantize.py)."""
    top = (1 << bits) - 1
    if sym:
        amax = x.abs().amax(1)
        scale = torch.where(amax > 0, 2 * amax / top, torch.ones_like(amax))
        zero = torch.full_like(scale, 1 << (bits - 1))
    else:
        lo, hi = x.amin(1).clamp_max(0), x.amax(1).clamp_min(0)
        empty = (lo == 0) & (hi == 0)
        lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
        scale = (hi - lo) / top
        zero = torch.round(-lo / scale)
        # v1 stores zero - 1 in `bits` bits, so a zero of 0 cannot be written (it would read back as 2^bits):
        # such groups use zero 1 with a scale that still spans [lo, hi].
        low = zero < 1
        scale, zero = torch.where(low, hi / (top - 1), scale), torch.where(low, torch.ones_like(zero), zero)
    return scale.clamp_min(2.0**-24).half().float(), zero


@dataclass
class QuantizedWeight:
    """One module's result: codes uint8 [K, N], scales fp16 [G, N], true zeros int32 [G, N], g_idx int32 [K]."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]."""
        g = self.g_idx.long()
        return ((self.codes.float() - self.zeros.float()[g]) * self.scales.float()[g]).t()


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int, sym: bool,
                  damp: float = 0.01, act_order: bool = True, static_groups: bool = False) -> QuantizedWeight:
    """GPTQ of a dense weight w [N, K] under its inputs' Hessian [K, K] (fp32 math on w's device)."""
    n, k = w.shape
    top = (1 << bits) - 1
    group = k if group_size == -1 else group_size
    W = w.float().clone()
    H = hessian.float().clone()
    dead = torch.diag(H) == 0  # inputs never active: their columns cannot matter, quantize them as zeros
    H[dead, dead] = 1
    W[:, dead] = 0
    static = None
    if static_groups or group_size == -1:  # group parameters on the natural column order, fixed up front
        static = quant_params(W.t().reshape(k // group, group, n), bits, sym)
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k, device=W.device)
    group_of = (perm // group).tolist()  # natural group of each permuted column, on the host (no sync a column)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(k, device=W.device)
    hinv = _upper_inverse_cholesky(H, damp)
    codes = torch.empty(n, k, dtype=torch.uint8, device=W.device)
    scales, zeros = [], []
    scale = zero = None
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)
        w1, err1, h1 = W[:, i1:i2].clone(), torch.zeros(n, i2 - i1, device=W.device), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if static is not None:
                scale, zero = static[0][group_of[col]], static[1][group_of[col]]
            elif col % group == 0:  # a new group in the permuted order: its range from the updated columns
                span = torch.cat([w1[:, i:], W[:, i2:]], 1)[:, :group]
                s, z = quant_params(span.t()[None], bits, sym)
                scale, zero = s[0], z[0]
                scales.append(scale)
                zeros.append(zero)
            c = w1[:, i]
            q = torch.clamp(torch.round(c / scale) + zero, 0, top)
            codes[:, col] = q.to(torch.uint8)
            e = (c - scale * (q - zero)) / h1[i, i]
            w1[:, i:] -= e[:, None] * h1[i, i:][None, :]
            err1[:, i] = e
        W[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    inv = torch.argsort(perm)
    if static is not None:
        s_all, z_all = static
        g_idx = torch.arange(k, device=W.device, dtype=torch.int32) // group
    else:
        s_all, z_all = torch.stack(scales), torch.stack(zeros)
        g_idx = (torch.arange(k, device=W.device, dtype=torch.int32) // group)[inv]
    return QuantizedWeight(codes[:, inv].t().contiguous(), s_all.half(), z_all.to(torch.int32), g_idx.to(torch.int32))


def _upper_inverse_cholesky(H: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of H^-1 (GPTQ's row-wise update coefficients); more damping if H is not
    positive definite in fp32."""
    extra = damp
    for _ in range(6):
        try:
            L = torch.linalg.cholesky(H)
            return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
        except torch.linalg.LinAlgError:
            extra *= 10
            H = H + extra * torch.mean(torch.diag(H)) * torch.eye(H.shape[0], device=H.device)
    raise RuntimeError("GPTQ: the Hessian is not positive definite even with heavy damping")


# ---------------------------------------------------------------------------------------------
# layer by layer over the model
# ---------------------------------------------------------------------------------------------


class _HessianRecorder:
    """Stands in for a Linear during the recording pass: adds its inputs to H = 2/n X^T X and runs it."""

    def __init__(self, linear: Linear):
        self.linear = linear
        self.hessian: torch.Tensor | None = None
        self.tokens = 0

    def __call__(self, x: torch.Tensor, delta_rows=None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        m = x2.shape[0]
        if self.hessian is None:
            self.hessian = torch.zeros(x2.shape[1], x2.shape[1], device=x2.device)
        total = self.tokens + m
        self.hessian.mul_(self.tokens / total).addmm_(x2.t(), x2, alpha=2 / total)
        self.tokens = total
        return self.linear(x, delta_rows)

    @property
    def weight(self):
        return self.linear.weight


def _layer_modules(layer, prefix: str) -> list[tuple[str, object, str, int, int]]:
    """(checkpoint module, owner object, attribute or parts index, column start, end) of each linear of a
    decoder layer, in the FusedLinear member order the builder used."""
    out = []
    mixer = layer.mixer
    if layer.kind == "full_attention":
        fused = [(mixer.qkv, ["q_proj", "k_proj", "v_proj"], "self_attn.")]
        single = [(mixer, "o_proj", "self_attn.o_proj")]
    else:
        fused = [(mixer.in_proj, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"], "linear_attn.")]
        single = [(mixer, "out_proj", "linear_attn.out_proj")]
    fused.append((layer.mlp.gate_up, ["gate_proj", "up_proj"], "mlp."))
    single.append((layer.mlp, "down", "mlp.down_proj"))
    for f, names, sub in fused:
        for i, name in enumerate(names):
            part, start, end = f.member(i)
            out.append((prefix + sub + name, f, f.parts.index(part), start, end))
    for owner, attr, name in single:
        out.append((prefix + name, owner, attr, 0, getattr(owner, attr).out_features))
    return out


def _get(owner, slot):
    return owner.parts[slot] if isinstance(owner, FusedLinear) else getattr(owner, slot)


def _set(owner, slot, value) -> None:
    if isinstance(owner, FusedLinear):
        owner.parts[slot] = value
    else:
        setattr(owner, slot, value)


class _Progress:
    """tqdm when it is installed, else one plain line a step on stderr."""

    def __init__(self, total: int, desc: str):
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="layer")
        except ImportError:  # pragma: no cover
            self.bar = None
        self.total, self.desc, self.done = total, desc, 0

    def step(self, note: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(1)
        else:  # pragma: no cover
            print(f"{self.desc} {self.done}/{self.total}: {note}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class GPTQReport:
    """What a run did: per module its relative output error on the calibration set, and the peak memory."""

    errors: dict[str, float]
    peak_device_bytes: int
    peak_host_bytes: int

    def summary(self) -> str:
        worst = max(self.errors.items(), key=lambda kv: kv[1]) if self.errors else ("-", 0.0)
        mean = sum(self.errors.values()) / max(len(self.errors), 1)
        dev = f"peak device memory {self.peak_device_bytes / 2**30:.2f} GiB, " if self.peak_device_bytes else ""
        return (f"GPTQ: {len(self.errors)} modules, mean relative output error {mean:.3e} (worst {worst[1]:.3e} "
                f"{worst[0]}); {dev}peak host memory {self.peak_host_bytes / 2**30:.2f} GiB")


def gptq_layers(src: Path, cfg: ModelConfig, quantize: set[str], ids: torch.Tensor, bits: int, group_size: int,
                sym: bool, damp: float, act_order: bool, static_groups: bool,
                device: torch.device | str) -> tuple[dict[str, QuantizedWeight], GPTQReport]:
    """GPTQ of the decoder layers' modules in `quantize` (checkpoint module names) over calibration ids [S, L];
    returns each module's QuantizedWeight (on the host) and the report."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    reader = CheckpointReader(str(src), cfg)
    p = cfg.weight_prefix
    num, length = ids.shape
    per_batch = max(1, BATCH_TOKENS // length)
    blocks_per_seq = -(-length // CACHE_BLOCK)
    cache = allocate_cache(cfg, per_batch * blocks_per_seq, CACHE_BLOCK, per_batch, torch.float32, torch.float32,
                           torch.float32, device)
    embed = reader.tensor(f"{p}embed_tokens.weight", torch.float32, device, shape=(cfg.vocab_size, cfg.hidden_size))
    hidden = embed[ids.to(device)]  # [S, L, H]
    del embed
    residual = None
    builder = LayerBuilder(cfg, reader, torch.float32, device)
    results: dict[str, QuantizedWeight] = {}
    errors: dict[str, float] = {}
    bar = _Progress(cfg.num_hidden_layers, "gptq")
    for index, kind in enumerate(cfg.layer_types):
        layer = builder.decoder_layer(index, kind, f"{p}layers.{index}.")
        modules = [m for m in _layer_modules(layer, f"{p}layers.{index}.") if m[0] in quantize]
        recorders: dict[tuple[int, object], _HessianRecorder] = {}
        for _, owner, slot, _, _ in modules:
            key = (id(owner), slot)
            if key not in recorders:
                recorders[key] = _HessianRecorder(_get(owner, slot))
                _set(owner, slot, recorders[key])
        _run_layer(layer, hidden, residual, cache, per_batch, blocks_per_seq)  # record
        for _, owner, slot, _, _ in modules:  # the layer's own linears back
            if isinstance(_get(owner, slot), _HessianRecorder):
                _set(owner, slot, _get(owner, slot).linear)
        for module, owner, slot, start, end in modules:
            linear = _get(owner, slot)
            h = recorders[(id(owner), slot)].hessian
            w = linear.weight[start:end]
            qw = gptq_quantize(w, h, bits, group_size, sym, damp, act_order, static_groups)
            deq = qw.dequantize()
            errors[module] = _relative_output_error(w, deq, h)
            linear.weight[start:end] = deq.to(linear.weight.dtype)
            results[module] = QuantizedWeight(qw.codes.cpu(), qw.scales.cpu(), qw.zeros.cpu(), qw.g_idx.cpu())
        recorders.clear()
        hidden, residual = _run_layer(layer, hidden, residual, cache, per_batch, blocks_per_seq)
        worst = max((errors[m[0]] for m in modules), default=0.0)
        bar.step(f"layer {index} ({kind}): worst relative output error {worst:.2e}")
        del layer
    bar.close()
    peak_dev = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    peak_host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return results, GPTQReport(errors, peak_dev, peak_host)


def _relative_output_error(w: torch.Tensor, deq: torch.Tensor, hessian: torch.Tensor) -> float:
    """||(W - Q) X|| / ||W X|| over the calibration inputs, from their Hessian: tr(D H D^T) / tr(W H W^T)."""
    d = (w.float() - deq)
    num = torch.sum((d @ hessian) * d)
    den = torch.sum((w.float() @ hessian) * w.float())
    return float((num / den.clamp_min(1e-30)).clamp_min(0).sqrt())


@torch.inference_mode()
def _run_layer(layer, hidden: torch.Tensor, residual: torch.Tensor | None, cache, per_batch: int,
               blocks_per_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer over every calibration sequence, per_batch sequences a prefill; returns (hidden, residual)
    [S, L, H] as the next layer takes them."""
    num, length, width = hidden.shape
    out_h, out_r = torch.empty_like(hidden), torch.empty_like(hidden)
    device = hidden.device
    for s0 in range(0, num, per_batch):
        b = min(per_batch, num - s0)
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(b)]
        batch = build_step_batch([length] * b, [length] * b, tables, list(range(b)), CACHE_BLOCK, device)
        positions = torch.arange(length, device=device).repeat(b)
        h = hidden[s0:s0 + b].reshape(b * length, width)
        r = None if residual is None else residual[s0:s0 + b].reshape(b * length, width)
        h, r = layer(h, r, positions, batch, cache)
        out_h[s0:s0 + b], out_r[s0:s0 + b] = h.view(b, length, width), r.view(b, length, width)
    return out_h, out_r
