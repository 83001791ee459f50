"""The engine's view of one sample being generated: its tokens, how many of them the model has
computed (vLLM's `num_computed_tokens`), the KV blocks and GDN state slot it holds, and the
output text decoded so far.

With async scheduling the last output token may be PENDING for the length of one engine call:
the step that samples it is still running, the next step is planned and launched as if it were
in (its id comes from the device), then the real id replaces it (qv/engine/engine.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from qv.engine.detokenizer import IncrementalDetokenizer
from qv.engine.request import Logprob, SamplingParams

if TYPE_CHECKING:  # its module loads torch, which a Sequence does not need
    from qv.engine.prompt_logprobs import PromptLogprobs


PENDING = -1  # an output token sampled on the device whose id has not reached the host yet


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


RESYNC = 16  # tokens token_array copies again each call

DraftSource = Literal["mtp", "ngram", "filler"]  # "filler": spare drafts verified only to keep a step uniform


@dataclass
class Drafts:
    """Speculation's drafts of one sequence. They live on the Sequence, not in the Speculator, because the
    scheduler plans with them: it sizes the sequence's rows by `tokens` (k+1 or 1) and evens a decode step out
    with `spare` (every sequence verifies, so one CUDA graph replays it) before the step's token shares are cut."""

    tokens: list[int] = field(default_factory=list)  # exactly k drafts to verify next step, or none
    source: DraftSource | None = None  # what made `tokens`
    # k tokens a decode-only step may verify for this sequence when it makes no drafts of its own (the MTP
    # head's guess, or the last token repeated)
    spare: list[int] = field(default_factory=list)

    def clear(self) -> None:
        """No drafts to verify (the spare ones stay)."""
        self.tokens, self.source = [], None


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    sample_index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never lets prompt + output exceed max_model_len
    rng_seed: int  # per-sample seed: the sampler's noise depends on (seed, output position, token) only
    detok: IncrementalDetokenizer
    arrival_order: int
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    priority: int = 0  # vLLM's: lower first under the priority scheduling policy
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    state_slot: int = -1
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the first admission
    # (position, hash) per media item: prompt content its ids lack (every pad is alike); the prefix key has both
    mm_hashes: list[tuple[int, str]] | None = None
    drafts: Drafts = field(default_factory=Drafts)  # on the Sequence: the scheduler plans with them (see Drafts)
    # sample 0's (when asked), an output like output_logprobs: the prefix cache, runner and TP workers read it too
    prompt_logprobs: PromptLogprobs | None = None
    _array: np.ndarray | None = field(default=None, repr=False)  # token_array's buffer
    _array_len: int = field(default=0, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def has_pending(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PENDING

    def token_at(self, pos: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[pos] if pos < n else self.output_token_ids[pos - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    def token_array(self, start: int) -> np.ndarray:
        """Tokens start..num_tokens as int64 NumPy, from a buffer that grows with the sequence: the n-gram
        lookup reads a window of it every step, and converting that window from the lists cost more than
        the lookup. The last RESYNC tokens are copied again each call (a placeholder for a token still on
        the device is replaced in place)."""
        n = self.num_tokens
        if self._array is None or self._array.shape[0] < n:
            grown = np.empty(max(2 * n, 256), dtype=np.int64)
            if self._array is not None:
                grown[:self._array_len] = self._array[:self._array_len]
            self._array = grown
        done = max(0, min(self._array_len, n) - RESYNC)
        self._array[done:n] = self.token_slice(done, n)
        self._array_len = n
        return self._array[start:n]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def stop_ids_for_min_tokens(self) -> list[int]:
        """Tokens masked while fewer than min_tokens were generated."""
        eos = [] if self.params.ignore_eos else list(self.eos_token_ids)
        return eos + list(self.params.stop_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
