"""The step loop (LLMEngine): add_request -> step() repeatedly -> RequestOutputs; with async
scheduling (see step) one step stays launched between calls and the next is planned before its
tokens are in. qv/engine/async_engine.py runs it on its own thread for the server."""

from __future__ import annotations

import itertools
import logging
import random
import time
import weakref
from dataclasses import dataclass, field

from qv.config import EngineConfig
from qv.engine.bad_words import depends_on_output
from qv.engine.build import build_engine_parts
from qv.engine.clef_rows import clef_sequence, make_clef_rows
from qv.engine.compile_watch import CompileWatch
from qv.engine.cuda_graphs import eager_reason
from qv.engine.detokenizer import IncrementalDetokenizer
from qv.engine.kv_cache import KVBlockPool
from qv.engine.lora_rows import make_lora_rows
from qv.engine.multimodal import MultimodalInputs, MultimodalPrompt, VisionSteps, check_multimodal
from qv.engine.prefix_cache import PrefixCacheStats, make_prefix_cache
from qv.engine.prompt_logprobs import finished_prompt_logprobs, new_prompt_logprobs
from qv.engine.request import (CompletionOutput, InvalidFieldError, InvalidRequestError, Logprob, RequestMetrics,
                               RequestOutput, SamplingParams)
from qv.engine.request_check import CheckedRequest, RequestLimits, check_request
from qv.engine.runner import ModelRunner, StepHandle, StepResult
from qv.engine.scheduler import Scheduler, StepPlan
from qv.engine.sequence import PENDING, SeqStatus, Sequence
from qv.engine.structured import Grammar, GrammarLimits
from qv.spec.speculator import SpecStats, Speculator
from qv.engine.state_pool import GDNStatePool
from qv.engine.step_cost import StepCostModel, StepTimer
from qv.engine.step_inputs import StepCapacity
from qv.engine.step_speculation import SpeculationSteps
from qv.engine.step_structured import StructuredOutputs

log = logging.getLogger("qv")
# a warm-up record's chunks beside decodes: under the grouped deltas' MANY_ROWS (128) a slot, their few-row blocks
WARM_UP_SMALL_CHUNK = 64


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    host_cache_usage: float = 0.0  # share of the host tier's KV block rows in use (kv_offload_bytes; 0 without)
    num_gpu_blocks: int = 0  # KV blocks on the device
    step_tokens: dict[int, int] = field(default_factory=dict)  # tokens scheduled in a step -> steps
    num_preemptions: int = 0
    num_deferred_readmissions: int = 0  # preempted past max_preemptions, waiting for room for their full length
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0  # tokens looked up at admission (vLLM counts tokens, not requests)
    prefix_cache_hits: int = 0  # tokens resumed from the prefix cache (readmissions after preemption too)
    prompt_tokens_cached: int = 0  # prompt tokens of new requests served from the cache
    prefix_cache_host_hits: int = 0  # hit tokens whose KV came back from the host tier
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    spec_num_drafts: int | None = None  # speculative decoding (None when off), vLLM's counters
    spec_num_draft_tokens: int | None = None
    spec_num_accepted_tokens: int | None = None
    spec_num_accepted_tokens_per_pos: list[int] | None = None
    cuda_graph_sizes: tuple[int, ...] = ()  # decode batch sizes replayed from CUDA graphs (empty: eager)
    async_steps: int = 0  # steps launched before the previous step's tokens reached the host (async scheduling)
    kernel_compiles: int = 0  # Triton kernel variants compiled inside steps after the warm-up (each logged)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    metrics: RequestMetrics


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        parts = build_engine_parts(cfg)
        self.cfg = cfg
        self.model_config = parts.model_config
        self.memory_plan = parts.memory_plan  # qv.engine.memory_plan.MemoryPlan (logged at start, shown by qv bench)
        self.model_dir = parts.model_dir
        self.model_name = parts.model_dir.name
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.eos_token_ids = parts.eos_token_ids
        self.generation_defaults = parts.generation_defaults
        self.limits = RequestLimits(self.model_config.vocab_size, self.max_model_len, cfg.max_logprobs,
                                    cfg.max_stop_strings)
        self.blocks = KVBlockPool(parts.cache.num_blocks, cfg.block_size, parts.prefix_plan.reserve_blocks)
        self.prefix_cache = make_prefix_cache(parts.prefix_plan, self.blocks, parts.cache)
        self.spec = speculation = None
        lookahead = max_spec_seqs = 0  # draft rows a sequence may add to a step; sequences that may verify
        # async scheduling (step): off with speculative decoding, whose next step needs this one's drafts
        self._async = cfg.async_scheduling
        if cfg.spec != "off":
            # the model's own view: under tensor parallelism the per-position states hold the rank's GDN heads
            self.spec = Speculator.for_engine(cfg, parts.mtp_head, parts.model.cfg, parts.cache, parts.model.device)
            lookahead, max_spec_seqs = self.spec.k, self.spec.max_seqs
            speculation = SpeculationSteps(self.spec, self.max_model_len)  # drafts and their outcomes, per sequence
            if self._async:
                log.info("async scheduling is off with speculative decoding: each step needs the last one's drafts")
                self._async = False
        scratch_slot = parts.cache.num_slots - 1  # never handed out (qv/engine/build.py)
        # the step cost max_step_ms plans with, fitted to these steps; small steps stay within the linears' few-row edge
        self.step_timer = StepTimer(StepCostModel(row_limit=parts.model.linear_row_limit()))
        self.scheduler = Scheduler(self.blocks, GDNStatePool(scratch_slot), cfg.max_num_seqs,
                                   cfg.max_num_batched_tokens, lookahead=lookahead,
                                   prefix_cache=self.prefix_cache,
                                   long_prefill_token_threshold=cfg.long_prefill_token_threshold,
                                   max_long_partial_prefills=cfg.max_long_partial_prefills,
                                   max_spec_seqs=max_spec_seqs,
                                   max_step_ms=cfg.max_step_ms,
                                   max_step_decode_ratio=cfg.max_step_decode_ratio, step_cost=self.step_timer.model,
                                   max_preemptions=cfg.max_preemptions, policy=cfg.scheduling_policy)
        # delta rows grouped by bank slot (Clef's slot 0, LoRA adapters' 1..max_loras), in fields a graph captures
        clef_deltas = parts.clef is not None and parts.clef.delta_bytes > 0
        capacity = StepCapacity.of(cfg.max_num_batched_tokens, cfg.max_num_seqs, self.max_model_len, cfg.block_size,
                                   lookahead, delta_slots=cfg.max_loras + 1 if cfg.enable_lora else int(clef_deltas))
        self.multimodal = self.media = None  # images/videos: prompt building and in-step encoding
        self.media_off = parts.media_off  # why they are off, for the 400 a request with media gets
        if parts.vision is not None:
            self.multimodal = MultimodalInputs(parts.model_dir, parts.model_config, parts.tokenizer)
            self.media = VisionSteps(parts.vision, cfg.vision_max_patches_per_step, capacity.rows, parts.model.device)
        self.clef = make_clef_rows(parts.clef, parts.model, cfg.clef_slots, cfg.clef_nmax, self.max_model_len)
        self.lora = make_lora_rows(cfg, parts.model, self.clef)  # served LoRA adapters (None: enable_lora off)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                            GrammarLimits.of(cfg))
        # the parts of the step that plug in (qv/engine/step_feature.py), in the order their hooks run
        self.features = [f for f in (self.prefix_cache, self.lora, self.media, self.clef, speculation,
                                     self.structured) if f is not None]
        self.runner = ModelRunner(parts.model, parts.cache, capacity, self.max_model_len, self.features, self.spec,
                                  self.media, self.structured, tp=parts.tp)
        self.tp = self.runner.tp  # tensor-parallel workers (SingleRank at one rank); stopped by shutdown or at exit
        if self.prefix_cache:  # its state copies run on every rank
            self.tp.mirror_state(self.prefix_cache.copies)
        if self.lora:  # adapters paged into slots: every rank writes its cut
            self.tp.mirror_lora(self.lora)
        self._stop_workers = weakref.finalize(self, self.tp.shutdown)
        why_eager = eager_reason(cfg.cuda_graphs, parts.model.device, cfg.kernels)
        if why_eager is None:
            self.runner.enable_decode_graphs(scratch_slot)  # StartupError where a graph disagrees with eager
            if cfg.piecewise_graph_max_rows:
                self.runner.enable_piecewise_graphs(min(cfg.piecewise_graph_max_rows, cfg.max_num_batched_tokens),
                                                   deltas=not cfg.clef_delta_host)
                self.scheduler.row_buckets = tuple(self.runner.pieces.sizes)  # a step target fills its bucket
        else:
            also = " and every step with prompt rows" if cfg.piecewise_graph_max_rows else ""
            log.info("decode%s runs eagerly: %s", also, why_eager)
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self._rng = random.Random(cfg.seed)
        self.stats = self._fresh_stats()
        self._steps = 0
        self._inflight: StepHandle | None = None  # the step launched but not yet applied (async only)
        self._compiles: CompileWatch | None = None
        if cfg.warm_up and parts.model.device.type == "cuda":
            self.warm_up()
            self._compiles = CompileWatch()

    def _forget_counters(self) -> None:
        """Every counter the statistics read, from zero (after the warm-up's dummy requests)."""
        if self.prefix_cache:
            self.prefix_cache.stats = PrefixCacheStats()
        if self.spec is not None:
            self.spec.stats = SpecStats(accepted_per_pos=[0] * self.spec.k)
        self.scheduler.num_preemptions = self.scheduler.num_deferred_readmissions = 0
        self.stats = self._fresh_stats()
        self._refresh_stats()

    def _fresh_stats(self) -> EngineStats:
        return EngineStats(num_gpu_blocks=self.blocks.num_blocks,
                           cuda_graph_sizes=tuple(self.runner.graphs.sizes) if self.runner.graphs else ())

    def warm_up(self) -> None:
        """Run dummy requests through every kind of step the first requests would take, so that the
        kernels they launch are compiled before serving (Triton compiles at a kernel's first launch
        of each shape class; a request that met one would stall every other): one prompt per row
        range the linears switch kernels at (13, 29, 61, 300, 1,100 tokens, as far as the limits
        allow), alternately greedy and n=2 seeded random sampling, each with logprobs, then one under a
        JSON grammar (the token-mask kernel; with xgrammar installed) and, with a Clef head, one record
        (its delta rows and the joint head) twice: in small chunks, as beside decodes, and in whole ones.
        Leaves no trace: the prefix cache, the statistics and the step cost model are reset, and the seeds
        are the requests' own, so the engine's random stream is untouched."""
        words = self.tokenizer.encode("The quick brown fox jumps over the lazy dog. ", add_special_tokens=False) or [0]
        kv_room = self.blocks.capacity(True) * self.blocks.block_size // 4
        room = min(self.max_model_len - 3, self.cfg.max_num_batched_tokens, kv_room)
        lengths = [n for n in (13, 29, 61, 300, 1100) if n <= room]
        t0 = time.perf_counter()

        def to_the_end() -> None:
            while self.has_unfinished_requests():
                self.step()

        def run(name: str, n: int, params: SamplingParams) -> None:
            self.add_request(f"qv-warm-up-{name}", (words * (n // len(words) + 1))[:n], params)
            to_the_end()

        for i, n in enumerate(lengths):
            random_rows = i % 2 == 1
            run(str(i), n, SamplingParams(n=2 if random_rows else 1, temperature=1.0 if random_rows else 0.0, seed=i,
                                          max_tokens=3, ignore_eos=True, logprobs=min(20, self.cfg.max_logprobs)))
        grammar = self._warm_up_grammar()
        if grammar is not None:  # the token-mask kernel, and the grammar compiler's worker processes
            run("grammar", 13, SamplingParams(temperature=0.0, max_tokens=3, seed=0, grammar=grammar))
        record = self._warm_up_record(kv_room) if self.clef is not None else None
        if record is not None:  # a record's rows: the grouped deltas, the head fed per chunk
            budget = self.scheduler.max_num_batched_tokens
            # first in the small chunks a step target gives records beside decodes, then in the full budget's
            self.scheduler.max_num_batched_tokens = min(budget, WARM_UP_SMALL_CHUNK)
            try:
                self.add_clef("qv-warm-up-clef-small-chunks", record)
                to_the_end()
            finally:
                self.scheduler.max_num_batched_tokens = budget
            self.add_clef("qv-warm-up-clef", record)
            to_the_end()
        self.reset_prefix_cache()
        self.step_timer.model.reset()
        self._forget_counters()
        log.info("warmed up: %d dummy requests of %s prompt tokens%s%s in %.1f s", len(lengths), lengths,
                 " and one under a JSON grammar" if grammar is not None else "",
                 " and one Clef record (twice)" if record is not None else "", time.perf_counter() - t0)

    def _warm_up_record(self, kv_room: int):
        """A two-question Clef record of a few hundred tokens (its state cut where the cap or kv_room, a quarter
        of the KV cache, says), run in chunks of the step budget like any record; None (logged) where even its
        questions do not fit."""
        from qv.clef.request import ClefRequestError, encode_request

        body = {"model": "clef", "state": "The quick brown fox jumps over the lazy dog. " * 25,
                "questions": {"fox": {"type": "choice", "criteria": {"yes": "it jumps", "no": None}},
                              "dog": {"type": "choice", "criteria": {"lazy": None, "busy": None}}}}
        try:
            return encode_request(self.tokenizer, body, min(self.clef.cap, kv_room, 1024),
                                  cap_name=self.clef.cap_name)
        except ClefRequestError as exc:
            log.warning("warm-up: no Clef record (%s)", exc)
            return None

    def _warm_up_grammar(self) -> Grammar | None:
        """A JSON-object grammar for the warm-up's constrained request; None without xgrammar (structured
        outputs are then refused per request) or where the compile fails (logged: each request says why)."""
        try:
            return self.compile_grammar("json_object", "")
        except ImportError:
            return None
        except Exception as exc:  # the engine serves without structured outputs rather than not at all
            log.warning("warm-up: no grammar-constrained request (%s: %s)", type(exc).__name__, exc)
            return None

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at one rank); the engine takes no steps after."""
        self._stop_workers()
        self.structured.close()

    def compile_grammar(self, kind: str, spec: str, param: str = "response_format", cancel=None) -> Grammar:
        """A structured-output constraint compiled for this model's tokenizer, for SamplingParams.grammar
        (cached per (kind, spec); thread-safe, call it off the event loop). kind: json (a JSON schema
        as text), json_object, regex, choice (a JSON list of strings), grammar (EBNF), structural_tag
        (xgrammar's, as JSON). A bad spec raises InvalidFieldError naming `param`; `cancel` (a
        threading.Event) set by the caller stops the compile (GrammarCancelled)."""
        return self.structured.compile(kind, spec, param, cancel)

    # -- requests ------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> CheckedRequest:
        """The request's one check against this engine's limits (qv/engine/request_check.py): the
        CheckedRequest to hand to add_request, or InvalidFieldError naming the field."""
        return check_request(prompt_token_ids, params, self.limits, self.tokenizer)

    def add_request(self, request_id: str, prompt_token_ids: list[int] | CheckedRequest,
                    params: SamplingParams | None = None, prompt: str | None = None, cache_salt: str | None = None,
                    mm_hashes: list[tuple[int, str]] | None = None, multimodal: MultimodalPrompt | None = None,
                    priority: int = 0, lora_name: str | None = None) -> None:
        """Queue a request: a CheckedRequest from check_request (not checked again), or the prompt's
        ids and its params (checked here).
        priority: vLLM's, lower first; other than 0 only under scheduling_policy priority.
        cache_salt: prefixes are shared only under the same salt ("clef:..." never shares);
        mm_hashes: (position, content hash) of each media item, part of the prefix key;
        multimodal: the prompt's images/videos (`self.multimodal.prompt(...)`); prompt_token_ids are its
        expanded ids, and its media hashes join the prefix key;
        lora_name: a served LoRA adapter the request runs on (qv/engine/lora_rows.py; its own prefix salt)."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if priority != 0 and self.scheduler.policy != "priority":
            raise InvalidFieldError(f"Got priority {priority} but Priority scheduling is not enabled.", "priority")
        adapter = None
        if lora_name is not None:
            if self.lora is None:
                raise InvalidRequestError(f"LoRA adapter {lora_name!r} asked for, but enable_lora is off")
            adapter = self.lora.resolve(lora_name)
            cache_salt = self.lora.salt(adapter, cache_salt)
        checked = (prompt_token_ids if isinstance(prompt_token_ids, CheckedRequest)
                   else self.check_request(prompt_token_ids, params))
        prompt_token_ids, params, max_tokens = checked.prompt_token_ids, checked.params, checked.max_tokens
        media = check_multimodal(self.media is not None, prompt_token_ids, mm_hashes, multimodal)
        mm_hashes = multimodal.mm_hashes if multimodal is not None else mm_hashes
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        seqs = []
        for i in range(params.n):
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens, params.stop,
                                           params.include_stop_str_in_output)
            seq = Sequence(next(self._seq_ids), request_id, i, list(prompt_token_ids), params, max_tokens,
                           base_seed + i, detok, arrival_order=next(self._seq_ids),
                           eos_token_ids=self.eos_token_ids, cache_salt=cache_salt, priority=priority,
                           mm_hashes=mm_hashes,
                           prompt_logprobs=new_prompt_logprobs(params, prompt_token_ids, self.tokenizer) if i == 0 else None)
            seqs.append(seq)
            self.structured.add(seq, params.grammar)
            if media is not None:
                self.media.add(seq, media)
            if adapter is not None:
                self.lora.assign(seq, adapter)
            self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, prompt, list(prompt_token_ids), seqs, RequestMetrics())
        self.stats.prompt_tokens += len(prompt_token_ids)
        self._refresh_stats()

    def add_clef(self, request_id: str, record) -> None:
        """Queue a Clef record (qv.clef.encode.EncodedRecord): a prefill-only request whose rows run
        Clef's weights and feed the joint head (qv/engine/clef_rows.py). Its finished RequestOutput
        carries `clef`, a ClefResult; a record whose tokens that ran hash otherwise than the encoded
        ones is refused then."""
        if self.clef is None:
            raise InvalidRequestError("this model serves no Clef decisions: its folder has no Clef head "
                                      "(joint_head.safetensors or clef/) or QV_CLEF is off")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        room = self.blocks.capacity(True) * self.blocks.block_size - self.scheduler.lookahead
        self.clef.check(record, room)
        media = check_multimodal(self.media is not None, record.input_ids, None, record.multimodal)
        detok = IncrementalDetokenizer(self.tokenizer, [])
        seq = clef_sequence(next(self._seq_ids), request_id, record, SamplingParams(temperature=0.0, max_tokens=1),
                            detok, next(self._seq_ids))
        if media is not None:
            self.media.add(seq, media)
        self.clef.add(seq, record)
        self.requests[request_id] = _Request(request_id, None, seq.prompt_token_ids, [seq], RequestMetrics())
        self.stats.prompt_tokens += record.num_tokens
        self._refresh_stats()

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        out = self._output(req)
        self._refresh_stats()
        return out

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_work() or any(f.num_queued for f in self.features)
                or self._inflight is not None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (device and host tiers); running requests continue. False
        when prefix caching is off."""
        return self.prefix_cache.reset() if self.prefix_cache else False

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step; returns the outputs of the requests it changed.

        Synchronously: plan, launch, wait for the tokens, apply them. With async scheduling a step
        stays in flight between calls: each call plans and launches step N+1 as if step N's tokens
        were in (PENDING placeholders, filled on the device), then waits for step N, applies its
        tokens and returns its outputs, so the host's work overlaps the GPU's. `_can_overlap` says
        when N+1 must wait for N instead. A sequence that stops at step N (eos, stop token or
        string) still has a row in N+1, dropped; one whose token in flight is its last (length)
        gives its seat, blocks and slot back before N+1 is planned, as the synchronous engine
        would. Outputs are the synchronous engine's; where the batches differ (a request added
        while a step is in flight, or a seat freed by a stop, is used one step later) logprobs may
        differ by the fp32 rounding of sums over another batch shape, as they do with arrival times."""
        self._steps += 1
        touched: dict[str, _Request] = {}
        cur, self._inflight = self._inflight, None
        if cur is None:
            cur = self._launch(touched)
            if cur is None:
                return self._outputs(touched)
            if not self._async:
                self._finish_sync(cur, touched)
                return self._outputs(touched)
            self._after_forward(cur.plan, touched)
        nxt = self._launch(touched, after=cur) if self._can_overlap(cur) else None
        results = self.runner.collect(cur)
        self.step_timer.collected(cur.plan)
        self._apply_results(results, touched)
        if nxt is not None:  # its KV rows hold step N's tokens: registered now that they are known
            self._after_forward(nxt.plan, touched)
            self._inflight = nxt
        return self._outputs(touched)

    def _launch(self, touched: dict[str, _Request], after: StepHandle | None = None) -> StepHandle | None:
        """Plan a step and launch it. after: the step still in flight; its sequences that sampled are
        planned with one PENDING token more, or retired where that token is their last (length)."""
        if after is not None:
            going_on = set(self._continuing(after))
            for seq in after.sampler_seqs:
                if seq in going_on:
                    seq.output_token_ids.append(PENDING)
                elif seq.status is SeqStatus.RUNNING:  # its token in flight is its last: room for others now
                    self.scheduler.retire(seq)
        for f in self.features:  # Clef records waiting for a slot go in as others finish
            for rid in f.before_plan(self.scheduler):
                touched[rid] = self.requests[rid]
        plan = self.scheduler.schedule()
        for f in self.features:  # LoRA slots, then the vision budget: what cannot run this step leaves it
            f.fit_plan(plan)
        for seq in plan.failed:
            touched[seq.request_id] = self.requests[seq.request_id]
        if not plan:
            return None
        now = time.time()
        for seq, _ in plan.scheduled:
            req = self.requests[seq.request_id]
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        self.step_timer.launched(plan)
        handle = self.runner.execute(plan)
        if self._async:  # nothing verifies drafts: every row is computed once launched
            for seq, n in plan.scheduled:
                seq.num_computed_tokens += n
        self.stats.async_steps += after is not None
        tokens = sum(n for _, n in plan.scheduled)
        self.stats.step_tokens[tokens] = self.stats.step_tokens.get(tokens, 0) + 1
        return handle

    def _finish_sync(self, h: StepHandle, touched: dict[str, _Request]) -> None:
        results = self.runner.collect(h)
        self.step_timer.collected(h.plan)
        for seq, n in h.plan.scheduled:
            res = results.get(seq)
            # a verified sequence keeps only the rows up to its last accepted draft
            seq.num_computed_tokens += n if res is None or res.num_accepted is None else 1 + res.num_accepted
        self._after_forward(h.plan, touched)
        self._apply_results(results, touched)

    def _after_forward(self, plan: StepPlan, touched: dict[str, _Request]) -> None:
        """What follows a step's forward once its rows' tokens are all on the host, before its
        results free finished sequences: the features' after_forward (prefix cache, vision, Clef), in order."""
        for f in self.features:
            for rid in f.after_forward(plan.scheduled, self.scheduler):  # Clef records answered: one token each
                touched[rid] = self.requests[rid]
                self.stats.generation_tokens += touched[rid].seqs[0].finish_reason == "stop"

    def _apply_results(self, results: dict[Sequence, StepResult], touched: dict[str, _Request]) -> None:
        for seq, res in results.items():
            if seq.has_pending:
                seq.output_token_ids.pop()  # the real token replaces it
            if seq.finished:  # aborted while its step ran (or finished one step earlier): the row is dropped
                continue
            self._apply_result(seq, res)
            touched[seq.request_id] = self.requests[seq.request_id]

    def _continuing(self, h: StepHandle) -> list[Sequence]:
        """Sequences that sampled in step h and run on whatever token it was (limits known on the host)."""
        return [s for s in h.sampler_seqs if s.status is SeqStatus.RUNNING
                and len(s.output_token_ids) + 1 < s.max_tokens and s.num_tokens + 1 < self.max_model_len]

    def _can_overlap(self, h: StepHandle) -> bool:
        """Whether the next step may be planned and launched before step h's tokens reach the host.
        Never with speculative decoding (self._async is off: drafts and acceptance come from the
        results); otherwise the exclusions, one a line:"""
        s = self.scheduler
        if any(f.holds_next_step(s) for f in self.features):
            return False  # images/videos stay synchronous
        going_on = set(self._continuing(h))
        if any(self.structured.constrains(q) for q in going_on):
            return False  # structured outputs: the next mask needs this step's tokens in the matcher
        if any(_penalized(q.params) for q in going_on):
            return False  # presence/frequency/repetition penalties count the output tokens on the host
        if any(depends_on_output(q.params.bad_words_token_ids) for q in going_on):
            return False  # a bad word of several tokens is banned by its prefix among the output tokens
        growth = sum(max(0, self.blocks.blocks_for(q.num_tokens + (q in going_on)) - len(q.block_ids))
                     for q in s.running)
        return growth <= self.blocks.num_available()  # else the plan could preempt: the results come first

    def _outputs(self, touched: dict[str, _Request]) -> list[RequestOutput]:
        outputs = [self._output(r) for r in touched.values()]
        self._refresh_stats()
        return outputs

    def _apply_result(self, seq: Sequence, res: StepResult) -> None:
        for j, tok in enumerate(res.token_ids):  # stops and limits apply inside an accepted run too
            self._append(seq, tok, res.logprobs[j] if res.logprobs else None)
            if seq.finished:
                break
        for f in self.features:  # speculation: the drafts' outcome, the next drafts
            f.after_result(seq, res)

    def _append(self, seq: Sequence, token_id: int, logprob=None) -> None:
        seq.output_token_ids.append(token_id)
        self.stats.generation_tokens += 1
        if seq.params.logprobs is not None and logprob is not None:
            lp, rank, top = logprob
            entry = {token_id: Logprob(lp, rank, seq.detok.decode_token(token_id))}
            for r, (tid, tlp) in enumerate(top, start=1):
                entry.setdefault(tid, Logprob(tlp, r, seq.detok.decode_token(tid)))
            seq.output_logprobs.append(entry)
        stop_str = seq.detok.add_token(token_id)
        if any(f.on_token(seq, token_id, self.scheduler) for f in self.features):  # a grammar's end
            return
        t, p, n_out = token_id, seq.params, len(seq.output_token_ids)
        if n_out >= p.min_tokens and not p.ignore_eos and t in self.eos_token_ids:
            self.scheduler.finish(seq, "stop")
        elif n_out >= p.min_tokens and t in p.stop_token_ids:
            self.scheduler.finish(seq, "stop", stop_reason=t)
        elif stop_str is not None and n_out >= p.min_tokens:
            self.scheduler.finish(seq, "stop", stop_reason=stop_str)
        elif n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            self.scheduler.finish(seq, "length")

    def _output(self, req: _Request) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            outs.append(CompletionOutput(
                index=seq.sample_index, text=seq.detok.visible_text(seq.finished),
                token_ids=list(seq.output_token_ids),
                logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        finished = all(s.finished for s in req.seqs)
        now = time.time()
        m = req.metrics
        if any(s.output_token_ids for s in req.seqs):
            m.first_token_time = m.first_token_time or now
            m.last_token_time = now
        error = next((s.error for s in req.seqs if s.error), None)
        if finished:
            m.finished_time = now
            self.requests.pop(req.request_id, None)
            for s in req.seqs:
                self.stats.finished[s.finish_reason] = self.stats.finished.get(s.finish_reason, 0) + 1
        extra = {k: v for f in self.features for k, v in f.finished_output(req.request_id).items()} if finished else {}
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished,
                             num_cached_tokens=min(s.num_cached_tokens for s in req.seqs), metrics=m, error=error,
                             prompt_logprobs=finished_prompt_logprobs(req.seqs[0]), **extra)

    def _refresh_stats(self) -> None:
        s = self.stats
        s.num_running = len(self.scheduler.running)
        s.num_waiting = len(self.scheduler.waiting) + sum(f.num_queued for f in self.features)
        s.kv_cache_usage = self.blocks.usage
        s.num_preemptions = self.scheduler.num_preemptions
        s.num_deferred_readmissions = self.scheduler.num_deferred_readmissions
        if self._compiles is not None:
            self._compiles.check()
            s.kernel_compiles = self._compiles.num_compiles
        for f in self.features:  # speculation's counters
            f.report(s)
        if self.prefix_cache:
            pc, host = self.prefix_cache.stats, self.prefix_cache.host
            s.prefix_cache_queries, s.prefix_cache_hits = pc.queries, pc.hits
            s.prompt_tokens_cached, s.prefix_cache_host_hits = pc.prompt_tokens_cached, pc.host_hits
            if host is not None and host.num_blocks:
                s.host_cache_usage = 1 - len(host.blocks.free) / host.num_blocks


def _penalized(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)
