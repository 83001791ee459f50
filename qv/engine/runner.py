"""One step: a StepPlan becomes flat tensors (built with NumPy in preallocated pinned buffers and
copied to the device once), the model runs one forward over all rows, the rows that caught up
with their tokens are sampled (or, for speculative rows, verified), and the next drafts are made.
Everything comes back in one transfer (a StepOutputs, qv/engine/step_outputs.py): the only
device-to-host sync of the step (prompt logprobs, when a request asks for them, come in a bounded
copy of their own: qv/engine/prompt_logprobs.py).

`execute` launches a step and returns its StepHandle (the results' copy to pinned host memory is
queued right behind the step's kernels); `collect` waits for that copy and unpacks it. Between
the two the host may launch the next step (async scheduling, qv/engine/engine.py): a row whose
input token is still PENDING (the last step's sampled id, not on the host yet) takes it from that
step's sampled-id tensor on the device, copied into the step's ids right after the upload, in
stream order, before any kernel (or CUDA graph input copy) reads them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qv.engine.bad_words import batch_bans
from qv.engine.sampler import SamplingBatch, apply_grammar, logprobs_of, process, sample, token_bias
from qv.engine.clef_rows import ClefRows
from qv.engine.lora_rows import LoraRows
from qv.engine.cuda_graphs import DecodeGraphs
from qv.engine.multimodal import VisionSteps
from qv.engine.prompt_logprobs import PromptLogprobRows, launch_prompt_logprobs, prompt_logits_calls
from qv.engine.scheduler import StepPlan
from qv.engine.sequence import Sequence
from qv.engine.step_outputs import OutputShape, StepOutputs
from qv.engine.structured import grammar_bitmask
from qv.engine.tensor_parallel import SpecStep, TPDriver
from qv.spec.speculator import Speculator
from qv.model.batch import AttentionMeta, GDNMeta, StepBatch
from qv.model.cache import HybridCache
from qv.spec.verify import verify


@dataclass
class StepResult:
    """What one step produced for one sequence: tokens to append (1, or 1..k+1 after verification)."""

    token_ids: list[int]
    logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None  # (logprob, rank, top) per token
    num_accepted: int | None = None  # verified sequences only
    next_mtp_drafts: list[int] | None = None


@dataclass(frozen=True)
class StepCapacity:
    """The most one step holds: the one declaration that sizes the step's buffers (the runner's upload,
    the vision steps' rows)."""

    rows: int  # token rows: the token budget, plus k draft rows a sequence with speculation
    seqs: int
    blocks: int  # block-table width: max_model_len and the speculative lookahead, in blocks
    k1: int  # rows of a verifying sequence (1 without speculation)

    @classmethod
    def of(cls, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
           spec_k: int = 0) -> "StepCapacity":
        lookahead = 2 * spec_k + 2 if spec_k else 1
        return cls(rows=max_num_batched_tokens + spec_k * max_num_seqs, seqs=max_num_seqs,
                   blocks=-(-(max_model_len + lookahead) // block_size) + 1, k1=spec_k + 1)

    @property
    def upload_bytes(self) -> int:
        """per token (int64): ids, next ids, positions, slots, logits rows, Clef delta rows; per sequence:
        cu/rest/lens/slots/init, drafts and the pending-input rows, plus up to 10 sampling settings per
        logits row (k+1 rows for a verified sequence); the block tables; alignment slack"""
        return 6 * 8 * self.rows + (96 * self.k1 + 80) * (self.seqs + 1) + 4 * self.seqs * self.blocks + 16 * 64


_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32, torch.bool: np.bool_}


class _Upload:
    """All of a step's host-to-device traffic in one copy. `alloc` lays the step's arrays out one
    after another (16-byte aligned) in a pinned host byte buffer and returns the NumPy view to fill
    and the device view to read once `send` has run (stream order puts the copy before the step's
    kernels). A step without a device-to-host sync (a prefill chunk that samples nothing) can leave
    its copy queued behind the GPU's work, so `begin` waits for the event `mark` recorded after the
    step's last copy (the vision steps' own pinned buffers included) before any of them is written
    again."""

    def __init__(self, nbytes: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self._host_np = self.host.numpy()
        self.dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.copied = torch.cuda.Event() if cuda else None
        self.used = 0

    def begin(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        self.used = 0

    def alloc(self, n: int, dtype: torch.dtype) -> tuple[np.ndarray, torch.Tensor]:
        off = self.used
        end = off + n * dtype.itemsize
        if end > self.host.numel():
            raise RuntimeError(f"a step needs more than the {self.host.numel()}-byte upload buffer (a sizing bug)")
        self.used = -(-end // 16) * 16  # Triton specializes kernels on 16-byte aligned pointers
        return self._host_np[off:end].view(_NUMPY[dtype]), self.dev[off:end].view(dtype)

    def send(self) -> None:
        self.dev[:self.used].copy_(self.host[:self.used], non_blocking=True)

    def mark(self) -> None:
        """After the step's last host-to-device copy (media positions come after `send`): what the
        next `begin` waits for."""
        if self.copied is not None:
            self.copied.record(torch.cuda.current_stream(self.dev.device))


@dataclass
class _Step:
    ids: torch.Tensor
    positions: torch.Tensor
    batch: StepBatch
    seqs: list[Sequence]
    q_lens: np.ndarray
    cu: np.ndarray
    num_spec: int  # the first num_spec sequences verify drafts (k+1 rows each, all with logits)
    samplers: list[int]  # indices of the other sequences that sample one token this step
    host_ids: np.ndarray  # the step's token ids as uploaded (Clef checks what ran; valid until the next step)
    next_ids: torch.Tensor  # [T] the token after each row (MTP input; sampled rows' filled in on the device)
    sample_batch: SamplingBatch | None  # settings of the `samplers` rows
    verify_batch: SamplingBatch | None  # settings of the verification rows (k+1 per sequence)
    drafts: torch.Tensor | None  # [num_spec, k] the drafts being verified
    rope: torch.Tensor | None = None  # rotary positions when they are not the token indices (images: mRoPE)
    embeds: torch.Tensor | None = None  # input embeddings with vision rows, when a chunk holds media pads
    prompt_logprobs: PromptLogprobRows | None = None  # prompt rows' logprobs, in their own bounded copy
    graphs: DecodeGraphs | None = None  # the graphs that replayed the forward (None: it ran eagerly)
    mtp: str | None = None  # the MTP head's work after the forward (Speculator.mtp_work)
    tp_spec: SpecStep | None = None  # under tensor parallelism with speculation: the workers' view of it


@dataclass
class StepHandle:
    """A launched step. `collect` turns it into results; until then `host` may still be filling."""

    plan: StepPlan
    st: _Step
    host: torch.Tensor | None = None  # the packed StepOutputs (pinned host memory on CUDA); None: nothing sampled
    shape: OutputShape | None = None  # their sizes: what unpacks `host`
    copied: torch.cuda.Event | None = None  # recorded after the copy into `host` (CUDA only)
    sampled: torch.Tensor | None = None  # [len(samplers)] the sampled ids on the device: the next step's PENDING inputs

    @property
    def sampler_seqs(self) -> list[Sequence]:
        return [self.st.seqs[i] for i in self.st.samplers]


class ModelRunner:
    def __init__(self, model, cache: HybridCache, capacity: StepCapacity, max_model_len: int,
                 speculator: Speculator | None = None, media: VisionSteps | None = None,
                 clef: ClefRows | None = None, tp: TPDriver | None = None, lora: LoraRows | None = None):
        self.model, self.cache, self.spec, self.media = model, cache, speculator, media
        self.tp = tp  # tensor parallelism: each step goes to the workers first (qv/engine/tensor_parallel.py)
        self.clef = clef  # Clef records' rows: their low-rank deltas and joint-head inputs
        self.device = model.device
        self.block_size = cache.block_size
        self.capacity = capacity
        self.lora = lora  # served LoRA adapters: their rows join Clef's in the step's grouped deltas
        self.upload = _Upload(capacity.upload_bytes + (lora.upload_bytes if lora else 0), self.device)
        self.vocab_size = model.cfg.vocab_size
        self.max_seqs, self.max_blocks, self.max_model_len = capacity.seqs, capacity.blocks, max_model_len
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None
        self.last: StepHandle | None = None  # the last step launched: where PENDING input tokens come from

    def enable_decode_graphs(self, scratch_slot: int) -> None:
        """Capture and check the decode graphs, and with speculation the verification graphs (k+1 rows a
        sequence) and the MTP head's; StartupError (graphs left off) where one fails."""
        slots = self.lora.max_loras + 1 if self.lora else 0  # LoRA rows replay too (fixed-capacity bank slots)
        graphs = DecodeGraphs(self.model, self.cache, self.max_seqs, self.max_blocks, self.max_model_len,
                              scratch_slot, spec=self.spec, delta_slots=slots)
        graphs.capture()
        self.graphs = graphs
        if self.spec is not None:
            verify = DecodeGraphs(self.model, self.cache, self.spec.max_seqs, self.max_blocks, self.max_model_len,
                                  scratch_slot, rows_per_seq=self.spec.k + 1, spec=self.spec, pool=graphs.pool,
                                  delta_slots=slots)
            verify.capture()
            self.verify_graphs = verify

    def _graphs_for(self, st: "_Step") -> DecodeGraphs | None:
        """The graphs that can replay this step's forward: decode steps whose sequences all run one row, or
        all verify k+1 rows (qv/engine/scheduler.py evens a decode step's drafts out for this), with token
        positions as rotary positions, no vision rows and no Clef-only delta rows (rows grouped by slot, as
        LoRA's, replay)."""
        if (self.graphs is None or st.rope is not None or st.embeds is not None
                or isinstance(st.batch.delta_rows, torch.Tensor)):  # Clef's plain rows: no graph holds them
            return None
        n, rows = len(st.seqs), len(st.host_ids)
        if st.num_spec == 0 and rows == n:
            graphs = self.graphs
        elif st.num_spec == n and self.verify_graphs is not None and rows == n * self.verify_graphs.q:
            graphs = self.verify_graphs
        else:
            return None
        return graphs if graphs.bucket(n) is not None else None

    def _forward(self, st: "_Step") -> torch.Tensor:
        """Replay a captured graph where one fits the step (st.graphs); run eagerly otherwise."""
        if self.tp is not None:  # the workers run the same forward, compute_logits calls and speculation
            st.tp_spec = None if self.spec is None else SpecStep(
                st.num_spec, st.batch.gdn.num_spec_tokens, self.spec.k + 1, tuple(st.samplers), st.mtp,
                _draft_max_len(st))
            self.tp.send_step(self.upload.dev, self.upload.used, st.ids, st.positions, st.batch,
                              prompt_logits_calls(st.seqs, st.cu, self.vocab_size), spec=st.tp_spec,
                              next_ids=st.next_ids)
        st.graphs = self._graphs_for(st)
        if st.graphs is not None:
            return st.graphs.run(st.batch, st.ids, st.positions)
        pos = st.positions if st.rope is None else st.rope
        return self.model.forward(st.ids, pos, st.batch, self.cache, inputs_embeds=st.embeds)

    # -- batch construction --------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> _Step:
        up = self.upload
        up.begin()
        # verification rows first, so the GDN layers can keep their per-position states as a prefix
        sched = sorted(plan.scheduled, key=lambda sn: not sn[0].draft_token_ids)
        seqs = [s for s, _ in sched]
        num_spec = sum(1 for s in seqs if s.draft_token_ids)
        q_lens = np.fromiter((n for _, n in sched), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        nseq, ntok = len(seqs), int(q_lens.sum())
        width = max(1, max(len(s.block_ids) for s in seqs))
        cu, cu_d = up.alloc(nseq + 1, torch.int32)
        seq_lens, seq_lens_d = up.alloc(nseq, torch.int32)
        has_init, has_init_d = up.alloc(nseq, torch.bool)
        slots, slots_d = up.alloc(nseq, torch.int64)
        tables, tables_d = up.alloc(nseq * width, torch.int32)
        tables, tables_d = tables.reshape(nseq, width), tables_d.view(nseq, width)
        ids, ids_d = up.alloc(ntok, torch.int64)
        next_ids, next_ids_d = up.alloc(ntok, torch.int64)
        positions, positions_d = up.alloc(ntok, torch.int64)
        slot_mapping, slot_mapping_d = up.alloc(ntok, torch.int64)
        logits_idx, logits_idx_d = up.alloc(ntok, torch.int64)
        cu[0] = 0
        np.cumsum(q_lens, out=cu[1:])
        ends = starts + q_lens
        seq_lens[:] = ends
        has_init[:] = starts > 0
        samplers, pending, n_logits = [], [], 0
        for i, (seq, n) in enumerate(sched):
            tables[i, :len(seq.block_ids)] = seq.block_ids
            tables[i, len(seq.block_ids):] = 0
            slots[i] = seq.state_slot
            start, c0 = int(starts[i]), int(cu[i])
            known = min(n, seq.num_tokens - start)
            ids[c0:c0 + known] = seq.token_slice(start, start + known)
            ids[c0 + known:c0 + n] = seq.draft_token_ids
            if known and start + known == seq.num_tokens and seq.has_pending:
                pending.append((c0 + known - 1, seq))  # its last token is still on the device
            # the token after each row (MTP input); a sampled/verified row's is filled on the device
            next_ids[c0:c0 + n - 1] = ids[c0 + 1:c0 + n]
            next_ids[c0 + n - 1] = seq.token_at(start + n) if start + n < seq.num_tokens else 0
            if seq.draft_token_ids:
                logits_idx[n_logits:n_logits + n] = np.arange(c0, c0 + n)
                n_logits += n
            elif start + n == seq.num_tokens and not (self.clef and self.clef.owns(seq)):  # records never sample
                samplers.append(i)
        for i in samplers:
            logits_idx[n_logits] = cu[i + 1] - 1
            n_logits += 1
        row_of = np.repeat(np.arange(nseq), q_lens)
        pos = np.arange(ntok) - cu[row_of] + starts[row_of]
        positions[:] = pos
        slot_mapping[:] = tables[row_of, pos // self.block_size] * self.block_size + pos % self.block_size
        if num_spec:
            rest, rest_d = up.alloc(nseq - num_spec + 1, torch.int32)
            rest[:] = cu[num_spec:nseq + 1] - cu[num_spec]
            gdn = self.spec.gdn_meta(slots_d, has_init_d, num_spec, int(cu[num_spec]), rest_d)
        else:
            gdn = GDNMeta(slots_d, has_init_d)
        k1 = self.spec.k + 1 if self.spec else 1
        specs = seqs[:num_spec]
        verify_batch = self.sampling_batch([(s, j) for s in specs for j in range(k1)]) if num_spec else None
        drafts = None
        if num_spec:
            drafts_h, drafts = up.alloc(num_spec * (k1 - 1), torch.int64)
            drafts_h[:] = [t for s in specs for t in s.draft_token_ids]
            drafts = drafts.view(num_spec, k1 - 1)
        sample_batch = self.sampling_batch([(seqs[i], 0) for i in samplers]) if samplers else None
        batch = StepBatch(
            cu_seqlens_q=cu_d, max_query_len=int(q_lens.max()),
            attn=AttentionMeta(slot_mapping=slot_mapping_d, block_tables=tables_d, seq_lens=seq_lens_d,
                               max_seq_len=int(ends.max())),
            gdn=gdn, logits_indices=logits_idx_d[:n_logits],
            delta_rows=self._delta_rows(seqs, cu))
        fill = self._pending_rows(pending) if pending else None
        up.send()  # the step's one host-to-device copy
        if fill is not None:  # in stream order after the copy, before anything reads the ids
            ids_d.index_copy_(0, fill[0], self.last.sampled.index_select(0, fill[1]))
        st = _Step(ids=ids_d, positions=positions_d, batch=batch, seqs=seqs, q_lens=q_lens, cu=cu.copy(),
                   num_spec=num_spec, samplers=samplers, host_ids=ids, next_ids=next_ids_d, sample_batch=sample_batch,
                   verify_batch=verify_batch, drafts=drafts)
        if self.media is not None:  # images/videos: encode what the step needs, mRoPE positions, vision rows
            st.rope, st.embeds = self.media.step_inputs(self.model, seqs, starts, q_lens, cu, pos, st.ids)
        up.mark()  # the media's pinned buffers are rewritten next step too: one event covers both
        return st

    def _delta_rows(self, seqs: list[Sequence], cu: np.ndarray):
        """The rows that run low-rank deltas: Clef records' and LoRA adapters' (grouped by bank slot)."""
        if self.lora is not None:
            return self.lora.delta_rows(seqs, cu, self.upload.alloc, self.clef)
        return self.clef.delta_rows(seqs, cu, self.upload.alloc) if self.clef else None

    def _pending_rows(self, pending: list[tuple[int, Sequence]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows of the step's ids, their indices in the last step's sampled ids) on the device."""
        last = self.last
        index = {s: j for j, s in enumerate(last.sampler_seqs)} if last is not None and last.sampled is not None else {}
        missing = [s.request_id for _, s in pending if s not in index]
        if missing:
            raise RuntimeError(f"requests {missing} have a pending token the last step did not sample (a bug)")
        rows, rows_d = self.upload.alloc(len(pending), torch.int64)
        src, src_d = self.upload.alloc(len(pending), torch.int64)
        rows[:] = [r for r, _ in pending]
        src[:] = [index[s] for _, s in pending]
        return rows_d, src_d

    # -- the step ------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepHandle:
        """Launch the step; its results come from `collect`. With nothing in flight this is the whole step."""
        if self.tp is None:
            return self._execute(plan)
        with self.tp.guard():  # a dead worker: TensorParallelError, not a hang
            return self._execute(plan)

    def _execute(self, plan: StepPlan) -> StepHandle:
        """The step's three stages: its inputs (prepare: one upload), the forward (eager, a replayed graph,
        or with the tensor-parallel workers), its outputs (one StepOutputs, packed for one copy back)."""
        st = self.prepare(plan)
        st.mtp = self.spec.mtp_work(st.seqs) if self.spec else None  # before the forward: the workers' message says it
        hidden = self._forward(st)
        st.prompt_logprobs = launch_prompt_logprobs(self.model, st.seqs, st.cu, hidden, st.next_ids, self.vocab_size)
        if self.clef is not None:  # Clef records: their rows into the joint head, chunk by chunk
            self.clef.take_hidden(st.seqs, st.cu, hidden, st.host_ids)
        o, shape = self._outputs(st, hidden)
        host, copied = _to_host(o.pack(shape, self.device)) if shape is not None else (None, None)
        self.last = StepHandle(plan=plan, st=st, host=host, shape=shape, copied=copied, sampled=o.sampled)
        return self.last

    def _outputs(self, st: _Step, hidden: torch.Tensor) -> tuple[StepOutputs, OutputShape | None]:
        """Sampling, verification and the MTP head after the forward: the step's outputs on the device
        (shape None: no row has logits and nothing comes back)."""
        o = StepOutputs()
        if st.batch.logits_indices.numel() == 0:
            if st.mtp:  # the head's KV must still catch up with these rows
                self._mtp(st, hidden, None, None, None, "catch_up")
            return o, None
        logits = self.model.compute_logits(hidden[st.batch.logits_indices])[:, :self.vocab_size]
        k1 = self.spec.k + 1 if self.spec else 1
        n_spec_rows = st.num_spec * k1
        if st.samplers:
            sb = st.sample_batch
            out = sample(logits[n_spec_rows:], sb)
            o.sampled = out.token_ids
            if sb.max_logprobs >= 0:
                o.sample_logprob, o.sample_rank = out.logprobs, out.ranks
                o.sample_top_ids, o.sample_top_logprobs = out.top_ids, out.top_logprobs
        if st.num_spec:
            self._verify(st, logits[:n_spec_rows], k1, o)
        if self.tp is not None and (st.num_spec or st.mtp):  # the workers commit and draft from the same outcome
            self.tp.send_outcome(st.tp_spec, o.sampled, o.verified, o.accepted)
        o.drafts = self._mtp(st, hidden, o.sampled, o.verified, o.accepted, st.mtp) if st.mtp else None
        return o, OutputShape(samplers=len(st.samplers), verified=st.num_spec, k1=k1,
                              sample_top=st.sample_batch.max_logprobs if st.samplers else -1,
                              verify_top=st.verify_batch.max_logprobs if st.num_spec else -1,
                              draft_k=self.spec.k if o.drafts is not None else 0)

    def collect(self, h: StepHandle) -> dict[Sequence, StepResult]:
        """Wait for a launched step's results (the step's one device-to-host sync) and unpack them."""
        if h.st.prompt_logprobs is not None:  # its own bounded copy, queued before the results
            h.st.prompt_logprobs.deliver()
        if h.host is None:
            return {}
        if h.copied is not None:
            h.copied.synchronize()
        return _results(h.st, StepOutputs.unpack(h.host.numpy(), h.shape))

    def _verify(self, st: _Step, logits: torch.Tensor, k1: int, o: StepOutputs) -> None:
        """Verify the drafts (their tokens and accepted counts, and logprobs where asked, into `o`) and
        commit the accepted positions' GDN states."""
        sb = st.verify_batch
        apply_grammar(logits, sb)  # as sample() does: a draft its grammar refuses gets probability 0
        greedy_ids, probs = process(logits, sb)
        greedy_rows = sb.temperature.view(-1, k1)[:, 0] == 0
        res = verify(greedy_ids.view(-1, k1), None if probs is None else probs.view(st.num_spec, k1, -1), st.drafts,
                     greedy_rows, sb.seeds.view(-1, k1)[:, 0], sb.positions.view(-1, k1)[:, 0])
        if st.graphs is None or not st.graphs.run_commit(res.num_accepted):
            self.spec.commit(st.batch.gdn.state_slots[:st.num_spec], res.num_accepted)
        o.verified, o.accepted = res.tokens, res.num_accepted
        if sb.max_logprobs >= 0:
            o.verify_logprob, o.verify_rank, o.verify_top_ids, o.verify_top_logprobs = logprobs_of(
                logits, res.tokens.reshape(-1), sb.max_logprobs)

    def _mtp(self, st: _Step, hidden, sampled, tokens, n_acc, kind: str) -> torch.Tensor | None:
        """The MTP head after the step (on the device, no sync): its KV catches up with the step's rows, then
        ("draft") k drafts for every sequence that got a new token. Replays the head's graph where the
        forward replayed one."""
        next_ids = st.next_ids
        draft_rows = self.spec.mtp_inputs(next_ids, st.batch.logits_indices, st.num_spec, tokens, n_acc, sampled, kind)
        kind = "draft" if draft_rows is not None else "catch_up"  # no sequence got a token: nothing to draft from
        if st.graphs is not None and st.graphs.can_run_mtp(len(st.seqs), kind):
            return st.graphs.run_mtp(kind, next_ids, draft_rows)
        draft_seqs = self.spec.drafting_seqs(st.num_spec, st.samplers)
        deltas = None
        if st.rope is not None and draft_rows is not None:
            deltas = self.media.draft_deltas(st.seqs, draft_seqs, self.device)
        return self.spec.mtp_eager(st.positions, hidden, st.batch, next_ids, draft_rows, draft_seqs, _draft_max_len(st),
                                   rope=st.rope, rope_delta=deltas)

    # -- sampling settings ---------------------------------------------------------------------
    def sampling_batch(self, rows: list[tuple[Sequence, int]]) -> SamplingBatch:
        """Settings per logits row, in the step's upload; row (seq, j) decides the seq's output token
        number len(outputs) + j, with drafts d_1..d_j counted as already generated (penalties,
        min_tokens). The rare [rows, vocab] penalty and min_tokens masks are built on the device."""
        dev, vocab, alloc = self.device, self.vocab_size, self.upload.alloc
        ps = [s.params for s, _ in rows]

        def t(xs, dtype):
            host, device = alloc(len(xs), dtype)
            host[:] = xs
            return device

        outputs = [s.output_token_ids + s.draft_token_ids[:j] for s, j in rows]
        # a grammar row's end is its grammar's: min_tokens would mask the only token it may take
        under_min = [len(o) < s.params.min_tokens and s.matcher is None for o, (s, _) in zip(outputs, rows)]
        b = SamplingBatch(
            temperature=t([0.0 if p.greedy else p.temperature for p in ps], torch.float32),
            top_p=t([p.top_p for p in ps], torch.float32), top_k=t([p.top_k for p in ps], torch.int64),
            min_p=t([p.min_p for p in ps], torch.float32), seeds=t([s.rng_seed for s, _ in rows], torch.int64),
            positions=t([len(o) for o in outputs], torch.int64), all_greedy=all(p.greedy for p in ps),
            max_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1))
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in ps):
            b.presence = t([p.presence_penalty for p in ps], torch.float32)
            b.frequency = t([p.frequency_penalty for p in ps], torch.float32)
            b.repetition = t([p.repetition_penalty for p in ps], torch.float32)
            b.output_counts = _counts(outputs, vocab, dev)
            b.prompt_mask = _counts([s.prompt_token_ids for s, _ in rows], vocab, dev) > 0
        if any(s.matcher is not None for s, _ in rows):  # row j of a verified sequence: after its first j drafts
            b.grammar = grammar_bitmask([(s.matcher, s.draft_token_ids[:j]) for s, j in rows], vocab, dev)
        if any(under_min):
            b.stop_mask_rows = t(under_min, torch.bool)
            b.stop_token_mask = _counts([s.stop_ids_for_min_tokens for s, _ in rows], vocab, dev) > 0
        biased = [i for i, p in enumerate(ps) if p.logit_bias or p.allowed_token_ids]
        if biased:
            b.bias_rows, b.bias = t(biased, torch.int64), token_bias([ps[i] for i in biased], vocab, dev)
        bans = batch_bans(ps, outputs)
        if bans is not None:
            b.ban_rows, b.ban_ids = t(bans[0], torch.int64), t(bans[1], torch.int64)
        return b


def _draft_max_len(st: _Step) -> int:
    """The longest sequence's length after the step: what the MTP walk's attention bounds its keys by."""
    return int(max(s.num_computed_tokens for s in st.seqs) + st.q_lens.max())


def _to_host(packed: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Queue the copy of a step's packed results into pinned host memory (no sync here)."""
    if packed.device.type != "cuda":
        return packed, None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(packed.device))
    return host, copied


def _results(st: _Step, o: StepOutputs) -> dict[Sequence, StepResult]:
    """Each sequence's StepResult from a step's unpacked outputs."""
    results: dict[Sequence, StepResult] = {}
    sampler_seqs = [st.seqs[i] for i in st.samplers]
    lps = _logprob_lists(o.sample_logprob, o.sample_rank, o.sample_top_ids, o.sample_top_logprobs, sampler_seqs, 1)
    for j, s in enumerate(sampler_seqs):
        results[s] = StepResult([int(o.sampled[j])], lps[j] if lps else None)
    specs = st.seqs[:st.num_spec]
    k1 = o.verified.shape[1] if specs else 1
    lps = _logprob_lists(o.verify_logprob, o.verify_rank, o.verify_top_ids, o.verify_top_logprobs, specs, k1)
    for j, s in enumerate(specs):
        a = int(o.accepted[j])
        results[s] = StepResult(o.verified[j, :a + 1].tolist(), lps[j][:a + 1] if lps else None, num_accepted=a)
    if o.drafts is not None:
        for j, s in enumerate(specs + sampler_seqs):
            results[s].next_mtp_drafts = o.drafts[j].tolist()
    return results


def _logprob_lists(lp, ranks, top_ids, top_lp, seqs: list[Sequence], per_seq: int):
    """Per sequence, per row: (logprob, rank, [(top id, top logprob)] as many as the sequence asked)."""
    if lp is None:
        return None
    out = []
    for j, s in enumerate(seqs):
        want = s.params.logprobs or 0
        out.append([(float(lp[r]), int(ranks[r]), [(int(top_ids[r, m]), float(top_lp[r, m])) for m in range(want)])
                    for r in range(j * per_seq, (j + 1) * per_seq)])
    return out


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
