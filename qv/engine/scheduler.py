"""Continuous batching with vLLM's one rule: every sequence's `num_computed_tokens` catches up
with its tokens under a per-step token budget. Running sequences go first (decodes, then the
rest of chunked prefills, short before long), then waiting ones are admitted while blocks, slots
and the sequence cap allow. Chunked prefill is always on.

Chats stay responsive beside long prefills (Clef records, long prompts): while any sequence
decodes or a short request waits, a prefill with more than `long_prefill_token_threshold` tokens left takes at most that
many tokens of the step, and at most `max_long_partial_prefills` of them run in it. Without
decodes they take the whole budget, so a record alone prefills at full speed.

With a latency target (`max_step_ms`, or `max_step_decode_ratio` times the predicted decode-only
step) and a step cost model (qv/engine/step_cost.py), a step in which anything decodes sizes its
prompt tokens to the target in place of that share: every
prompt (running or waiting, chat or record) gets the same number of tokens, as many as keep the
predicted step time under the target, and at least a small floor each, so none starves.

When the KV pool runs out, the newest running sequence is preempted by recompute (its blocks and
slot are freed, it goes back to the front of the queue). A preempted sequence is readmitted only
when its whole current length plus one growth block per running sequence fits, so it is not
admitted just to be preempted again on the next step. That alone does not stop the original stack's
thrash: contexts that outgrow the pool keep preempting the newest sequence, which is readmitted,
recomputes its whole context and is preempted again. So a sequence preempted more than
`max_preemptions` times is readmitted only when its full length (prompt + max_tokens) fits beside
the running set, and then runs protected: it is never chosen as a victim, and the blocks it will
still need are reserved (other sequences grow and are admitted only into what is left), so it
finishes after at most max_preemptions + 1 recomputes while the others go on. A sequence
that cannot fit even alone fails with a clear error. With prefix caching (qv/engine/prefix_cache.py)
an admitted sequence resumes from its cached prefix, and a preempted one's blocks stay cached, so
its readmission usually resumes from its last snapshot.

Under vLLM's priority policy (`scheduling_policy` priority) the queue is ordered by (priority,
arrival), lower values first; running sequences are served in that order and a preemption takes
the lowest-priority (then newest) sequence not yet planned this step.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from qv.engine.kv_cache import KVBlockPool
from qv.engine.prefix_cache import PrefixCache, is_isolated
from qv.engine.sequence import Sequence, SeqStatus
from qv.engine.state_pool import GDNStatePool
from qv.engine.step_cost import StepCostModel, plan_prompt_tokens


@dataclass
class StepPlan:
    """What one forward computes: (sequence, number of its tokens) in batch order."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, blocks: KVBlockPool, slots: GDNStatePool, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: int = 0, prefix_cache: PrefixCache | None = None, long_prefill_token_threshold: int = 0,
                 max_long_partial_prefills: int = 1, max_spec_seqs: int = 0, max_step_ms: float = 0.0,
                 max_step_decode_ratio: float = 0.0, step_cost: StepCostModel | None = None,
                 max_preemptions: int = 2, policy: str = "fcfs"):
        self.blocks, self.slots = blocks, slots
        self.policy = policy  # "fcfs" | "priority" (vLLM's --scheduling-policy)
        self.prefix_cache = prefix_cache  # None: prefix caching off
        self.lookahead = lookahead  # extra KV positions a step may write past its tokens (the MTP head's drafts)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold or max(1, max_num_batched_tokens // 4)
        self.max_long_partial_prefills = max_long_partial_prefills
        self.max_spec_seqs = max_spec_seqs  # the speculator's per-position GDN state buffers hold this many
        self.max_step_ms = max_step_ms  # 0: no latency target, the long-prefill share decides
        self.max_step_decode_ratio = max_step_decode_ratio  # the target as a multiple of a decode-only step
        self.step_cost = step_cost
        self.row_buckets: tuple[int, ...] = ()  # row counts a step's forward is padded to (piecewise CUDA graphs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.max_preemptions = max_preemptions  # beyond it, readmitted only when the full length fits
        self.protected: set[Sequence] = set()  # readmitted past the limit: never preempted, blocks reserved
        self.deferred: set[Sequence] = set()  # past the limit, waiting for room for their full length
        self.num_deferred_readmissions = 0  # times a sequence past the limit started waiting for that room

    # -- queue management ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.policy == "priority":
            self._insert_by_priority(seq)
        else:
            self.waiting.append(seq)

    def _insert_by_priority(self, seq: Sequence) -> None:
        """Into the queue after every sequence that ranks before it ((priority, arrival): vLLM's order)."""
        keys = [_rank(s) for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, _rank(seq)), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason=None, error: str | None = None) -> None:
        """Mark finished and give back its blocks and slot (from running or waiting)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason, seq.error = reason, stop_reason, error

    def retire(self, seq: Sequence) -> None:
        """Give back the seat, blocks and slot of a running sequence whose last token is being sampled
        (async scheduling: it finishes when that token is applied; `finish` then only marks it). The
        step in flight still writes them; whatever gets them next runs after it in stream order."""
        self.running.remove(seq)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        self.protected.discard(seq)
        self.deferred.discard(seq)
        self.blocks.release(seq.block_ids)
        self.slots.release(seq.state_slot)
        seq.state_slot = -1

    # -- the step plan -------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        if self.step_cost is not None and (self.max_step_ms > 0 or self.max_step_decode_ratio > 0) \
                and any(_decoding(s) for s in self.running):
            shares = _StepTimeShare(self)
        else:
            shares = _LongPrefillShare(self, self.running, self.waiting)
        budget = self._schedule_running(plan, self.max_num_batched_tokens, shares)
        self._admit_waiting(plan, budget, shares)
        return plan

    def _even_drafts(self, budget: int) -> None:
        """A step of decodes only verifies every sequence or none, so that it replays one CUDA graph (a
        step mixing verification rows with single decode rows runs eagerly). Where some sequences have
        drafts, the others verify their spare drafts; where that cannot be (more sequences than the
        verification capacity or the budget, or one without spare drafts, such as one too close to
        max_model_len for k draft rows), nobody drafts this step. Steps with prefill rows run eagerly
        anyway and are left as they are."""
        running = self.running
        if not self.max_spec_seqs or not any(s.drafts.tokens for s in running):
            return
        if not all(_decoding(s) for s in running):
            return
        uniform = (len(running) <= self.max_spec_seqs and len(running) * (1 + self.lookahead) <= budget
                   and all(s.drafts.tokens or len(s.drafts.spare) == self.lookahead for s in running))
        for s in running:
            if not uniform:
                s.drafts.clear()
            elif not s.drafts.tokens:
                s.drafts.tokens, s.drafts.source = list(s.drafts.spare), "filler"

    def _schedule_running(self, plan: StepPlan, budget: int, shares: "_LongPrefillShare") -> int:
        self._even_drafts(budget)
        verifying = 0
        # decodes first, then prefills short before long; admission order within each (under priority: by
        # priority first)
        def order(s: Sequence):
            kind = 0 if _decoding(s) else 1 + shares.is_long(s)
            return (s.priority, kind) if self.policy == "priority" else kind

        for seq in sorted(self.running, key=order):
            if seq not in self.running:  # preempted earlier in this loop to make room
                continue
            if seq.drafts.tokens and verifying == self.max_spec_seqs:  # beyond it: a plain decode this step
                seq.drafts.tokens = []
            n = seq.num_tokens - seq.num_computed_tokens + len(seq.drafts.tokens)
            if n > budget and seq.drafts.tokens:  # verification is all k+1 rows or none
                seq.drafts.tokens = []
                n = seq.num_tokens - seq.num_computed_tokens
            n = shares.clip(seq, min(n, budget))
            if self.prefix_cache and not seq.drafts.tokens:  # end prefill chunks on snapshot boundaries
                n = self.prefix_cache.clip(seq, n)
            if n <= 0:
                continue
            if not self._make_room(seq, n, plan):
                continue
            self.blocks.grow(seq.block_ids, self._covered(seq, n))
            plan.scheduled.append((seq, n))
            shares.took(seq)
            verifying += bool(seq.drafts.tokens)
            budget -= n
        return budget

    def _covered(self, seq: Sequence, n: int) -> int:
        """Positions the step may write KV for: its rows, plus the drafts' lookahead once caught up."""
        end = seq.num_computed_tokens + n
        return end + self.lookahead if end >= seq.num_tokens else end

    def _full_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` holds at its full length (prompt + max_tokens, the drafts' lookahead), at most the
        whole cache (a sequence that would outgrow it fails when it gets there)."""
        full = self.blocks.blocks_for(seq.num_prompt_tokens + seq.max_tokens + self.lookahead)
        return min(full, self.blocks.capacity(is_isolated(seq)))

    def _reserved(self, but: Sequence | None = None) -> int:
        """Blocks the protected sequences (but `but`) will still take on their way to their full length."""
        return sum(max(0, self._full_blocks(p) - len(p.block_ids)) for p in self.protected if p is not but)

    def _available(self, seq: Sequence) -> int:
        """Blocks `seq` may take now: the pool's, less what the other protected sequences will need."""
        return self.blocks.num_available(is_isolated(seq)) - self._reserved(but=seq)

    def _make_room(self, seq: Sequence, n: int, plan: StepPlan) -> bool:
        """Preempt (the newest first, or under priority the least urgent: _victim; never a protected sequence)
        until `seq` can grow by n tokens; False if `seq` itself gave way, or (protected) waits for room this step."""
        while self.blocks.blocks_for(self._covered(seq, n)) - len(seq.block_ids) > self._available(seq):
            victim = self._victim(seq, plan)
            if victim is seq and len(self.running) == 1:
                self._fail_too_large(seq, plan)
                return False
            if victim is seq or any(victim is s for s, _ in plan.scheduled):
                # never undo work already planned this step: preempt seq itself instead
                victim = seq
            if victim is seq and seq in self.protected:
                return False  # its reservation fell short (a shared prefix block let go): it waits, others go on
            self._preempt(victim, plan)
            if victim is seq:
                return False
        return True

    def _victim(self, seq: Sequence, plan: StepPlan) -> Sequence:
        """The sequence to preempt so that `seq` can grow, never another protected one (`seq` itself when no
        other is left): the newest (fcfs), or the lowest priority, newest among equals, of `seq` and those not
        planned this step (priority; the newest when all are planned)."""
        others = [s for s in self.running if s is not seq and s not in self.protected]
        if not others:
            return seq
        if self.policy != "priority":
            return others[-1]
        planned = {id(s) for s, _ in plan.scheduled}
        free = [s for s in others + [seq] if id(s) not in planned]  # seq itself when it is the least urgent
        return max(free, key=_rank) if free else others[-1]

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.drafts.tokens = []
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        if self.policy == "priority":
            self._insert_by_priority(seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1
        plan.preempted.append(seq)

    def _fail_too_large(self, seq: Sequence, plan: StepPlan) -> None:
        blocks = self.blocks.capacity(is_isolated(seq))  # Clef rows leave the chat reserve alone
        cap = blocks * self.blocks.block_size
        self.finish(seq, "error", error=(
            f"request {seq.request_id} needs {seq.num_tokens + 1} tokens of KV cache but the whole cache holds "
            f"{cap} tokens ({blocks} blocks of {self.blocks.block_size}); raise kv_cache_bytes "
            f"or lower max_tokens"))
        plan.failed.append(seq)

    def _admit_waiting(self, plan: StepPlan, budget: int, shares: "_LongPrefillShare") -> None:
        skipped: list[Sequence] = []  # long prefills with no share left this step keep their place
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self.slots.num_free:
            seq = self.waiting[0]
            if shares.clip(seq, 1) == 0:
                skipped.append(self.waiting.popleft())
                continue
            total_needed = self.blocks.blocks_for(seq.num_tokens + 1 + self.lookahead)
            iso = is_isolated(seq)
            if total_needed > self.blocks.capacity(iso):
                self.waiting.popleft()
                self._fail_too_large(seq, plan)
                continue
            hit = self.prefix_cache.match(seq) if self.prefix_cache else None
            shared = hit.num_in_use if hit else 0  # blocks other sequences hold already cost nothing
            # Admit only if the whole current sequence (not just this chunk) fits with one block of
            # growth headroom per running sequence; otherwise it would be preempted again soon. Past
            # max_preemptions, only if its full length fits: then it runs to the end.
            headroom = len(self.running) if self.running else 0
            past_limit = seq.num_preemptions > self.max_preemptions
            needed = self._full_blocks(seq) if past_limit else self.blocks.blocks_for(seq.num_tokens + self.lookahead)
            if needed - shared + headroom > self._available(seq):
                if past_limit and seq not in self.deferred:
                    self.deferred.add(seq)
                    self.num_deferred_readmissions += 1
                break
            self.waiting.popleft()
            if past_limit:
                self.deferred.discard(seq)
                self.protected.add(seq)
            seq.state_slot = self.slots.acquire()
            seq.status = SeqStatus.RUNNING
            if self.prefix_cache:  # resume from the hit
                self.prefix_cache.admit(seq, hit)
            n = shares.clip(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if self.prefix_cache:  # end the chunk on a snapshot boundary
                n = self.prefix_cache.clip(seq, n)
            self.blocks.grow(seq.block_ids, self._covered(seq, n))
            self.running.append(seq)
            plan.scheduled.append((seq, n))
            shares.took(seq)
            budget -= n
        self.waiting.extendleft(reversed(skipped))


def _rank(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.arrival_order


def _decoding(seq: Sequence) -> bool:
    """Its prompt is computed: the step runs its one new token (and any drafts)."""
    return seq.num_tokens - seq.num_computed_tokens <= 1


class _LongPrefillShare:
    """One step's limit on long prefills while other sequences decode beside them."""

    def __init__(self, sched: Scheduler, running, waiting):
        self.threshold = sched.long_prefill_token_threshold
        # a short request waiting counts as a decode to come: its first token should not wait for a whole chunk
        shared = any(_decoding(s) for s in running) or any(not self.is_long(s) for s in waiting)
        self.left = sched.max_long_partial_prefills if shared else None  # None: no limit this step

    def is_long(self, seq: Sequence) -> bool:
        return seq.num_tokens - seq.num_computed_tokens > self.threshold

    def clip(self, seq: Sequence, n: int) -> int:
        """The tokens `seq` may take of the n it asks for."""
        if self.left is None or not self.is_long(seq):
            return n
        return min(n, self.threshold) if self.left > 0 else 0

    def took(self, seq: Sequence) -> None:
        if self.left is not None and self.is_long(seq):
            self.left -= 1


class _StepTimeShare:
    """One step's prompt tokens under the latency target, planned once from the queue (plan_prompt_tokens):
    the running prompts and the waiting ones that seats and slots could admit this step."""

    def __init__(self, sched: Scheduler):
        self.threshold = sched.long_prefill_token_threshold
        decode_rows = sum(1 + len(s.drafts.tokens) for s in sched.running if _decoding(s))
        seats = min(sched.max_num_seqs - len(sched.running), sched.slots.num_free)
        prompts = [s for s in sched.running if not _decoding(s)] + list(sched.waiting)[:max(0, seats)]
        cost = sched.step_cost.cost
        target_ms = sched.max_step_ms or sched.max_step_decode_ratio * cost.predict(decode_rows)
        tokens = plan_prompt_tokens(cost, target_ms, decode_rows,
                                    [(s.num_tokens - s.num_computed_tokens, is_isolated(s)) for s in prompts],
                                    max(0, sched.max_num_batched_tokens - decode_rows), row_buckets=sched.row_buckets)
        self.allowed = {id(s): n for s, n in zip(prompts, tokens)}

    def is_long(self, seq: Sequence) -> bool:
        return seq.num_tokens - seq.num_computed_tokens > self.threshold

    def clip(self, seq: Sequence, n: int) -> int:
        return n if _decoding(seq) else min(n, self.allowed.get(id(seq), 0))

    def took(self, seq: Sequence) -> None:
        pass
