"""Prompt logprobs (vLLM's `prompt_logprobs`): for each prompt token after the first, its logprob
given the tokens before it, its rank, and the top-n tokens at that position, of the raw model
distribution (as the generated tokens' logprobs).

Full-vocabulary logits of a whole prefill chunk would be rows x vocab x 4 bytes (2048 x 248,320:
1.89 GiB), so a step's rows are taken a bounded slice at a time (`slice_rows`: at most SLICE_BYTES
of logits, log-softmax and rank comparison alive at once): lm_head over the slice, log-softmax,
the next prompt token's logprob and rank, top-n, then freed. The extra memory does not grow with
the prompt or the chunk.

- Rows: sample 0 of a request owns its PromptLogprobs (the n samples share one prompt). Hidden row
  p (p < prompt length - 1) gives entry p + 1; entry 0 is None. Every chunk contributes its rows;
  `launched` counts the rows already asked for, so a chunk recomputed after preemption is not
  asked again.
- Prefix caching may not skip rows still to compute: `cacheable_tokens` caps a hit at `launched`
  (0 at the first admission, so a request with prompt_logprobs computes its whole prompt, as
  vLLM's skip_reading_prefix_cache does).
- Transfer: a step with such rows makes one bounded device-to-host copy of its own (rows x
  (2 + 2n) float64: logprob, rank, top ids, top logprobs), queued on the step's stream right after
  these kernels. `deliver` (the runner's collect, before it reads the step's results) waits for it
  and appends the entries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from qv.engine.request import Logprob
from qv.engine.sampler import logprobs_of

SLICE_BYTES = 256 << 20  # logits memory of one slice
BYTES_PER_LOGIT = 9  # fp32 logits, their fp32 log-softmax and the bool rank comparison, alive together


def slice_rows(vocab: int) -> int:
    return max(1, SLICE_BYTES // (BYTES_PER_LOGIT * vocab))


@dataclass(eq=False)
class PromptLogprobs:
    """One request's prompt logprobs as they arrive, chunk by chunk."""

    prompt_token_ids: list[int]
    top_n: int
    tokenizer: object
    entries: list[dict[int, Logprob] | None] = field(default_factory=lambda: [None])
    launched: int = 0  # prompt rows a launched step computes

    @property
    def num_rows(self) -> int:
        return len(self.prompt_token_ids) - 1

    @property
    def complete(self) -> bool:
        return len(self.entries) == len(self.prompt_token_ids)

    def append(self, block: np.ndarray) -> None:
        """Rows [len(entries) - 1, ...) as (logprob, rank, top ids..., top logprobs...) float64 rows."""
        n, first = self.top_n, len(self.entries) - 1
        targets = np.asarray(self.prompt_token_ids[first + 1:first + 1 + block.shape[0]], dtype=np.int64)
        top_ids = block[:, 2:2 + n].astype(np.int64)
        text = token_texts(self.tokenizer, np.concatenate([targets, top_ids.reshape(-1)]))
        for r, tok in enumerate(targets.tolist()):
            entry = {tok: Logprob(float(block[r, 0]), int(block[r, 1]), text[tok])}
            for m, tid in enumerate(top_ids[r].tolist()):
                entry.setdefault(tid, Logprob(float(block[r, 2 + n + m]), m + 1, text[tid]))
            self.entries.append(entry)


def token_texts(tokenizer, ids: np.ndarray) -> dict[int, str]:
    """Each distinct id decoded alone (special tokens kept), as logprobs entries show tokens; one
    batched call to the fast tokenizer."""
    unique = np.unique(ids).tolist()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        texts = [tokenizer.decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False) for t in unique]
    else:
        texts = backend.decode_batch([[t] for t in unique], skip_special_tokens=False)
    return dict(zip(unique, texts))


def new_prompt_logprobs(params, prompt_token_ids: list[int], tokenizer) -> PromptLogprobs | None:
    if params.prompt_logprobs is None:
        return None
    return PromptLogprobs(list(prompt_token_ids), params.prompt_logprobs, tokenizer)


def cacheable_tokens(seq) -> int:
    """The longest prefix a prefix-cache hit may cover: rows still to compute come after it."""
    st = seq.prompt_logprobs
    return seq.num_tokens if st is None or st.launched >= st.num_rows else st.launched


def finished_prompt_logprobs(seq) -> list | None:
    """vLLM's RequestOutput.prompt_logprobs: None until every row is in."""
    st = seq.prompt_logprobs
    return st.entries if st is not None and st.complete else None


class PromptLogprobRows:
    """One step's prompt logprobs on their way to the host."""

    def __init__(self, asks: list[tuple[PromptLogprobs, int]], host: torch.Tensor, copied):
        self.asks, self.host, self.copied = asks, host, copied

    def deliver(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        values, off = self.host.numpy(), 0
        for st, n in self.asks:
            width = 2 + 2 * st.top_n
            st.append(values[off:off + n * width].reshape(n, width))
            off += n * width


def launch_prompt_logprobs(model, seqs: list, cu: np.ndarray, hidden: torch.Tensor, next_ids: torch.Tensor,
                           vocab: int) -> PromptLogprobRows | None:
    """Queue the prompt logprobs of a step's rows (sequence i: hidden rows cu[i]..cu[i+1], from
    position seq.num_computed_tokens; next_ids: the token after each row). None when no row asks."""
    asks, parts, step = [], [], slice_rows(vocab)
    for st, a, n in _step_rows(seqs, cu):
        parts.append(_rows(model, hidden[a:a + n], next_ids[a:a + n], st.top_n, vocab, step))
        asks.append((st, n))
        st.launched += n
    if not asks:
        return None
    packed = torch.cat([p.reshape(-1) for p in parts])
    if packed.device.type != "cuda":
        return PromptLogprobRows(asks, packed, None)
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(packed.device))
    return PromptLogprobRows(asks, host, copied)


def prompt_logits_calls(seqs: list, cu: np.ndarray, vocab: int) -> list[tuple[int, int]]:
    """Hidden rows [a, b) of each compute_logits call launch_prompt_logprobs will make for this step
    (tensor-parallel workers make the same calls, whose lm_head gathers across the ranks)."""
    step = slice_rows(vocab)
    return [(a + s, a + min(s + step, n)) for _, a, n in _step_rows(seqs, cu) for s in range(0, n, step)]


def _step_rows(seqs: list, cu: np.ndarray):
    """(state, first hidden row, rows) of each sequence whose prompt logprobs this step computes."""
    for i, seq in enumerate(seqs):
        st = seq.prompt_logprobs
        if st is None or st.launched >= st.num_rows:
            continue
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + int(cu[i + 1] - cu[i])
        if start > st.launched:
            raise RuntimeError(f"request {seq.request_id}: prompt rows {st.launched}..{start} were skipped (a bug)")
        lo, hi = st.launched, min(end, st.num_rows)
        if hi > lo:
            yield st, int(cu[i]) + lo - start, hi - lo


def _rows(model, hidden: torch.Tensor, targets: torch.Tensor, top_n: int, vocab: int, step: int) -> torch.Tensor:
    """[rows, 2 + 2 top_n] float64: logprob of each row's target, its rank, top ids, top logprobs."""
    out = torch.empty(hidden.shape[0], 2 + 2 * top_n, dtype=torch.float64, device=hidden.device)
    for a in range(0, hidden.shape[0], step):
        logits = model.compute_logits(hidden[a:a + step])[:, :vocab]
        chosen, ranks, top_ids, top_lp = logprobs_of(logits, targets[a:a + step], top_n)
        o = out[a:a + step]
        o[:, 0], o[:, 1] = chosen, ranks
        if top_n:
            o[:, 2:2 + top_n], o[:, 2 + top_n:] = top_ids, top_lp
        del logits, chosen, ranks, top_ids, top_lp  # freed before the next slice's logits
    return out
