"""One step: a StepPlan becomes flat tensors (built with NumPy in preallocated pinned buffers and
copied to the device once), the model runs one forward over all rows, and the rows that caught
up with their tokens are sampled. The sampled ids (and logprobs) come back in one transfer:
the only device-to-host sync of the step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qv.engine.sampler import SamplerOutput, SamplingBatch, sample
from qv.engine.scheduler import StepPlan
from qv.engine.sequence import Sequence
from qv.model.batch import AttentionMeta, GDNMeta, StepBatch
from qv.model.cache import HybridCache


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] | None = None


class _Buffers:
    """Host (pinned) and device buffers sized once for the largest step; steps use prefixes."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device):
        pin = device.type == "cuda"

        def pair(n: int, dtype: torch.dtype):
            host = torch.zeros(n, dtype=dtype, pin_memory=pin)
            return host, host.numpy(), torch.zeros(n, dtype=dtype, device=device)

        self.ids = pair(max_tokens, torch.int64)
        self.positions = pair(max_tokens, torch.int64)
        self.slot_mapping = pair(max_tokens, torch.int64)
        self.cu_seqlens = pair(max_seqs + 1, torch.int32)
        self.seq_lens = pair(max_seqs, torch.int32)
        self.state_slots = pair(max_seqs, torch.int64)
        self.has_init = pair(max_seqs, torch.bool)
        self.logits_idx = pair(max_seqs, torch.int64)
        self.block_tables = pair(max_seqs * max_blocks, torch.int32)
        self.max_blocks = max_blocks

    @staticmethod
    def upload(buf, n: int) -> torch.Tensor:
        host, _, dev = buf
        dev[:n].copy_(host[:n], non_blocking=True)
        return dev[:n]


class ModelRunner:
    def __init__(self, model, cache: HybridCache, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int):
        self.model, self.cache = model, cache
        self.device = model.device
        self.block_size = cache.block_size
        max_blocks = -(-max_model_len // self.block_size) + 1
        self.buf = _Buffers(max_num_batched_tokens, max_num_seqs, max_blocks, self.device)
        self.vocab_size = model.cfg.vocab_size

    # -- batch construction --------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, StepBatch, list[Sequence]]:
        b = self.buf
        seqs = [s for s, _ in plan.scheduled]
        q_lens = np.fromiter((n for _, n in plan.scheduled), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        nseq, ntok = len(seqs), int(q_lens.sum())
        cu = b.cu_seqlens[1]
        cu[0] = 0
        np.cumsum(q_lens, out=cu[1:nseq + 1])
        ends = starts + q_lens
        b.seq_lens[1][:nseq] = ends
        b.has_init[1][:nseq] = starts > 0
        width = max(1, max(-(-int(e) // self.block_size) for e in ends))
        tables = b.block_tables[1][:nseq * width].reshape(nseq, width)
        ids = b.ids[1]
        sampled_rows = []
        for i, (seq, n) in enumerate(plan.scheduled):
            blocks = seq.block_ids
            tables[i, :len(blocks)] = blocks
            tables[i, len(blocks):] = 0
            b.state_slots[1][i] = seq.state_slot
            start = int(starts[i])
            ids[cu[i]:cu[i] + n] = _token_slice(seq, start, start + n)
            if start + n == seq.num_tokens:
                sampled_rows.append(i)
        # positions and slot mapping for every token, vectorized over the flat batch
        row_of = np.repeat(np.arange(nseq), q_lens)
        pos = np.arange(ntok) - cu[row_of] + starts[row_of]
        b.positions[1][:ntok] = pos
        b.slot_mapping[1][:ntok] = tables[row_of, pos // self.block_size] * self.block_size + pos % self.block_size
        samplers = [seqs[i] for i in sampled_rows]
        b.logits_idx[1][:len(sampled_rows)] = cu[np.asarray(sampled_rows, dtype=np.int64) + 1] - 1
        up = _Buffers.upload
        batch = StepBatch(
            cu_seqlens_q=up(b.cu_seqlens, nseq + 1),
            max_query_len=int(q_lens.max()),
            attn=AttentionMeta(slot_mapping=up(b.slot_mapping, ntok),
                               block_tables=up(b.block_tables, nseq * width).view(nseq, width),
                               seq_lens=up(b.seq_lens, nseq), max_seq_len=int(ends.max())),
            gdn=GDNMeta(state_slots=up(b.state_slots, nseq), has_initial_state=up(b.has_init, nseq)),
            logits_indices=up(b.logits_idx, len(sampled_rows)),
        )
        return up(b.ids, ntok), up(b.positions, ntok), batch, samplers

    # -- the step ------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> dict[Sequence, SampledToken]:
        input_ids, positions, batch, samplers = self.prepare(plan)
        hidden = self.model.forward(input_ids, positions, batch, self.cache)
        if not samplers:
            return {}
        logits = self.model.compute_logits(hidden[batch.logits_indices])[:, :self.vocab_size]
        out = sample(logits, self.sampling_batch(samplers, logits.shape[-1]))
        return self._to_host(samplers, out)

    def sampling_batch(self, seqs: list[Sequence], vocab: int) -> SamplingBatch:
        dev = self.device
        ps = [s.params for s in seqs]
        t = lambda xs, dt: torch.tensor(xs, dtype=dt).to(dev, non_blocking=True)  # noqa: E731
        any_penalty = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in ps)
        under_min = [len(s.output_token_ids) < s.params.min_tokens for s in seqs]
        b = SamplingBatch(
            temperature=t([0.0 if p.greedy else p.temperature for p in ps], torch.float32),
            top_p=t([p.top_p for p in ps], torch.float32),
            top_k=t([p.top_k for p in ps], torch.int64),
            min_p=t([p.min_p for p in ps], torch.float32),
            seeds=t([s.rng_seed for s in seqs], torch.int64),
            positions=t([len(s.output_token_ids) for s in seqs], torch.int64),
            all_greedy=all(p.greedy for p in ps),
            max_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1),
        )
        if any_penalty:
            b.presence = t([p.presence_penalty for p in ps], torch.float32)
            b.frequency = t([p.frequency_penalty for p in ps], torch.float32)
            b.repetition = t([p.repetition_penalty for p in ps], torch.float32)
            b.output_counts = _counts([s.output_token_ids for s in seqs], vocab, dev)
            b.prompt_mask = _counts([s.prompt_token_ids for s in seqs], vocab, dev) > 0
        if any(under_min):
            b.stop_mask_rows = t(under_min, torch.bool)
            b.stop_token_mask = _counts([s.stop_ids_for_min_tokens for s in seqs], vocab, dev) > 0
        return b

    def _to_host(self, seqs: list[Sequence], out: SamplerOutput) -> dict[Sequence, SampledToken]:
        if out.logprobs is None:
            ids = out.token_ids.cpu().tolist()
            return {s: SampledToken(i) for s, i in zip(seqs, ids)}
        n_top = 0 if out.top_ids is None else out.top_ids.shape[1]
        parts = [out.token_ids[:, None].double(), out.logprobs[:, None].double(), out.ranks[:, None].double()]
        if n_top:
            parts += [out.top_ids.double(), out.top_logprobs.double()]
        host = torch.cat(parts, dim=1).cpu().numpy()  # one transfer for everything
        result = {}
        for s, row in zip(seqs, host):
            want = s.params.logprobs
            top = None
            if want is not None:
                top = [(int(row[3 + j]), float(row[3 + n_top + j])) for j in range(min(want, n_top))]
            result[s] = SampledToken(int(row[0]), float(row[1]), int(row[2]), top)
        return result


def _token_slice(seq: Sequence, start: int, end: int) -> list[int]:
    n = seq.num_prompt_tokens
    if end <= n:
        return seq.prompt_token_ids[start:end]
    if start >= n:
        return seq.output_token_ids[start - n:end - n]
    return seq.prompt_token_ids[start:] + seq.output_token_ids[:end - n]


def _counts(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[R, vocab] fp32 occurrence counts of each row's token list (scattered on the device)."""
    width = max((len(r) for r in rows), default=0)
    padded = np.full((len(rows), max(width, 1)), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        padded[i, :len(r)] = r
    idx = torch.from_numpy(padded).to(device)
    valid = (idx >= 0) & (idx < vocab)
    counts = torch.zeros(len(rows), vocab, dtype=torch.float32, device=device)
    return counts.scatter_add_(1, torch.where(valid, idx, 0), valid.float())
