"""Logit error of quantized caches (int8 KV, fp16/int16 GDN state) against the fp32 cache, on a
prompt processed in chunks so later tokens read what earlier chunks stored."""

from __future__ import annotations

import torch

from qv.config import ModelConfig
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.qwen3_5 import load_text_model


def chunked_logits(model_dir: str, ids: list[int], kv_dtype: torch.dtype, state_dtype: torch.dtype,
                   chunk: int = 16) -> torch.Tensor:
    cfg = ModelConfig.from_dir(model_dir)
    model = load_text_model(model_dir, cfg)
    bs = 16
    n_blocks = -(-len(ids) // bs)
    cache = allocate_cache(cfg, n_blocks, bs, 1, kv_dtype, state_dtype, torch.float32, "cpu")
    table = list(range(n_blocks))
    out = []
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        batch = build_step_batch([end - start], [end], [table], [0], bs, logits_rows=list(range(end - start)))
        h = model.forward(torch.tensor(ids[start:end]), torch.arange(start, end), batch, cache)
        out.append(model.compute_logits(h))
    return torch.cat(out)
