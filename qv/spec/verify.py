"""Verification of k drafted tokens against the target's k+1 rows of logits, and the commit of the
Gated DeltaNet state at the accepted position.

Drafts are deterministic proposals (the MTP head's argmax, or an n-gram lookup), so the proposal
distribution is a point mass and standard rejection sampling reduces to: accept draft d_j with
probability p_j(d_j) (greedy rows: iff d_j is the target argmax); at the first rejection emit a
sample of p_j with d_j removed; if all k are accepted, emit a sample of p_k (the bonus token).
The emitted tokens are then distributed exactly as sampling the target one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qv.kernels import race
from qv.kernels.race import uniform_noise


@dataclass
class VerifyResult:
    tokens: torch.Tensor  # [S, k+1] int64: row j's emitted token (only the first n_accepted+1 count)
    num_accepted: torch.Tensor  # [S] int64 in 0..k


_ACCEPT_SALT = 0x5EED5EED


def verify(greedy_ids: torch.Tensor, probs: torch.Tensor | None, drafts: torch.Tensor, greedy_rows: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor) -> VerifyResult:
    """greedy_ids [S, k+1] target argmax per row; probs [S, k+1, V] processed target probabilities (None when all
    rows are greedy); drafts [S, k] (ids outside the vocabulary are rejected); greedy_rows [S] bool;
    seeds [S] int64; positions [S] int64 = output index of row 0's token."""
    s, k1 = greedy_ids.shape
    k = k1 - 1
    vocab = probs.shape[-1] if probs is not None else None
    valid = drafts >= 0 if vocab is None else (drafts >= 0) & (drafts < vocab)
    safe = torch.where(valid, drafts, 0)
    accept = valid & (safe == greedy_ids[:, :k])
    final = greedy_ids.clone()
    if probs is not None:
        row_pos = positions[:, None] + torch.arange(k1, device=drafts.device)[None, :]  # [S, k+1]
        p_draft = probs[:, :k].gather(-1, safe[..., None])[..., 0]  # [S, k]
        u = _row_uniform(seeds ^ _ACCEPT_SALT, row_pos[:, :k])
        accept_random = valid & (u < p_draft.double())
        accept = torch.where(greedy_rows[:, None], accept, accept_random)
        # residual rows: the target distribution with the rejected draft removed; last row: as is
        residual = probs.clone()
        residual[:, :k].scatter_(-1, safe[..., None], 0.0)
        sampled = race(residual.reshape(s * k1, -1), seeds.repeat_interleave(k1), row_pos.reshape(-1)).view(s, k1)
        final = torch.where(greedy_rows[:, None], greedy_ids, sampled)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
    row = torch.arange(k1, device=drafts.device)[None, :]
    drafts_padded = torch.cat([safe, safe[:, :1]], dim=1)
    tokens = torch.where(row < num_accepted[:, None], drafts_padded, final)
    return VerifyResult(tokens, num_accepted)


def _row_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform per (row, position), from the same counter-based hash as the sampler."""
    s, k = positions.shape
    return uniform_noise(seeds.repeat_interleave(k), positions.reshape(-1), 1).view(s, k)
