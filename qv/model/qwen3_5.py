"""The Qwen3.5 hybrid text model: embeddings, Gated DeltaNet and gated full-attention decoder
layers (each followed by a SwiGLU MLP), final norm and lm_head (tied or not).

The forward takes a flat batch of tokens described by a StepBatch, never a padded [B, T]
tensor, so the engine drives prefill chunks, decodes and speculative rows in one call.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from qv import kernels as K
from qv.kernels.cuda_build import same_kernels_as_capture
from qv.kernels.linear import GPTQWeight, few_row_limit
from qv.model.batch import StepBatch
from qv.model.cache import HybridCache
from qv.model.layers import MLP, FusedLinear, GatedAttention, GatedDeltaNet, Linear
from qv.model.parallel import (TPGroup, VocabParallelLMHead, rank_config, shard_linear, shard_rows,
                               vocab_parallel_embed, vocab_range, vocab_shard)
from qv.model.weights import CheckpointError, CheckpointReader
from qv.model_config import ModelConfig


PROGRESS_BYTES = 1 << 30  # checkpoints larger than this show a progress bar while loading


class DecoderLayer:
    def __init__(self, index: int, kind: str, mixer, mlp: MLP, input_norm: torch.Tensor, post_norm: torch.Tensor,
                 eps: float):
        self.index, self.kind = index, kind
        self.mixer, self.mlp = mixer, mlp
        self.input_norm, self.post_norm, self.eps = input_norm, post_norm, eps

    def __call__(self, h, residual, positions, batch: StepBatch, cache: HybridCache):
        core_in, carry = self.before_core(h, residual, positions, batch.delta_rows)
        return self.after_core(self.core(core_in, batch, cache), carry, batch.delta_rows)

    # A layer in three parts, so that a forward can replay its token-wise parts from CUDA graphs captured per
    # row count and run only the parts across rows (attention, the GDN recurrence) eagerly between them
    # (qv/engine/piecewise_graphs.py). The token-wise parts read nothing of the batch but the delta rows.
    def before_core(self, h, residual, positions, delta_rows) -> tuple[list, list]:
        """(the core's inputs, what after_core takes besides the core's output: the mixer's, then the residual)."""
        if residual is None:
            x, residual = K.rms_norm(h, self.input_norm, self.eps), h
        else:
            x, residual = K.rms_norm(h, self.input_norm, self.eps, residual)
        if self.kind == "full_attention":
            core_in, carry = self.mixer.before_core(x, positions, delta_rows)
        else:
            core_in, carry = self.mixer.before_core(x, delta_rows)
        return core_in, carry + [residual]

    def core(self, core_in: list, batch: StepBatch, cache: HybridCache) -> torch.Tensor:
        """The mixer's part across rows: [T, mixer.core_width]."""
        if self.kind == "full_attention":
            return self.mixer.core(core_in, batch, cache.kv[self.index])
        return self.mixer.core(core_in, batch, cache.gdn[self.index], self.index)

    def after_core(self, o: torch.Tensor, carry: list, delta_rows):
        """(the layer's output, the residual)."""
        *mixer_carry, residual = carry
        h = self.mixer.after_core(o, mixer_carry, delta_rows)
        x, residual = K.rms_norm(h, self.post_norm, self.eps, residual)
        return self.mlp(x, delta_rows), residual


class Qwen3_5TextModel:
    """Call `forward` for final-norm hidden states and `compute_logits` for the rows that need them.
    Under tensor parallelism (`tp`) `cfg` is the rank's view (its head counts), `embed_tokens` the
    rank's vocabulary rows from `vocab_start`, and logits come back whole on every rank."""

    def __init__(self, cfg: ModelConfig, embed_tokens: torch.Tensor, layers: list[DecoderLayer],
                 norm: torch.Tensor, lm_head: Linear, tp: TPGroup | None = None, vocab_start: int = 0):
        self.cfg = cfg
        self.embed_tokens, self.layers, self.norm, self.lm_head = embed_tokens, layers, norm, lm_head
        self.tp, self.vocab_start = tp, vocab_start

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None and self.tp.world_size > 1:
            return vocab_parallel_embed(self.embed_tokens, input_ids, self.vocab_start, self.tp)
        return self.embed_tokens[input_ids]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch, cache: HybridCache,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T]; positions [T] or [3, T] (mRoPE); returns final-norm hidden states [T, H]."""
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, positions, batch, cache)
        return self.final_norm(h, residual)

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out, _ = K.rms_norm(h, self.norm, self.cfg.rms_norm_eps, residual)
        return out

    def linear_row_limit(self) -> int | None:
        """The most rows the decoder's linears take on their few-row kernels (qv.kernels.linear.few_row_limit, by
        the first MLP's down projection: the largest, in the checkpoint's main format); None where there is no such
        edge."""
        return few_row_limit(self.layers[0].mlp.down.weight, self.device, self.dtype) if self.layers else None

    @torch.inference_mode()
    def kernels_as_captured(self):
        """A context within which this thread's eager forwards run the kernels a CUDA graph capture
        would pick (raw-CUDA twins of small Triton calls), so an eager forward checks a replay kernel
        for kernel; the model layer owns that choice, not the engine."""
        return same_kernels_as_capture()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] -> fp32 logits [R, vocab]."""
        return self.lm_head(hidden).float()


def held_bytes(*objs) -> int:
    """Bytes of the tensor storages reachable from `objs` through attributes, lists, tuples and dicts,
    each storage once (fused weights and their split views share one): what a model holds resident."""
    seen_objs, storages = set(), {}
    stack = list(objs)
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in seen_objs or isinstance(obj, (str, bytes, int, float, bool)):
            continue
        seen_objs.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            storages[(st.device, st.data_ptr())] = st.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return sum(storages.values())


# ---------------------------------------------------------------------------------------------
# building from a checkpoint
# ---------------------------------------------------------------------------------------------


def load_text_model(model_dir: str, cfg: ModelConfig | None = None, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", ignore_prefixes: tuple[str, ...] = ("mtp.", "model.visual."),
                    reader=None, tp: TPGroup | None = None) -> Qwen3_5TextModel:
    """Build the text model from `model_dir` (or `reader`: a CheckpointReader or RandomReader). Tensors
    not used by it and not under `ignore_prefixes` are an error (a wrong or mixed-up checkpoint).
    With `tp`, this rank's shard: every tensor is read whole and cut as it is read."""
    cfg = cfg or ModelConfig.from_dir(model_dir)
    reader = reader or CheckpointReader(model_dir, cfg)
    model = build_text_model(cfg, reader, dtype, device, tp)
    extra = reader.unused(ignore_prefixes)
    if extra:
        shown = ", ".join(extra[:8]) + (f" (+{len(extra) - 8} more)" if len(extra) > 8 else "")
        raise CheckpointError(f"checkpoint has tensors qv does not know: {shown}")
    return model


class LayerBuilder:
    """Builds layers from checkpoint tensors by their HF names (shared by the text model and the MTP head).
    `cfg` is the checkpoint's geometry (what is read); with `tp` the layers get the rank's view and
    each tensor is cut for the rank as it is read (random weights too: the full tensor, then the slice)."""

    def __init__(self, cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype, device: torch.device | str,
                 tp: TPGroup | None = None):
        self.cfg, self.reader, self.dtype, self.device, self.tp = cfg, reader, dtype, device, tp
        self.world = 1 if tp is None else tp.world_size
        self.rank_cfg = rank_config(cfg, self.world)

    def lin(self, name: str, n: int, k: int, split: str | None = None, pieces: list[int] | None = None) -> Linear:
        """Module `name` [n, k]; `split` "column" (each of `pieces` of n) or "row" under tensor parallelism."""
        r = self.reader
        bias = None
        if r.has(f"{name}.bias") and not r.has(f"{name}.qweight"):
            bias = r.tensor(f"{name}.bias", self.dtype, self.device, shape=(n,))
        return shard_linear(r.linear(name, n, k, self.dtype, self.device), bias, split, self.tp, name, pieces)

    def vec(self, name: str, n: int, pieces: list[int] | None = None) -> torch.Tensor:
        """1-D tensor `name` [n]; with `pieces`, the rank's block of each (per-head vectors)."""
        t = self.reader.tensor(name, torch.float32, self.device, shape=(n,))
        return t if pieces is None or self.tp is None else shard_rows(t, pieces, self.tp, name)

    def attention(self, ap: str) -> GatedAttention:
        cfg, w = self.cfg, self.world
        h, d = cfg.hidden_size, cfg.head_dim
        if not cfg.attn_output_gate:
            raise CheckpointError("attn_output_gate=false is not supported: Qwen3.5 attention is gated")
        q_out, kv_out = cfg.num_attention_heads * d * 2, cfg.num_key_value_heads * d
        qkv = FusedLinear([self.lin(ap + "q_proj", q_out, h, "column"), self.lin(ap + "k_proj", kv_out, h, "column"),
                           self.lin(ap + "v_proj", kv_out, h, "column")], [q_out // w, kv_out // w, kv_out // w])
        return GatedAttention(self.rank_cfg, qkv, self.lin(ap + "o_proj", h, cfg.num_attention_heads * d, "row"),
                              self.vec(ap + "q_norm.weight", d), self.vec(ap + "k_norm.weight", d))

    def gdn(self, gp: str) -> GatedDeltaNet:
        cfg, w = self.cfg, self.world
        h, hv = cfg.hidden_size, cfg.linear_num_value_heads
        conv_dim, kd, vd = cfg.linear_conv_dim, cfg.linear_key_dim, cfg.linear_value_dim
        channels = [kd, kd, vd]  # q | k by key heads, v by value heads
        in_proj = FusedLinear([self.lin(gp + "in_proj_qkv", conv_dim, h, "column", channels),
                               self.lin(gp + "in_proj_z", vd, h, "column"), self.lin(gp + "in_proj_b", hv, h, "column"),
                               self.lin(gp + "in_proj_a", hv, h, "column")], [conv_dim // w, vd // w, hv // w, hv // w])
        width = cfg.linear_conv_kernel_dim
        conv = self.reader.tensor(gp + "conv1d.weight", self.dtype, self.device, shape=(conv_dim, 1, width))
        if self.tp is not None:
            conv = shard_rows(conv, channels, self.tp, gp + "conv1d.weight")
        out_proj = self.lin(gp + "out_proj", h, vd, "row")
        return GatedDeltaNet(self.rank_cfg, in_proj, out_proj, conv[:, 0, :].contiguous(),
                             self.vec(gp + "A_log", hv, [hv]), self.vec(gp + "dt_bias", hv, [hv]),
                             self.vec(gp + "norm.weight", cfg.linear_value_head_dim))  # per head dim: shared

    def mlp(self, mp: str) -> MLP:
        h, inter = self.cfg.hidden_size, self.cfg.intermediate_size
        gate_up = FusedLinear([self.lin(mp + "gate_proj", inter, h, "column"),
                               self.lin(mp + "up_proj", inter, h, "column")], [inter // self.world] * 2)
        return MLP(gate_up, self.lin(mp + "down_proj", h, inter, "row"))

    def decoder_layer(self, index: int, kind: str, lp: str) -> DecoderLayer:
        mixer = self.attention(lp + "self_attn.") if kind == "full_attention" else self.gdn(lp + "linear_attn.")
        h = self.cfg.hidden_size
        return DecoderLayer(index, kind, mixer, self.mlp(lp + "mlp."), self.vec(lp + "input_layernorm.weight", h),
                            self.vec(lp + "post_attention_layernorm.weight", h), self.cfg.rms_norm_eps)


def read_output_embedding(cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype,
                          device: torch.device | str) -> torch.Tensor | GPTQWeight:
    """The whole output embedding [V, H] (the lm_head, or the embedding it is tied to), read again: a
    tensor-parallel rank's lm_head holds only its vocabulary slice."""
    if cfg.tie_word_embeddings:
        return reader.tensor(f"{cfg.weight_prefix}embed_tokens.weight", dtype, device, shape=(cfg.vocab_size, cfg.hidden_size))
    return reader.linear("lm_head", cfg.vocab_size, cfg.hidden_size, dtype, device)


def build_text_model(cfg: ModelConfig, reader: CheckpointReader, dtype: torch.dtype,
                     device: torch.device | str, tp: TPGroup | None = None) -> Qwen3_5TextModel:
    p, h = cfg.weight_prefix, cfg.hidden_size
    b = LayerBuilder(cfg, reader, dtype, device, tp)
    embed = reader.tensor(f"{p}embed_tokens.weight", dtype, device, shape=(cfg.vocab_size, h))
    parallel = tp is not None and tp.world_size > 1
    if parallel:
        embed = vocab_shard(embed, tp)
    big = reader.nbytes() > PROGRESS_BYTES
    layers = [b.decoder_layer(i, kind, f"{p}layers.{i}.")
              for i, kind in tqdm(list(enumerate(cfg.layer_types)), desc="loading layers", unit="layer",
                                  disable=not big)]
    norm = b.vec(f"{p}norm.weight", h)
    if cfg.tie_word_embeddings:
        lm_head = VocabParallelLMHead(embed, cfg.vocab_size, tp) if parallel else Linear(embed)
        if reader.has("lm_head.weight"):
            reader.used.add("lm_head.weight")  # some writers store the tied copy too
    elif parallel:
        if reader.has("lm_head.bias"):
            raise CheckpointError("lm_head.bias under tensor parallelism is not built: qv's lm_head shards carry none")
        lm_head = VocabParallelLMHead(vocab_shard(reader.linear("lm_head", cfg.vocab_size, h, dtype, device), tp),
                                      cfg.vocab_size, tp)
    else:
        lm_head = b.lin("lm_head", cfg.vocab_size, h)
    return Qwen3_5TextModel(b.rank_cfg, embed, layers, norm, lm_head, tp, vocab_range(cfg.vocab_size, tp)[0]
                            if parallel else 0)
