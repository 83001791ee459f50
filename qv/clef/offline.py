"""Clef without the engine: one record through qv's model, chunk by chunk, into the joint head.

This is the whole computation the engine performs for a Clef request (one prefill whose rows
carry the Clef deltas, final-norm hidden states tapped into the head), driven directly with a
private cache. Tests use it as qv's side of every oracle comparison; `decide` is the offline API.
"""

from __future__ import annotations

from typing import Any

import torch

from qv.clef.answers import response
from qv.clef.encode import EncodedRecord
from qv.clef.head import HeadState, JointHead
from qv.clef.request import encode_request, validate
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache

BLOCK_SIZE = 16


def run_record(model, head: JointHead, record: EncodedRecord, chunk_size: int | None = None, deltas: bool = True,
               memory_dtype: torch.dtype = torch.float32, state_dtype: torch.dtype = torch.float32) -> HeadState:
    """Prefill `record` in chunks of `chunk_size` tokens (None: one chunk) with every row a Clef row
    (weights + deltas) when `deltas`; returns the head state, complete."""
    n_tokens = record.num_tokens
    chunk = chunk_size or n_tokens
    blocks = list(range((n_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE))
    cache = allocate_cache(model.cfg, len(blocks), BLOCK_SIZE, 1, model.dtype, state_dtype, model.dtype, model.device)
    state = head.state(record, model.lm_head.weight, memory_dtype)
    ids = torch.tensor(record.input_ids, dtype=torch.int64, device=model.device)
    for start in range(0, n_tokens, chunk):
        n = min(chunk, n_tokens - start)
        batch = build_step_batch([n], [start + n], [blocks], [0], BLOCK_SIZE, model.device, logits_rows=[],
                                 delta_rows=list(range(n)) if deltas else None)
        positions = torch.arange(start, start + n, device=model.device)
        state.add_chunk(model.forward(ids[start:start + n], positions, batch, cache), start)
    return state


def decide(model, head: JointHead, tokenizer: Any, body: dict, nmax: int, chunk_size: int | None = None) -> dict:
    """A systemone body (text only) -> the systemone response, computed offline."""
    request = validate(body)
    record = encode_request(tokenizer, request, nmax)
    state = run_record(model, head, record, chunk_size)
    return response(request.model, record, state.probabilities())
