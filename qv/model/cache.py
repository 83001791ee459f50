"""The memory a hybrid model reads and writes between steps: paged KV per full-attention layer,
and conv + recurrent state slots per Gated DeltaNet layer. The engine owns which blocks and
slots belong to which request; this file only knows the shapes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qv.kernels.gated_delta_rule import INT16_MAX  # noqa: F401  (the int16 state grid of GDNState.ssm)
from qv.kernels.paged_attention.sparse import SparseKV, SparsePolicy
from qv.model_config import ModelConfig

KV_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8, "fp32": torch.float32}
STATE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "int16": torch.int16}


@dataclass
class KVCache:
    k: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v: torch.Tensor
    k_scale: torch.Tensor | None  # [num_blocks, block_size, Hkv] fp32 (int8 caches only)
    v_scale: torch.Tensor | None
    sparse: SparseKV | None = None  # sparse attention's page tables and policy (None: exact attention)


@dataclass
class GDNState:
    conv: torch.Tensor  # [slots, W-1, conv_dim]: the last W-1 pre-conv inputs
    ssm: torch.Tensor  # [slots, Hv, dk, dv]
    ssm_scale: torch.Tensor | None  # [slots, Hv, dv] fp32 (int16 state only)


@dataclass
class HybridCache:
    kv: dict[int, KVCache]  # layer index -> its KV cache
    gdn: dict[int, GDNState]  # layer index -> its state pool
    block_size: int

    @property
    def num_blocks(self) -> int:
        return next(iter(self.kv.values())).k.shape[0] if self.kv else 0

    @property
    def num_slots(self) -> int:
        return next(iter(self.gdn.values())).ssm.shape[0] if self.gdn else 0


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype, extra_layers: int = 0,
                       sparse: bool = False) -> int:
    """Bytes of one block across all attention layers (plus `extra_layers`, e.g. the MTP head's); `sparse`:
    with the model's layers' sparse attention page tables (a mean and a spread key per page and KV head)."""
    per_token_head = cfg.head_dim * torch.tensor([], dtype=kv_dtype).element_size()
    if kv_dtype == torch.int8:
        per_token_head += 4  # the fp32 scale
    layers = len(cfg.attention_layer_ids) + extra_layers
    tables = 0
    if sparse:
        tables = len(cfg.attention_layer_ids) * SparseKV.bytes_per_page(cfg.num_key_value_heads, cfg.head_dim)
    return 2 * layers * block_size * cfg.num_key_value_heads * per_token_head + tables


def prefill_workspace_bytes(cfg: ModelConfig, chunk_rows: int) -> int:
    """Device memory a prompt chunk of chunk_rows rows takes for its attention through cuDNN (sm_90): the 16-bit
    K/V workspace and padded queries of qv/kernels/paged_attention/sdpa_prefill.py."""
    from qv.kernels.paged_attention import sdpa_prefill
    from qv.kernels.paged_attention.configs import CUDNN_PIECE_TOKENS

    if not cfg.attention_layer_ids:
        return 0
    return sdpa_prefill.workspace_bytes(CUDNN_PIECE_TOKENS, chunk_rows, cfg.num_attention_heads,
                                        cfg.num_key_value_heads, cfg.head_dim)


def warm_prefill_attention(cfg: ModelConfig, chunk_rows: int, device: torch.device, dtype: torch.dtype,
                           kv_dtype: torch.dtype) -> int:
    """Where prompt chunks run through cuDNN, its plans for every shape a chunk can meet are built now rather than
    by requests (qv/kernels/paged_attention/sdpa_prefill.py: warm_plans). Returns the shapes planned."""
    from qv.kernels.paged_attention import sdpa_prefill
    from qv.kernels.paged_attention.configs import CUDNN_MIN_ROWS, CUDNN_PIECE_TOKENS, prefill_kind

    if not cfg.attention_layer_ids or prefill_kind(device, chunk_rows, dtype, kv_dtype) != "cudnn":
        return 0
    return sdpa_prefill.warm_plans(device, dtype, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   chunk_rows, CUDNN_PIECE_TOKENS, kv_dtype == torch.int8,
                                   min(CUDNN_MIN_ROWS, chunk_rows))


def gdn_bytes_per_slot(cfg: ModelConfig, conv_dtype: torch.dtype, state_dtype: torch.dtype) -> int:
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.linear_conv_dim * torch.tensor([], dtype=conv_dtype).element_size()
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    ssm = hv * dk * dv * torch.tensor([], dtype=state_dtype).element_size()
    if state_dtype == torch.int16:
        ssm += hv * dv * 4
    return len(cfg.gdn_layer_ids) * (conv + ssm)


def allocate_cache(cfg: ModelConfig, num_blocks: int, block_size: int, num_slots: int,
                   kv_dtype: torch.dtype, state_dtype: torch.dtype, conv_dtype: torch.dtype,
                   device: torch.device | str, extra_attention_layers: tuple[int, ...] = (),
                   sparse: SparsePolicy | None = None) -> HybridCache:
    """Zeroed caches for every layer. Block 0.. num_blocks-1 and slots 0..num_slots-1 are usable.
    Under tensor parallelism `cfg` is the rank's view (model.cfg): its KV heads and GDN heads only.
    `extra_attention_layers` adds KV caches under those layer indices (the MTP head's layer), sharing
    the block tables of the model's own layers. `sparse` (enabled): the model's own attention layers get
    page tables for sparse attention (the MTP head's layer attends exactly)."""
    kv: dict[int, KVCache] = {}
    for i in list(cfg.attention_layer_ids) + list(extra_attention_layers):
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        scales = kv_dtype == torch.int8
        kv[i] = KVCache(
            k=torch.zeros(shape, dtype=kv_dtype, device=device),
            v=torch.zeros(shape, dtype=kv_dtype, device=device),
            k_scale=torch.zeros(shape[:3], dtype=torch.float32, device=device) if scales else None,
            v_scale=torch.zeros(shape[:3], dtype=torch.float32, device=device) if scales else None,
            sparse=SparseKV.allocate(sparse, num_blocks, cfg.num_key_value_heads, cfg.head_dim, device)
            if sparse is not None and sparse.enabled and i in cfg.attention_layer_ids else None,
        )
    gdn: dict[int, GDNState] = {}
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    for i in cfg.gdn_layer_ids:
        gdn[i] = GDNState(
            conv=torch.zeros((num_slots, cfg.linear_conv_kernel_dim - 1, cfg.linear_conv_dim), dtype=conv_dtype,
                             device=device),
            ssm=torch.zeros((num_slots, hv, dk, dv), dtype=state_dtype, device=device),
            ssm_scale=torch.zeros((num_slots, hv, dv), dtype=torch.float32, device=device)
            if state_dtype == torch.int16 else None,
        )
    return HybridCache(kv=kv, gdn=gdn, block_size=block_size)
