"""Clef's joint schema head (JointSchemaHead in Cloudflare's joint_schema_model.py) in qv's own
torch code, fed chunk by chunk with the final-norm hidden states of a record's rows.

What the head reads of the hidden states, and what qv therefore keeps per record:
  * memory    [T, W]  memory_projection(LayerNorm(h)) of every token: the keys/values of all its
                      cross-attention (evidence routing and decoder layers)
  * span sums [S, H]  sums of LayerNorm(h) over each question span and option span (S <= 64+448)
  * global    [H]     LayerNorm(h) of the last token
plus, from the token ids alone, the lexical vectors [O, H] (mean output-embedding row of each
option's tokens). The full hidden states [T, H] are never kept, and attention over the memory
runs in key blocks with an online softmax, so no [T, W] temporary per layer exists either.

Memory of one record (persistent, bytes):  T*W*m + (S + O + 1)*H*4   (m = memory dtype size,
S = questions + options <= 64 + 448, O = options <= 448). Transient: add_chunk of n rows holds
n*H*4 (normalised rows) + S'*n*4 (span indicator, S' = spans touching the chunk); answers() holds
3*B*W*4 + heads*L*B*4 per key block (B <= KEY_BLOCK rows, heads*L*B <= SCORE_ELEMENTS); creating
the state gathers LEXICAL_BLOCK*H*4 of output-embedding rows at a time.
Worked example, 34,816 tokens of a 27B model (H = 5120) with a head of width W = 1024, fp32
memory: 34816*1024*4 = 136 MiB + (512+448+1)*5120*4 = 18.8 MiB, about 155 MiB, against 680 MiB
for the fp32 hidden states themselves (T*H*4). docs/VALIDATION.md ("Clef") has the measurements.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from qv.clef.encode import EncodedRecord, all_spans, option_token_ids
from qv.clef.limits import MAX_OPTIONS_TOTAL, MAX_QUESTIONS
from qv.kernels.linear import GPTQWeight
from qv.model.joint_head_layout import HEAD_CONFIG, HEAD_WEIGHTS, HeadConfig, expected_shapes

__all__ = ["HeadConfig", "HeadState", "JointHead", "expected_shapes", "max_state_bytes"]

KEY_BLOCK = 2048  # most memory rows per attention block: bounds the transient K/V tensors
SCORE_ELEMENTS = 1 << 22  # most attention scores per block (16 MiB fp32), whatever heads x queries
LEXICAL_BLOCK = 1024  # output-embedding rows gathered at once for the lexical vectors


def max_state_bytes(c: HeadConfig, num_tokens: int, memory_bytes: int = 4, max_questions: int = MAX_QUESTIONS,
                    max_options: int = MAX_OPTIONS_TOTAL) -> int:
    """Most bytes one record's HeadState holds between chunks (the formula above, at the request
    limits): what the engine reserves per Clef slot when it plans memory."""
    return num_tokens * c.width * memory_bytes + (max_questions + 2 * max_options + 1) * c.hidden_size * 4


class JointHead:
    """The head's weights (fp32 on one device) and the record-independent math."""

    def __init__(self, config: HeadConfig, tensors: dict[str, torch.Tensor], device: torch.device | str = "cpu"):
        shapes = expected_shapes(config)
        missing = sorted(set(shapes) - set(tensors))
        extra = sorted(set(tensors) - set(shapes))
        if missing or extra:
            raise ValueError(f"joint head tensors do not match joint_head_config: missing {missing[:6]}, "
                             f"unexpected {extra[:6]}")
        for name, shape in shapes.items():
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"joint head tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
        self.config = config
        # fp32 whatever the file holds: the head is ~1 % of the work and its softmaxes are the answer.
        self.w = {k: v.to(device=device, dtype=torch.float32) for k, v in tensors.items()}

    @classmethod
    def load(cls, folder: str | Path, device: torch.device | str = "cpu", config_dir: str | Path | None = None) -> "JointHead":
        folder = Path(folder)
        config = HeadConfig.from_json(Path(config_dir or folder) / HEAD_CONFIG)
        return cls(config, load_file(str(folder / HEAD_WEIGHTS)), device)

    @property
    def device(self) -> torch.device:
        return self.w["hidden_norm.weight"].device

    def state(self, record: EncodedRecord, output_embedding: torch.Tensor | GPTQWeight,
              memory_dtype: torch.dtype = torch.float32) -> "HeadState":
        return HeadState(self, record, output_embedding, memory_dtype)

    # ---- pieces -----------------------------------------------------------------------------
    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[name + ".weight"], self.w[name + ".bias"], 1e-5)

    def proj(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w[name + "_projection.weight"].t()

    def dense(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w[name + ".bias"])

    def self_attention(self, p: str, x: torch.Tensor) -> torch.Tensor:
        """nn.MultiheadAttention(x, x, x) with no mask, x [L, W]."""
        heads, w = self.config.heads, self.config.width
        qkv = F.linear(x, self.w[p + "in_proj_weight"], self.w[p + "in_proj_bias"])
        q, k, v = (t.reshape(-1, heads, w // heads).transpose(0, 1) for t in qkv.split(w, dim=-1))
        scores = (q * (w // heads) ** -0.5) @ k.transpose(1, 2)
        o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(-1, w)
        return self.dense(p + "out_proj", o)

    def memory_attention(self, p: str, x: torch.Tensor, memory: torch.Tensor, norm: str | None) -> torch.Tensor:
        """nn.MultiheadAttention(x, M, M) over the record memory M (LayerNorm'd by `norm` when given),
        computed over blocks of KEY_BLOCK memory rows with an online softmax."""
        heads, w = self.config.heads, self.config.width
        d = w // heads
        wq, wk, wv = self.w[p + "in_proj_weight"].split(w)
        bq, bk, bv = self.w[p + "in_proj_bias"].split(w)
        q = (F.linear(x, wq, bq) * d**-0.5).reshape(-1, heads, d).transpose(0, 1)  # [heads, L, d]
        run_max = torch.full((heads, q.shape[1], 1), -math.inf, device=x.device)
        run_sum = torch.zeros_like(run_max)
        acc = torch.zeros_like(q)
        block = max(256, min(KEY_BLOCK, SCORE_ELEMENTS // (heads * q.shape[1])))
        for start in range(0, memory.shape[0], block):
            m = memory[start:start + block].float()
            if norm is not None:
                m = self.norm(norm, m)
            k = F.linear(m, wk, bk).reshape(-1, heads, d).transpose(0, 1)
            v = F.linear(m, wv, bv).reshape(-1, heads, d).transpose(0, 1)
            scores = q @ k.transpose(1, 2)  # [heads, L, block], the one large temporary
            new_max = torch.maximum(run_max, scores.amax(-1, keepdim=True))
            p_blk = scores.sub_(new_max).exp_()
            correction = (run_max - new_max).exp()
            run_sum = run_sum * correction + p_blk.sum(-1, keepdim=True)
            acc = acc * correction + p_blk @ v
            run_max = new_max
        o = (acc / run_sum).transpose(0, 1).reshape(-1, w)
        return self.dense(p + "out_proj", o)

    def evidence_layer(self, i: int, queries: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        p = f"evidence_layers.{i}."
        queries = queries + self.memory_attention(p + "attention.", self.norm(p + "query_norm", queries), memory,
                                                  p + "memory_norm")
        ff = self.dense(p + "feedforward.3", F.gelu(self.dense(p + "feedforward.0", self.norm(p + "feedforward_norm", queries))))
        return queries + ff

    def decoder_layer(self, i: int, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """nn.TransformerDecoderLayer(norm_first=True, activation=gelu) with no masks."""
        p = f"layers.{i}."
        x = x + self.self_attention(p + "self_attn.", self.norm(p + "norm1", x))
        x = x + self.memory_attention(p + "multihead_attn.", self.norm(p + "norm2", x), memory, None)
        return x + self.dense(p + "linear2", F.gelu(self.dense(p + "linear1", self.norm(p + "norm3", x))))


def output_embedding_rows(weight: torch.Tensor | GPTQWeight, ids: torch.Tensor) -> torch.Tensor:
    """fp32 rows `ids` of the output embedding (lm_head) [V, H], dense or GPTQ (dequantized)."""
    if isinstance(weight, GPTQWeight):
        g = weight.g_idx.long()
        codes = weight.codes()[:, ids].float()  # [K, n]
        zeros = float(weight.symmetric_zero) if weight.zeros is None else weight.zeros.float()[g][:, ids]
        return ((codes - zeros) * weight.scales.float()[g][:, ids]).t()
    return weight[ids].float()


def _segment_softmax(scores: torch.Tensor, seg: torch.Tensor, n: int) -> torch.Tensor:
    """Softmax of `scores` [O] within each segment seg[o] in 0..n-1."""
    seg_max = torch.full((n,), -math.inf, device=scores.device).scatter_reduce(0, seg, scores, "amax")
    e = (scores - seg_max[seg]).exp()
    return e / torch.zeros(n, device=scores.device).index_add(0, seg, e)[seg]


class HeadState:
    """What the head keeps of one record, filled chunk by chunk in token order."""

    def __init__(self, head: JointHead, record: EncodedRecord, output_embedding: torch.Tensor | GPTQWeight,
                 memory_dtype: torch.dtype = torch.float32):
        c, dev = head.config, head.device
        self.head, self.record = head, record
        self.num_tokens = record.num_tokens
        spans, owner, counts = all_spans(record)
        self.num_questions = len(record.questions)
        self.span_list = spans  # [(start, end)] question spans, then option spans
        self.lengths = torch.tensor([e - s for s, e in spans], dtype=torch.float32, device=dev)
        self.owner = torch.tensor(owner, dtype=torch.int64, device=dev)  # option -> question
        self.counts = counts
        self.memory = torch.empty(self.num_tokens, c.width, dtype=memory_dtype, device=dev)
        self.span_sums = torch.zeros(len(spans), c.hidden_size, device=dev)
        self.global_vector = torch.zeros(c.hidden_size, device=dev)
        self.lexical = self._lexical(output_embedding)
        self.filled = 0

    def _lexical(self, weight: torch.Tensor | GPTQWeight) -> torch.Tensor:
        """Mean output-embedding row of each option's tokens, gathered in bounded blocks."""
        dev = self.head.device
        per_option = option_token_ids(self.record)
        ids = torch.tensor([t for opt in per_option for t in opt], dtype=torch.int64, device=dev)
        which = torch.repeat_interleave(torch.arange(len(per_option), device=dev),
                                        torch.tensor([len(o) for o in per_option], device=dev))
        out = torch.zeros(len(per_option), self.head.config.hidden_size, device=dev)
        for s in range(0, ids.numel(), LEXICAL_BLOCK):
            rows = output_embedding_rows(weight, ids[s:s + LEXICAL_BLOCK].to(_weight_device(weight)))
            out.index_add_(0, which[s:s + LEXICAL_BLOCK], rows.to(dev))
        return out / torch.tensor([len(o) for o in per_option], device=dev, dtype=torch.float32)[:, None]

    def nbytes(self) -> int:
        """Bytes this record's state holds between chunks."""
        ts = (self.memory, self.span_sums, self.global_vector, self.lexical)
        return sum(t.numel() * t.element_size() for t in ts)

    def reset(self) -> None:
        """Forget every chunk (a preempted record restarts from token 0 without double counting)."""
        self.span_sums.zero_()
        self.global_vector.zero_()
        self.filled = 0

    @torch.inference_mode()
    def add_chunk(self, hidden_rows: torch.Tensor, token_offset: int) -> None:
        """Take final-norm hidden states [n, H] of tokens token_offset .. token_offset+n-1."""
        n = hidden_rows.shape[0]
        if token_offset != self.filled or token_offset + n > self.num_tokens:
            raise ValueError(f"Clef head: chunk at token {token_offset} (+{n}) but {self.filled} of "
                             f"{self.num_tokens} tokens are in; chunks must come once each, in order")
        x = self.head.norm("hidden_norm", hidden_rows.to(self.head.device, torch.float32))
        end = token_offset + n
        self.memory[token_offset:end] = self.head.proj("memory", x).to(self.memory.dtype)
        # Which spans this chunk touches is decided on the host from the record's Python ints: no
        # device sync. A 0/1 indicator matmul sums their rows (deterministic, unlike atomics).
        touched = [i for i, (s, e) in enumerate(self.span_list) if s < end and e > token_offset]
        if touched:
            bounds = torch.tensor([(max(self.span_list[i][0], token_offset) - token_offset,
                                    min(self.span_list[i][1], end) - token_offset) for i in touched], device=x.device)
            pos = torch.arange(n, device=x.device)
            indicator = ((pos[None, :] >= bounds[:, :1]) & (pos[None, :] < bounds[:, 1:])).float()
            self.span_sums.index_add_(0, torch.tensor(touched, device=x.device), indicator @ x)
        if end == self.num_tokens:
            self.global_vector.copy_(x[-1])
        self.filled = end

    @torch.inference_mode()
    def logits(self) -> torch.Tensor:
        """Per-option logits [O] (question order, encoded option order)."""
        if self.filled != self.num_tokens:
            raise ValueError(f"Clef head: {self.filled} of {self.num_tokens} tokens are in; the record is incomplete")
        hd, c, nq = self.head, self.head.config, self.num_questions
        means = self.span_sums / self.lengths[:, None]
        qvec, context, g = means[:nq], means[nq:], self.global_vector
        seg = self.owner
        queries = hd.proj("option_context", context) + hd.proj("option_lexical", self.lexical) \
            + hd.proj("option_question", qvec)[seg]
        for i in range(c.routing_layers):
            queries = hd.evidence_layer(i, queries, self.memory)
        base = hd.proj("question", qvec)
        weights = _segment_softmax((queries * base[seg]).sum(-1) / math.sqrt(c.width), seg, nq)
        summaries = torch.zeros(nq, c.width, device=queries.device).index_add(0, seg, weights[:, None] * queries)
        types = torch.tensor([q.question_type for q in self.record.questions], device=queries.device)
        fields = base + hd.norm("option_summary_norm", summaries) + hd.proj("global", g)[None] \
            + hd.w["type_embedding.weight"][types]
        for i in range(c.layers):
            fields = hd.decoder_layer(i, fields, self.memory)
        fields = hd.norm("field_norm", fields)[seg]
        anchor = F.normalize(qvec + g[None], dim=-1)[seg]
        prior = hd.w["prior_logit_scale"].clamp(max=math.log(100.0)).exp() * (F.normalize(self.lexical, dim=-1) * anchor).sum(-1)
        options = hd.norm("option_norm", queries)
        cosine = F.cosine_similarity(fields, options, dim=-1)
        features = torch.cat([fields, options, fields * options, (fields - options).abs()], dim=-1)
        residual = hd.dense("residual_scorer.3", F.gelu(hd.dense("residual_scorer.0", features))).squeeze(-1)
        joint = hd.w["joint_logit_scale"].clamp(max=math.log(100.0)).exp() * cosine + residual
        return prior + torch.sigmoid(hd.w["residual_gate"]) * joint

    def probabilities(self) -> list[list[float]]:
        """Softmax over each question's options, as Python floats (encoded option order)."""
        logits = self.logits()
        return [part.softmax(-1).tolist() for part in logits.split(self.counts)]


def _weight_device(weight: torch.Tensor | GPTQWeight) -> torch.device:
    return weight.qweight.device if isinstance(weight, GPTQWeight) else weight.device
