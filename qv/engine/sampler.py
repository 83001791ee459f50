"""Token sampling for a batch of rows, each with its own settings: logit_bias, allowed_token_ids and
bad_words, penalties (repetition on prompt and output, presence/frequency on output), min_tokens
(stop tokens masked), temperature, top-k, top-p, min-p; greedy rows take the argmax. Logprobs are
of the raw model distribution.

Random rows draw with the exponential race (argmax p / E, E ~ Exp(1)), where each uniform comes
from a counter-based hash of (row seed, output position, token id): a seeded request samples
the same tokens whatever else is in the batch, and no host sync is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qv.engine.structured import apply_bitmask
from qv.kernels import race


@dataclass
class SamplingBatch:
    """Per-row settings as device tensors (built by the runner with NumPy, copied once)."""

    temperature: torch.Tensor  # [R] fp32; 0 means greedy
    top_p: torch.Tensor  # [R] fp32
    top_k: torch.Tensor  # [R] int64; 0 means off
    min_p: torch.Tensor  # [R] fp32
    seeds: torch.Tensor  # [R] int64
    positions: torch.Tensor  # [R] int64: index of the token being sampled among the outputs
    presence: torch.Tensor | None = None  # [R] fp32 penalties; None when no row uses them
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None  # [R, V] occurrences in each row's output so far
    prompt_mask: torch.Tensor | None = None  # [R, V] bool: token occurs in the prompt
    stop_mask_rows: torch.Tensor | None = None  # [R] bool: rows still under min_tokens
    stop_token_mask: torch.Tensor | None = None  # [R, V] bool: tokens that would stop each row
    bias_rows: torch.Tensor | None = None  # [K] int64: rows with a logit_bias or allowed_token_ids
    bias: torch.Tensor | None = None  # [K, V] fp32 added to those rows' logits (-inf: not allowed)
    ban_rows: torch.Tensor | None = None  # [B] int64: (row, token) of each bad_words ban this step
    ban_ids: torch.Tensor | None = None  # [B] int64
    all_greedy: bool = False
    any_filter: bool = True  # some random row has top-k, top-p or min-p (False: no sort over the vocabulary)
    max_logprobs: int = -1  # -1: no row wants logprobs; else the largest top-N asked
    grammar: tuple | None = None  # (token bitmask [R, ceil(V/32)] int32, constrained rows): structured outputs


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None  # [R] fp32: logprob of the sampled token
    ranks: torch.Tensor | None  # [R] int64: 1 + number of tokens more likely than it
    top_ids: torch.Tensor | None  # [R, N]
    top_logprobs: torch.Tensor | None  # [R, N]


def token_bias(params: list, vocab: int, device) -> torch.Tensor:
    """[K, V] fp32 additive bias of K rows' SamplingParams: logit_bias, and -inf outside
    allowed_token_ids (ids already checked against the vocabulary), scattered on the device."""
    bias = torch.zeros(len(params), vocab, dtype=torch.float32, device=device)
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            keep = torch.tensor(p.allowed_token_ids, dtype=torch.int64).to(device)
            bias[i].fill_(float("-inf")).index_fill_(0, keep, 0.0)
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64).to(device)
            bias[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=torch.float32).to(device))
    return bias


def apply_bias(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """logit_bias, allowed_token_ids and bad_words, on the rows that have them only (not in place:
    logprobs are of the raw logits)."""
    if b.bias is not None:
        logits = logits.index_add(0, b.bias_rows, b.bias)
    if b.ban_rows is not None:
        logits = logits.index_put((b.ban_rows, b.ban_ids), logits.new_full((), float("-inf")))
    return logits


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.repetition is not None:
        seen = b.prompt_mask | (b.output_counts > 0)
        rep = b.repetition[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    if b.frequency is not None:
        logits = logits - b.frequency[:, None] * b.output_counts
    if b.presence is not None:
        logits = logits - b.presence[:, None] * (b.output_counts > 0).float()
    if b.stop_mask_rows is not None:
        logits = logits.masked_fill(b.stop_mask_rows[:, None] & b.stop_token_mask, float("-inf"))
    return logits


def filter_probs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p over fp32 logits; returns probabilities (0 where cut)."""
    temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
    logits = logits / temp[:, None]
    if not b.any_filter:
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(b.top_k > 0, b.top_k, torch.full_like(b.top_k, vocab))
    cut = rank >= k[:, None]
    probs_sorted = torch.softmax(sorted_logits.masked_fill(cut, float("-inf")), dim=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the token that crosses p stays)
    before = probs_sorted.cumsum(-1) - probs_sorted
    cut |= before >= b.top_p[:, None]
    # min-p: drop tokens below min_p times the most likely one
    cut |= probs_sorted < (b.min_p[:, None] * probs_sorted[:, :1])
    cut[:, 0] = False
    probs_sorted = torch.softmax(sorted_logits.masked_fill(cut, float("-inf")), dim=-1)
    return torch.zeros_like(logits).scatter_(-1, order, probs_sorted)


def process(logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(argmax after penalties [R], filtered probabilities [R, V] or None when every row is greedy)."""
    logits = apply_penalties(apply_bias(logits, b), b)
    return logits.argmax(dim=-1), None if b.all_greedy else filter_probs(logits, b)


def logprobs_of(raw: torch.Tensor, ids: torch.Tensor, top_n: int):
    """(logprob of ids [R], their rank [R], top-N ids, top-N logprobs) of the raw model distribution."""
    lp = torch.log_softmax(raw, dim=-1)
    chosen = lp.gather(1, ids[:, None])[:, 0]
    ranks = (lp > chosen[:, None]).sum(-1) + 1
    top_lp, top_ids = lp.topk(top_n, dim=-1) if top_n > 0 else (None, None)
    return chosen, ranks, top_ids, top_lp


def apply_grammar(logits: torch.Tensor, b: SamplingBatch) -> None:
    """Structured outputs: tokens a row's grammar forbids get -inf, batched over the constrained rows."""
    if b.grammar is not None:
        apply_bitmask(logits, b.grammar)


def sample(logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    """logits [R, V] fp32 (raw model output) -> sampled ids, and logprobs if any row asked. Rows under
    a grammar are masked first (in place), so their logprobs are those of the allowed tokens."""
    apply_grammar(logits, b)
    greedy_ids, probs = process(logits, b)
    ids = greedy_ids if probs is None else torch.where(b.temperature > 0, race(probs, b.seeds, b.positions),
                                                        greedy_ids)
    if b.max_logprobs < 0:
        return SamplerOutput(ids, None, None, None, None)
    return SamplerOutput(ids, *logprobs_of(logits, ids, b.max_logprobs))
