"""The Qwen3.5 vision tower (HF `Qwen3_5VisionModel`): patch embedding, learned position
embeddings resampled to each image's grid, 2-D axial rotary, pre-norm ViT blocks with attention
inside each frame, and the patch merger that folds 2x2 patches into one text-width token.

One call encodes every image and video of a step: their patches are concatenated and attention
is kept inside each frame by `cu_seqlens`, so the blocks run once over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from qv import kernels as K
from qv.model.layers import Linear
from qv.model.weights import CheckpointError, CheckpointReader
from qv.model_config import ModelConfig, VisionConfig

PREFIX = "model.visual."
ROPE_THETA = 10000.0  # HF's Qwen3_5VisionConfig leaves rope_parameters to the axial default theta
LN_EPS = 1e-6  # every LayerNorm of the tower (blocks and merger)
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


@dataclass
class VisionBlock:
    norm1: tuple[torch.Tensor, torch.Tensor]  # LayerNorm (weight, bias)
    qkv: Linear
    proj: Linear
    norm2: tuple[torch.Tensor, torch.Tensor]
    fc1: Linear
    fc2: Linear


class VisionTower:
    """`forward(pixel_values, grids)` -> [sum(t*h*w) / merge^2, out_hidden_size] in the items' order."""

    def __init__(self, vc: VisionConfig, patch_embed: Linear, pos_embed: torch.Tensor, blocks: list[VisionBlock],
                 merger_norm: tuple[torch.Tensor, torch.Tensor], merger_fc1: Linear, merger_fc2: Linear):
        if vc.deepstack_visual_indexes:
            raise CheckpointError("vision deepstack (deepstack_visual_indexes) is Qwen3-VL's, not Qwen3.5's: unsupported")
        if vc.hidden_act not in _GELU:
            raise CheckpointError(f"vision hidden_act {vc.hidden_act!r} unsupported (gelu_pytorch_tanh or gelu)")
        side = int(round(vc.num_position_embeddings**0.5))
        if side * side != vc.num_position_embeddings:
            raise CheckpointError(f"num_position_embeddings {vc.num_position_embeddings} is not a square grid")
        self.vc, self.side = vc, side
        self.heads, self.head_dim = vc.num_heads, vc.hidden_size // vc.num_heads
        self.patch_embed, self.pos_embed, self.blocks = patch_embed, pos_embed, blocks
        self.merger_norm, self.merger_fc1, self.merger_fc2 = merger_norm, merger_fc1, merger_fc2
        self.act = _GELU[vc.hidden_act]
        spatial = self.head_dim // 2  # h and w each get half the head: head_dim/4 frequencies each
        self.inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))

    @property
    def device(self) -> torch.device:
        return self.pos_embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.dtype

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        """pixel_values [N, C*tp*p*p] (rows of all items, in order); grids: (t, h, w) per item."""
        vc, m = self.vc, self.vc.spatial_merge_size
        n = sum(t * h * w for t, h, w in grids)
        if n == 0:
            return torch.zeros(0, vc.out_hidden_size, dtype=self.dtype, device=self.device)
        if pixel_values.shape[0] != n or any(h % m or w % m for _, h, w in grids):
            raise ValueError(f"vision: {pixel_values.shape[0]} patch rows for grids {list(grids)} (merge {m})")
        x = self.patch_embed(pixel_values.to(self.device, self.dtype))
        rows, cols = _block_order_positions(grids, m, self.device)
        x = x + self._position_embeddings(grids, rows, cols)
        cos, sin = self._rotary(rows, cols)
        frames = [h * w for t, h, w in grids for _ in range(t)]  # attention stays inside each frame
        cu = torch.tensor([0] + frames, dtype=torch.int32, device=self.device).cumsum(0, dtype=torch.int32)
        for blk in self.blocks:
            x = x + self._attention(blk, K.layer_norm(x, *blk.norm1, LN_EPS), cos, sin, cu, max(frames))
            x = x + blk.fc2(K.gelu(blk.fc1(K.layer_norm(x, *blk.norm2, LN_EPS)), self.act))
        x = K.layer_norm(x, *self.merger_norm, LN_EPS).reshape(n // (m * m), vc.hidden_size * m * m)
        return self.merger_fc2(K.gelu(self.merger_fc1(x), "none"))

    __call__ = forward

    def _attention(self, blk: VisionBlock, x, cos, sin, cu, max_len) -> torch.Tensor:
        qkv = blk.qkv(x).view(x.shape[0], 3, self.heads, self.head_dim)
        q = K.rotary_embed(qkv[:, 0], cos, sin)
        k = K.rotary_embed(qkv[:, 1], cos, sin)
        o = K.varlen_attention(q, k, qkv[:, 2].contiguous(), cu, self.head_dim**-0.5, causal=False, max_seqlen=max_len)
        return blk.proj(o.reshape(x.shape[0], -1))

    def _rotary(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, head_dim]: angles [h-angles | w-angles] repeated twice (rotate-half layout)."""
        inv = self.inv_freq.to(self.device)
        ang = torch.cat([rows.float()[:, None] * inv, cols.float()[:, None] * inv], dim=-1)
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos(), ang.sin()

    def _position_embeddings(self, grids, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The side x side learned table resampled bilinearly (align_corners=True) to each grid,
        as 4 weighted rows per patch (HF get_vision_interpolation_indices_and_weights)."""
        sizes_h = torch.cat([torch.full((t * h * w,), h, device=self.device) for t, h, w in grids])
        sizes_w = torch.cat([torch.full((t * h * w,), w, device=self.device) for t, h, w in grids])
        h_taps, h_wts = _bilinear_taps(rows, sizes_h, self.side)
        w_taps, w_wts = _bilinear_taps(cols, sizes_w, self.side)
        idx = (h_taps[:, :, None] * self.side + w_taps[:, None, :]).reshape(-1, 4)
        wts = (h_wts[:, :, None] * w_wts[:, None, :]).reshape(-1, 4)
        return (self.pos_embed[idx].float() * wts[:, :, None]).sum(1).to(self.dtype)


def _block_order_positions(grids, m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch in the processor's order: merge blocks row-major, the m x m
    patches of a block contiguous; repeated for each frame."""
    rows, cols = [], []
    for t, h, w in grids:
        r = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        c = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        rows.append(r.permute(0, 2, 1, 3).reshape(-1).repeat(t))
        cols.append(c.permute(0, 2, 1, 3).reshape(-1).repeat(t))
    return torch.cat(rows), torch.cat(cols)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps into a `side`-long table and their weights for target positions `index` on an
    axis of length `size` (align_corners=True: the ends map to 0 and side-1)."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


# ---------------------------------------------------------------------------------------------
# building from a checkpoint
# ---------------------------------------------------------------------------------------------


def build_vision_tower(vc: VisionConfig, reader: CheckpointReader, dtype: torch.dtype,
                       device: torch.device | str) -> VisionTower:
    hs, inter, m = vc.hidden_size, vc.intermediate_size, vc.spatial_merge_size
    k_patch = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2

    def lin(name: str, n: int, k: int) -> Linear:
        return Linear(reader.linear(PREFIX + name, n, k, dtype, device),
                      reader.tensor(PREFIX + name + ".bias", dtype, device, shape=(n,)))

    def norm(name: str, d: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (reader.tensor(PREFIX + name + ".weight", dtype, device, shape=(d,)),
                reader.tensor(PREFIX + name + ".bias", dtype, device, shape=(d,)))

    # Conv3d with stride == kernel is a linear map of each flattened (C, tp, p, p) patch
    conv = reader.tensor(PREFIX + "patch_embed.proj.weight", dtype, device,
                         shape=(hs, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size))
    patch = Linear(conv.reshape(hs, k_patch), reader.tensor(PREFIX + "patch_embed.proj.bias", dtype, device, shape=(hs,)))
    pos = reader.tensor(PREFIX + "pos_embed.weight", dtype, device, shape=(vc.num_position_embeddings, hs))
    blocks = []
    for i in range(vc.depth):
        b = f"blocks.{i}."
        blocks.append(VisionBlock(norm(b + "norm1", hs), lin(b + "attn.qkv", 3 * hs, hs), lin(b + "attn.proj", hs, hs),
                                  norm(b + "norm2", hs), lin(b + "mlp.linear_fc1", inter, hs),
                                  lin(b + "mlp.linear_fc2", hs, inter)))
    merged = hs * m * m
    return VisionTower(vc, patch, pos, blocks, norm("merger.norm", hs), lin("merger.linear_fc1", merged, merged),
                       lin("merger.linear_fc2", vc.out_hidden_size, merged))


def load_multimodal_model(model_dir: str | Path, cfg: ModelConfig | None = None, dtype: torch.dtype = torch.float32,
                          device: torch.device | str = "cpu", reader=None):
    """(text model, vision tower) from one checkpoint read; any tensor neither uses (other than
    the MTP head's) is an error, so a mislabelled vision tensor cannot pass silently."""
    from qv.model.qwen3_5 import build_text_model

    cfg = cfg or ModelConfig.from_dir(model_dir)
    if cfg.vision is None:
        raise CheckpointError(f"{model_dir} has no vision_config (architecture {cfg.architecture})")
    reader = reader or CheckpointReader(model_dir, cfg)
    text = build_text_model(cfg, reader, dtype, device)
    tower = build_vision_tower(cfg.vision, reader, dtype, device)
    extra = reader.unused(("mtp.",))
    if extra:
        shown = ", ".join(extra[:8]) + (f" (+{len(extra) - 8} more)" if len(extra) > 8 else "")
        raise CheckpointError(f"checkpoint has tensors qv does not know: {shown}")
    return text, tower
