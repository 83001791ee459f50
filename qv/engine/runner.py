"""One step: a StepPlan becomes the step's inputs (named persistent buffers, qv/engine/step_inputs.py:
filled with NumPy in pinned host memory and sent in one upload; the batch is views of them), the
model runs one forward over all rows (eagerly, replayed from a CUDA graph that captured those same
buffers, or with the tensor-parallel workers), the rows that caught up with their tokens are sampled
(or, for speculative rows, verified), and the next drafts are made. Everything comes back in one
transfer (a StepOutputs, qv/engine/step_outputs.py): the only device-to-host sync of the step (prompt
logprobs, when a request asks for them, come in a bounded copy of their own:
qv/engine/prompt_logprobs.py).

`execute` launches a step and returns its StepHandle (the results' copy to pinned host memory is
queued right behind the step's kernels); `collect` waits for that copy and unpacks it. Between
the two the host may launch the next step (async scheduling, qv/engine/engine.py): a row whose
input token is still PENDING (the last step's sampled id, not on the host yet) takes it from that
step's sampled-id tensor on the device, copied into the step's ids right after the upload, in
stream order, before any kernel (or graph replay) reads them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from qv.engine.bad_words import batch_bans
from qv.engine.sampler import SamplingBatch, apply_grammar, logprobs_of, process, sample, token_bias
from qv.engine.cuda_graphs import DecodeGraphs
from qv.engine.piecewise_graphs import PiecewiseGraphs
from qv.engine.multimodal import VisionSteps
from qv.engine.prompt_logprobs import PromptLogprobRows, launch_prompt_logprobs
from qv.engine.scheduler import StepPlan
from qv.engine.sequence import Sequence
from qv.engine.step_inputs import StepCapacity, StepInputs, StepShape
from qv.engine.step_outputs import OutputShape, StepOutputs
from qv.engine.step_feature import StepFeature
from qv.engine.step_structured import StructuredOutputs
from qv.engine.tensor_parallel import SingleRank, SpecStep, TPDriver
from qv.spec.speculator import Speculator
from qv.model.batch import StepBatch
from qv.model.cache import HybridCache
from qv.spec.verify import verify


@dataclass
class StepResult:
    """What one step produced for one sequence: tokens to append (1, or 1..k+1 after verification)."""

    token_ids: list[int]
    logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None  # (logprob, rank, top) per token
    num_accepted: int | None = None  # verified sequences only
    next_mtp_drafts: list[int] | None = None


@dataclass
class _Step:
    ids: torch.Tensor
    positions: torch.Tensor
    batch: StepBatch
    shape: StepShape  # its sizes: what cut the persistent input fields into the views here
    seqs: list[Sequence]
    q_lens: np.ndarray
    cu: np.ndarray
    samplers: list[int]  # indices of the sequences (after the shape.num_spec verifying ones) that sample one token
    host_ids: np.ndarray  # the step's token ids as uploaded (Clef checks what ran; valid until the next step)
    next_ids: torch.Tensor  # [T] the token after each row (MTP input; sampled rows' filled in on the device)
    sample_batch: SamplingBatch | None  # settings of the `samplers` rows
    verify_batch: SamplingBatch | None  # settings of the verification rows (k+1 per sequence)
    drafts: torch.Tensor | None  # [num_spec, k] the drafts being verified
    graphs: DecodeGraphs | None = None  # the graphs that replay the forward (None: it runs eagerly)
    pieces: PiecewiseGraphs | None = None  # or the graphs that replay its token-wise parts
    rope: torch.Tensor | None = None  # rotary positions when they are not the token indices (images: mRoPE)
    embeds: torch.Tensor | None = None  # input embeddings with vision rows, when a chunk holds media pads
    prompt_logprobs: PromptLogprobRows | None = None  # prompt rows' logprobs, in their own bounded copy
    mtp: str | None = None  # the MTP head's work after the forward (Speculator.mtp_work)
    tp_spec: SpecStep | None = None  # under tensor parallelism with speculation: the workers' view of it

    @property
    def draft_max_len(self) -> int:
        """The longest sequence's length after the step: what the MTP walk's attention bounds its keys by."""
        return int(max(s.num_computed_tokens for s in self.seqs) + self.q_lens.max())

    @property
    def num_spec(self) -> int:
        """The first num_spec sequences verify drafts (k+1 rows each, all with logits)."""
        return self.shape.num_spec


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
                 features: list[StepFeature], speculator: Speculator | None, media: VisionSteps | None,
                 structured: StructuredOutputs, tp: TPDriver | None = None):
        self.model, self.cache, self.spec, self.media = model, cache, speculator, media
        self.features = features  # what plugs into the step (qv/engine/step_feature.py): Clef rows' hooks run here
        self.structured = structured  # grammar masks of the sampling rows
        self.tp = tp or SingleRank()  # tensor parallelism: each step goes to the workers first
        self.device = model.device
        self.block_size = cache.block_size
        self.capacity = capacity
        self.inputs = StepInputs(capacity, self.device)  # the step's named input buffers, allocated once
        self.vocab_size = model.cfg.vocab_size
        self.max_seqs, self.max_model_len = capacity.seqs, max_model_len
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: DecodeGraphs | None = None
        self.pieces: PiecewiseGraphs | None = None
        self.scratch_slot = -1  # the GDN slot padding rows of a replayed graph use (enable_decode_graphs)
        self.last: StepHandle | None = None  # the last step launched: where PENDING input tokens come from

    def enable_decode_graphs(self, scratch_slot: int) -> None:
        """Capture and check the decode graphs, and with speculation the verification graphs (k+1 rows a
        sequence) and the MTP head's; StartupError (graphs left off) where one fails. They capture views
        of the step's input fields: a replay reads what the step's upload wrote."""
        self.scratch_slot = scratch_slot
        graphs = DecodeGraphs(self.model, self.cache, self.inputs, self.max_seqs, self.max_model_len, scratch_slot,
                              spec=self.spec)
        graphs.capture()
        self.graphs = graphs
        if self.spec is not None:
            verify = DecodeGraphs(self.model, self.cache, self.inputs, self.spec.max_seqs, self.max_model_len,
                                  scratch_slot, rows_per_seq=self.spec.k + 1, spec=self.spec, pool=graphs.pool)
            verify.capture()
            self.verify_graphs = verify

    def enable_piecewise_graphs(self, max_rows: int, deltas: bool = True) -> None:
        """Capture and check the piecewise graphs of steps with prompt rows (qv/engine/piecewise_graphs.py),
        in the decode graphs' pool; StartupError where one fails. deltas: they launch the grouped deltas."""
        pieces = PiecewiseGraphs(self.model, self.cache, self.inputs, max_rows, self.scratch_slot, deltas=deltas,
                                 pool=self.graphs.pool if self.graphs is not None else None)
        pieces.capture()
        self.pieces = pieces

    def _pieces_for(self, seqs: list[Sequence], num_spec: int, rows: int) -> PiecewiseGraphs | None:
        """The piecewise graphs for a step no decode graph replays: no verification rows, at most their
        largest size, no media rows (the vision steps' replayable: mRoPE positions, vision embeddings)."""
        p = self.pieces
        if p is None or num_spec or p.bucket(rows) is None:
            return None
        return p if all(f.replayable(seqs, p.deltas) for f in self.features) else None

    def _graphs_for(self, seqs: list[Sequence], num_spec: int, rows: int) -> DecodeGraphs | None:
        """The graphs that can replay a step's forward: decode steps whose sequences all run one row, or
        all verify k+1 rows (qv/engine/scheduler.py evens a decode step's drafts out for this), with token
        positions as rotary positions, no vision rows and, unless LoRA adapters' slots exist (then the graphs
        launch the grouped deltas over the step's delta fields), no Clef record's delta rows."""
        deltas = self.inputs.capacity.lora_slots  # the decode graphs launch the grouped deltas
        if self.graphs is None or not all(f.replayable(seqs, deltas) for f in self.features):
            return None
        n = len(seqs)
        if num_spec == 0 and rows == n:
            graphs = self.graphs
        elif num_spec == n and self.verify_graphs is not None and rows == n * self.verify_graphs.q:
            graphs = self.verify_graphs
        else:
            return None
        return graphs if graphs.bucket(n) is not None else None

    def _forward(self, st: _Step) -> torch.Tensor:
        """The step's forward: with the tensor-parallel workers, replayed from a graph, or eagerly."""
        self.tp.send_step(self.inputs, st, self.vocab_size)  # the workers run the same forward (one rank: nothing)
        if st.graphs is not None:
            return st.graphs.run(st.shape.rows)
        if st.pieces is not None:
            return st.pieces.run(st.shape.rows, st.batch)
        pos = st.positions if st.rope is None else st.rope
        return self.model.forward(st.ids, pos, st.batch, self.cache, inputs_embeds=st.embeds)

    # -- the step's inputs ----------------------------------------------------------------------
    def prepare(self, plan: StepPlan) -> _Step:
        """Fill the step's host fields (qv/engine/step_inputs.py), padded to a graph's size where one will
        replay the forward, and send them in the step's one upload; the batch is views of the device fields."""
        inp, h = self.inputs, self.inputs.host
        inp.begin()
        # verification rows first, so the GDN layers can keep their per-position states as a prefix
        sched = sorted(plan.scheduled, key=lambda sn: not sn[0].drafts.tokens)
        seqs = [s for s, _ in sched]
        num_spec = sum(1 for s in seqs if s.drafts.tokens)
        q_lens = np.fromiter((n for _, n in sched), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        nseq, ntok = len(seqs), int(q_lens.sum())
        graphs = self._graphs_for(seqs, num_spec, ntok)
        pad_seqs = graphs.bucket(nseq) if graphs is not None else 0
        pieces = self._pieces_for(seqs, num_spec, ntok) if graphs is None else None
        width = max(1, max(len(s.block_ids) for s in seqs))
        tables = inp.host_table(self.capacity.blocks if graphs is not None else width)  # as the graph captured it
        cu, ids, next_ids, logits_idx = h["cu_seqlens_q"][:nseq + 1], h["ids"], h["next_ids"], h["logits_indices"]
        cu[0] = 0
        np.cumsum(q_lens, out=cu[1:])
        ends = starts + q_lens
        h["seq_lens"][:nseq] = ends
        h["has_initial_state"][:nseq] = starts > 0
        samplers, pending, n_logits = [], [], 0
        for i, (seq, n) in enumerate(sched):
            tables[i, :len(seq.block_ids)] = seq.block_ids
            tables[i, len(seq.block_ids):width] = 0
            h["state_slots"][i] = seq.state_slot
            start, c0 = int(starts[i]), int(cu[i])
            known = min(n, seq.num_tokens - start)
            ids[c0:c0 + known] = seq.token_slice(start, start + known)
            ids[c0 + known:c0 + n] = seq.drafts.tokens
            if known and start + known == seq.num_tokens and seq.has_pending:
                pending.append((c0 + known - 1, seq))  # its last token is still on the device
            # the token after each row (MTP input); a sampled/verified row's is filled on the device
            next_ids[c0:c0 + n - 1] = ids[c0 + 1:c0 + n]
            next_ids[c0 + n - 1] = seq.token_at(start + n) if start + n < seq.num_tokens else 0
            if seq.drafts.tokens:
                logits_idx[n_logits:n_logits + n] = np.arange(c0, c0 + n)
                n_logits += n
            elif start + n == seq.num_tokens and all(f.samples(seq) for f in self.features):  # Clef records never do
                samplers.append(i)
        for i in samplers:
            logits_idx[n_logits] = cu[i + 1] - 1
            n_logits += 1
        row_of = np.repeat(np.arange(nseq), q_lens)
        pos = np.arange(ntok) - cu[row_of] + starts[row_of]
        h["positions"][:ntok] = pos
        h["slot_mapping"][:ntok] = tables[row_of, pos // self.block_size] * self.block_size + pos % self.block_size
        k = self.capacity.k1 - 1
        if num_spec:
            h["cu_seqlens_rest"][:nseq - num_spec + 1] = cu[num_spec:nseq + 1] - cu[num_spec]
            h["drafts"][:num_spec * k] = [t for s in seqs[:num_spec] for t in s.drafts.tokens]
        # the low-rank delta rows: Clef's records' (plain), or every delta row grouped by bank slot (LoRA)
        filled = {name: n for f in self.features for name, n in f.fill_inputs(seqs, cu, h).items()}
        slot_starts = filled.get("delta_slot_start", 0)
        if pending:
            self._pending_rows(pending)
        shape = StepShape(seqs=nseq, rows=ntok, logits=n_logits, width=width, max_query_len=int(q_lens.max()),
                          max_seq_len=int(ends.max()), num_spec=num_spec, spec_rows=int(cu[num_spec]), draft_k=k,
                          delta_rows=filled.get("delta_rows", 0), delta_slot_starts=slot_starts,
                          delta_max_rows=int(np.diff(h["delta_slot_start"][:slot_starts]).max()) if slot_starts else 0,
                          pending=len(pending), pad_seqs=pad_seqs,
                          pad_rows=pad_seqs * graphs.q if graphs is not None else pieces.bucket(ntok) if pieces else 0)
        if graphs is not None or pieces is not None:
            inp.pad(shape, self.scratch_slot)
        k1 = k + 1
        verify_batch = self.sampling_batch([(s, j) for s in seqs[:num_spec] for j in range(k1)]) if num_spec else None
        sample_batch = self.sampling_batch([(seqs[i], 0) for i in samplers]) if samplers else None
        inp.send(shape)  # the step's one upload
        ids_d = inp.field("ids", ntok)
        if pending:  # in stream order after the upload, before anything reads the ids
            ids_d.index_copy_(0, inp.field("pending_rows", len(pending)),
                              self.last.sampled.index_select(0, inp.field("pending_src", len(pending))))
        st = _Step(ids=ids_d, positions=inp.field("positions", ntok), batch=inp.batch(shape, self.spec), shape=shape,
                   seqs=seqs, q_lens=q_lens, cu=cu.copy(), samplers=samplers, host_ids=ids[:ntok],
                   next_ids=inp.field("next_ids", ntok), sample_batch=sample_batch, verify_batch=verify_batch,
                   drafts=inp.field("drafts", num_spec * k).view(num_spec, k) if num_spec else None, graphs=graphs,
                   pieces=pieces)
        if self.media is not None:  # images/videos: encode what the step needs, mRoPE positions, vision rows
            st.rope, st.embeds = self.media.step_inputs(self.model, seqs, starts, q_lens, cu, pos, st.ids)
        inp.mark()  # the media's pinned buffers are rewritten next step too: one event covers both
        return st

    def _pending_rows(self, pending: list[tuple[int, Sequence]]) -> None:
        """Rows of the step's ids whose token the last step sampled, and their indices in its sampled ids."""
        last = self.last
        index = {s: j for j, s in enumerate(last.sampler_seqs)} if last is not None and last.sampled is not None else {}
        missing = [s.request_id for _, s in pending if s not in index]
        if missing:
            raise RuntimeError(f"requests {missing} have a pending token the last step did not sample (a bug)")
        self.inputs.host["pending_rows"][:len(pending)] = [r for r, _ in pending]
        self.inputs.host["pending_src"][:len(pending)] = [index[s] for _, s in pending]

    # -- the step ------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepHandle:
        """Launch the step; its results come from `collect`. With nothing in flight this is the whole step."""
        with self.tp.guard():  # a dead tensor-parallel worker: TensorParallelError, not a hang
            return self._execute(plan)

    def _execute(self, plan: StepPlan) -> StepHandle:
        """The step's three stages: its inputs (prepare: one upload), the forward (eager, a replayed graph,
        or with the tensor-parallel workers), its outputs (one StepOutputs, packed for one copy back)."""
        st = self.prepare(plan)
        st.mtp = self.spec.mtp_work(st.seqs) if self.spec else None  # before the forward: the workers' message says it
        hidden = self._forward(st)
        st.prompt_logprobs = launch_prompt_logprobs(self.model, st.seqs, st.cu, hidden, st.next_ids, self.vocab_size)
        for f in self.features:  # Clef records: their rows into the joint head, chunk by chunk
            f.take_hidden(st.seqs, st.cu, hidden, st.host_ids)
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
        k1 = self.capacity.k1
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
        self.tp.send_outcome(st.tp_spec, o.sampled, o.verified, o.accepted)  # the workers commit and draft from it
        o.drafts = self._mtp(st, hidden, o.sampled, o.verified, o.accepted, st.mtp) if st.mtp else None
        return o, OutputShape(samplers=len(st.samplers), verified=st.num_spec, k1=k1,
                              sample_top=st.sample_batch.max_logprobs if st.samplers else -1,
                              verify_top=st.verify_batch.max_logprobs if st.num_spec else -1,
                              draft_k=k1 - 1 if o.drafts is not None else 0)

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
            return st.graphs.run_mtp(kind, len(st.seqs), draft_rows)
        draft_seqs = self.spec.drafting_seqs(st.num_spec, st.samplers)
        deltas = None
        if st.rope is not None and draft_rows is not None:
            deltas = self.media.draft_deltas(st.seqs, draft_seqs, self.device)
        return self.spec.mtp_eager(st.positions, hidden, st.batch, next_ids, draft_rows, draft_seqs, st.draft_max_len,
                                   rope=st.rope, rope_delta=deltas)

    # -- sampling settings ---------------------------------------------------------------------
    def sampling_batch(self, rows: list[tuple[Sequence, int]]) -> SamplingBatch:
        """Settings per logits row, in the step's `sampling` input field; row (seq, j) decides the seq's output token
        number len(outputs) + j, with drafts d_1..d_j counted as already generated (penalties,
        min_tokens). The rare [rows, vocab] penalty and min_tokens masks are built on the device."""
        dev, vocab, alloc = self.device, self.vocab_size, self.inputs.alloc
        ps = [s.params for s, _ in rows]

        def t(xs, dtype):
            host, device = alloc(len(xs), dtype)
            host[:] = xs
            return device

        outputs = [s.output_token_ids + s.drafts.tokens[:j] for s, j in rows]
        # a grammar row's end is its grammar's: min_tokens would mask the only token it may take
        under_min = [len(o) < s.params.min_tokens and not self.structured.constrains(s)
                     for o, (s, _) in zip(outputs, rows)]
        b = SamplingBatch(
            temperature=t([0.0 if p.greedy else p.temperature for p in ps], torch.float32),
            top_p=t([p.top_p for p in ps], torch.float32), top_k=t([p.top_k for p in ps], torch.int64),
            min_p=t([p.min_p for p in ps], torch.float32), seeds=t([s.rng_seed for s, _ in rows], torch.int64),
            positions=t([len(o) for o in outputs], torch.int64), all_greedy=all(p.greedy for p in ps),
            any_filter=any(not p.greedy and (p.top_k > 0 or p.top_p < 1 or p.min_p > 0) for p in ps),
            max_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=-1))
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in ps):
            b.presence = t([p.presence_penalty for p in ps], torch.float32)
            b.frequency = t([p.frequency_penalty for p in ps], torch.float32)
            b.repetition = t([p.repetition_penalty for p in ps], torch.float32)
            b.output_counts = _counts(outputs, vocab, dev)
            b.prompt_mask = _counts([s.prompt_token_ids for s, _ in rows], vocab, dev) > 0
        b.grammar = self.structured.bitmask(rows, vocab, dev)  # row j of a verified sequence: after j drafts
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
