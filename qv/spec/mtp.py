"""The checkpoint's multi-token-prediction head as a drafter (Qwen3.5 `mtp.*` tensors).

For position p it reads the target's final-norm hidden state h_p and the embedding of token p+1:
    x = fc([norm_e(embed(t_{p+1})) | norm_h(h_p)])     (embedding first, hidden second)
    x = one gated full-attention decoder layer (own paged KV, target's block tables)
    out = norm(x + residual);  logits = target lm_head(out)  -> predicts t_{p+2}
Embedding and lm_head are the target's (shared, not copied). Drafting k tokens feeds each output
state and argmax back in at the next position (shared/research/qwen35.md §2.3-2.4). The argmax of a few
rows comes from the fused lm_head top-1 over an int4 ranking copy of the lm_head (no [rows, vocab] logits).
"""

from __future__ import annotations

import torch

from qv import kernels as K
from qv.kernels.lm_head_top1 import is_row_int8
from qv.model.batch import StepBatch
from qv.model.cache import HybridCache
from qv.model.layers import Linear
from qv.model.qwen3_5 import DecoderLayer, LayerBuilder, Qwen3_5TextModel
from qv.model.weights import CheckpointError, CheckpointReader
from qv.model_config import ModelConfig


# rows up to which the fused top-1 drafts; past it the logits GEMM on tensor cores and an argmax cost less
# than the top-1's multiply-adds on CUDA cores (python bench/lm_head_top1.py)
TOP1_MAX_ROWS = 4


class MTPHead:
    def __init__(self, cfg: ModelConfig, target: Qwen3_5TextModel, fc: Linear, norm_embedding: torch.Tensor,
                 norm_hidden: torch.Tensor, layer: DecoderLayer, norm: torch.Tensor, ranking=None):
        self.cfg, self.target = cfg, target
        self.fc, self.norm_embedding, self.norm_hidden = fc, norm_embedding, norm_hidden
        self.layer, self.norm = layer, norm
        self.ranking = ranking  # K.Top1Ranking of the lm_head's vocabulary rows, or None: drafts from full logits

    @property
    def layer_index(self) -> int:
        return self.layer.index

    @torch.inference_mode()
    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, batch: StepBatch,
                cache: HybridCache) -> torch.Tensor:
        """next_ids [R] (token after each row's position), hidden [R, H] (target or previous MTP output),
        positions [R]; writes the head's KV for those positions; returns its output states [R, H]."""
        eps = self.cfg.rms_norm_eps
        e = K.rms_norm(self.target.embed(next_ids), self.norm_embedding, eps)
        h = K.rms_norm(hidden, self.norm_hidden, eps)
        x = self.fc(torch.cat([e, h], dim=-1))
        x, residual = self.layer(x, None, positions, batch, cache)
        out, _ = K.rms_norm(x, self.norm, eps, residual)
        return out

    def draft_ids(self, out: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens [R] from output states [R, H] through the shared lm_head."""
        if self.ranking is not None and out.shape[0] <= TOP1_MAX_ROWS:
            w = self.target.lm_head.weight
            return K.lm_head_top1(out, w if isinstance(w, K.GPTQWeight) else w[:self.cfg.vocab_size], self.ranking)
        return self.target.compute_logits(out)[:, :self.cfg.vocab_size].argmax(dim=-1)


def load_mtp_head(model_dir: str, cfg: ModelConfig, target: Qwen3_5TextModel, dtype: torch.dtype,
                  device: torch.device | str, reader=None, draft_top1: bool = True, tp=None) -> MTPHead:
    """Build the head from `mtp.*` (of `reader` when given); a checkpoint without them gives a clear error.
    draft_top1: on a GPU with a dense or row-int8 lm_head (QV_LM_HEAD_INT8), also build the fused top-1's
    ranking copy of it. With `tp`
    (a TPGroup) the rank's shard: its decoder layer split as the target's (the KV heads with the rank's
    cache), fc and the norms whole; drafts then come from the vocabulary-parallel lm_head's gathered logits."""
    if cfg.mtp_num_hidden_layers < 1:
        raise CheckpointError(f"{model_dir}: config has mtp_num_hidden_layers=0, so there is no MTP head to draft "
                              f"with; use spec=ngram or spec=off")
    reader = reader or CheckpointReader(model_dir, cfg)
    if not reader.has("mtp.fc.weight") and not reader.has("mtp.fc.qweight"):
        raise CheckpointError(f"{model_dir}: config declares an MTP head but the checkpoint has no mtp.* tensors")
    b = LayerBuilder(cfg, reader, dtype, device, tp)
    h = cfg.hidden_size
    layer = b.decoder_layer(cfg.num_hidden_layers, "full_attention", "mtp.layers.0.")
    lm_head = target.lm_head.weight
    ranking = None
    whole = getattr(target.lm_head, "shard", None) is None  # a vocabulary-parallel lm_head holds a slice
    if draft_top1 and whole and isinstance(lm_head, torch.Tensor) and lm_head.is_cuda:
        ranking = K.build_top1_ranking(lm_head[:cfg.vocab_size])
    elif (draft_top1 and whole and is_row_int8(lm_head) and lm_head.qweight.is_cuda
          and lm_head.out_features == cfg.vocab_size):
        ranking = K.build_top1_ranking(lm_head)
    head = MTPHead(cfg, target, b.lin("mtp.fc", h, 2 * h), b.vec("mtp.pre_fc_norm_embedding.weight", h),
                   b.vec("mtp.pre_fc_norm_hidden.weight", h), layer, b.vec("mtp.norm.weight", h), ranking)
    extra = [n for n in reader.unused() if n.startswith("mtp.")]
    if extra:
        raise CheckpointError(f"checkpoint has mtp tensors qv does not know: {', '.join(extra[:8])}")
    return head
