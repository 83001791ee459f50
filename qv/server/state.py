"""What every endpoint needs: the engine, the served names, the levers the server reads, the checks
that come before any request reaches the engine (model name, admission, shutdown), and the worker
threads that tokenize and render off the event loop.

Request rules live in the engine (`SamplingParams.validate`, `engine.check_request`, the
`TextBound` pre-check); the server only turns their InvalidRequestError into a 400 with the
parameter the client wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from starlette.responses import JSONResponse

from qv.config import EngineConfig
from qv.engine.request import InvalidRequestError, SamplingParams, TextBound
from qv.engine.request_check import CheckedRequest
from qv.engine.structured import GRAMMAR_STOPPED
from qv.server.errors import (BUSY_MESSAGE, SHUTDOWN_MESSAGE, STOPPED_MESSAGE, APIError, bad_request,
                              internal_error)
from qv.server.http_edges import body_limit
from qv.server.lora import REQUEST_ADAPTER, adapter_for
from qv.server.media import ServerMedia
from qv.server.metrics import ServerMetrics
from qv.server.responses_store import ResponseStore
from qv.server.streaming import LARGE_BYTES

log = logging.getLogger("qv.server")

LARGE_WORKERS = 2  # threads for bodies of LARGE_BYTES or more (tokenizers release the GIL; templating shares it)
LARGE_QUEUE = 16  # such bodies in work at once (running and waiting for a thread); more get 503
LARGE_RESPONSE_ENTRIES = 4096  # output tokens x (1 + top logprobs) from which a body is built off the loop
GRAMMAR_WAITERS_PER_WORKER = 4  # grammar compiles in work or waiting per compile worker; more get 503


MAX_REQUEST_ID_CHARS = 256  # the body's request_id or an X-Request-Id header


def random_id(prefix: str, sep: str = "-") -> str:
    """chatcmpl-/cmpl- ids as OpenAI writes them; Responses API ids use `_` (resp_, msg_, fc_)."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def request_id_of(request, req, prefix: str) -> str:
    """The response id, vLLM's way: the X-Request-Id header, else the body's `request_id`, else a
    random one, after the API's prefix (chatcmpl-, cmpl-); the engine and the logs know the request by it."""
    given = request.headers.get("x-request-id") or getattr(req, "request_id", None)
    if given and len(given) > MAX_REQUEST_ID_CHARS:
        raise bad_request(f"a request id may have at most {MAX_REQUEST_ID_CHARS} characters, got {len(given)}",
                          "request_id")
    return f"{prefix}-{given}" if given else random_id(prefix)


class Admission:
    """The waiting seats one request holds from admission until its sequences start (first output)."""

    def __init__(self, state: "ServerState", seqs: int):
        self.state, self.left = state, seqs
        state.unstarted += seqs

    def release(self, seqs: int | None = None) -> None:
        k = self.left if seqs is None else min(seqs, self.left)
        self.left -= k
        self.state.unstarted -= k


class ServerState:
    def __init__(self, engine, cfg: EngineConfig):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.defaults = dict(engine.generation_defaults or {})
        names = [n.strip() for n in cfg.served_model_name.split(",") if n.strip()]
        self.served_names = names or [engine.model_name]
        self.model_name = self.served_names[0]
        self.model_root = str(getattr(engine, "model_dir", None) or cfg.model or engine.model_name)
        self.enable_thinking = cfg.enable_thinking
        self.max_body_bytes = cfg.max_body_bytes
        self.clef_body_limit = body_limit("/v1/systemone", cfg)  # (bytes, the lever that sets them)
        self.api_key_scope, self.metrics_public = cfg.api_key_scope, cfg.metrics_public  # for /openapi.json
        self.trust_request_chat_template = cfg.trust_request_chat_template
        self.allow_runtime_lora_updating = cfg.allow_runtime_lora_updating
        self.scheduling_policy = cfg.scheduling_policy
        self.responses = ResponseStore(cfg.responses_store_bytes)  # the Responses API's `store`
        self.max_waiting = cfg.max_waiting
        self.max_prompts = cfg.max_prompts_per_request
        self.max_logprobs = cfg.max_logprobs
        self.shutdown_grace_s = cfg.shutdown_grace_s
        self.stream_stall_timeout_s = cfg.stream_stall_timeout_s
        self.created = int(time.time())
        self.in_flight = 0  # requests of this server between submission and their last output
        self.unstarted = 0  # sequences admitted that have not produced a token yet (Admission)
        self.draining = False  # shutdown began: new requests get 503
        self.stopping = asyncio.Event()  # the grace ran out: requests in flight are cut
        self.loop = asyncio.get_running_loop()  # built in the app's lifespan, on the server's loop
        self.text_bound = TextBound.of(self.tokenizer)
        if self.text_bound is None:
            log.warning("the tokenizer's normalizer has no known bound: long prompts are tokenized before their "
                        "length is checked")
        else:
            b = self.text_bound
            log.info("prompts over %d bytes are refused before tokenizing (longest token %d bytes, normalizer "
                     "shrink %dx, max_model_len %d)", b.max_token_bytes * b.shrink * self.max_model_len,
                     b.max_token_bytes, b.shrink, self.max_model_len)
        self._large = ThreadPoolExecutor(LARGE_WORKERS, thread_name_prefix="qv-tokenize")
        # threads that wait on the engine's grammar compile processes, apart from those that render chats
        self.max_grammar_waiters = GRAMMAR_WAITERS_PER_WORKER * cfg.grammar_compile_workers
        self.grammar_pool = ThreadPoolExecutor(self.max_grammar_waiters, thread_name_prefix="qv-grammar")
        self.grammar_waiters = 0
        self._large_jobs = 0
        self.metrics = ServerMetrics(engine, self.model_name, self.max_model_len, cache_config={
            "block_size": str(cfg.block_size), "cache_dtype": cfg.kv_dtype,
            "enable_prefix_caching": str(cfg.prefix_caching), "gpu_memory_utilization": str(cfg.gpu_memory_utilization)})
        self.media = ServerMedia(cfg, getattr(engine, "multimodal", None),  # image/video parts of chat requests
                                 getattr(engine, "media_off", None))
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        self.special_ids = frozenset(i for i, t in decoder.items() if getattr(t, "special", False))

    # -- off the event loop ---------------------------------------------------------------------
    async def offload(self, size: int, fn, *args):
        """fn(*args) on a worker thread: the default pool for bodies under LARGE_BYTES, a bounded pool
        for larger ones, so that a few huge prompts cannot take every thread from the rest (503 when
        LARGE_QUEUE of them are in work already)."""
        if size < LARGE_BYTES:
            return await asyncio.to_thread(fn, *args)
        if self._large_jobs >= LARGE_QUEUE:
            self.metrics.rejections.inc()
            raise APIError(503, BUSY_MESSAGE, headers={"Retry-After": "1", "retry-after-ms": "1000"})
        self._large_jobs += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._large, fn, *args)
        finally:
            self._large_jobs -= 1

    async def json_response(self, entries: int, build) -> JSONResponse:
        """JSONResponse(build()): built and serialized on a worker thread when the body holds many
        entries (tokens, logprobs), so that n=64 x 1000 tokens x 20 logprobs never stalls the loop."""
        if entries < LARGE_RESPONSE_ENTRIES:
            return JSONResponse(build())
        return await asyncio.to_thread(lambda: JSONResponse(build()))

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize (call it off the loop: the fast tokenizer releases the GIL while it works)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text as written (the Rust batch call, which releases the GIL)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode_batch([ids], skip_special_tokens=False)[0]
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # -- checks before a request is queued -----------------------------------------------------
    def resolve_request_fields(self, req) -> None:
        """vLLM's shorthands made concrete: truncate_prompt_tokens=-1 keeps the last max_model_len tokens."""
        if req.truncate_prompt_tokens == -1:
            req.truncate_prompt_tokens = self.max_model_len
        self.check_priority(req)  # before any work: a grammar compile, rendering

    def check_priority(self, req) -> None:
        """vLLM's check and words: a `priority` other than 0 needs scheduling_policy priority."""
        priority = getattr(req, "priority", 0)
        if priority != 0 and self.scheduling_policy != "priority":
            raise bad_request(f"Got priority {priority} but Priority scheduling is not enabled.", "priority")

    @property
    def response_model(self) -> str:
        """The `model` a response names: the LoRA adapter the request runs on (as vLLM answers), else the base."""
        return REQUEST_ADAPTER.get() or self.model_name

    def check_model(self, name: str | None, adapters: bool = True) -> None:
        """A served name, or (adapters) a served LoRA adapter, which this request then runs on (qv/server/lora.py)."""
        if adapters and adapter_for(self, name) is not None:
            return
        if name is not None and name not in self.served_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def check_logprobs(self, n: int | None, param: str) -> None:
        if n is not None and n > self.max_logprobs:
            raise bad_request(f"Requested {param} of {n}, which is greater than max allowed: {self.max_logprobs}", param)

    def check_text(self, text: str, max_tokens: int | None, prompt_param: str) -> None:
        """The cheap pre-check: a prompt whose length alone says it cannot fit is refused before it is
        tokenized (TextBound; the exact check follows in check_request)."""
        if self.text_bound is not None:
            try:
                self.text_bound.check(text, self.max_model_len, max_tokens)
            except InvalidRequestError as exc:
                raise self.refusal(exc, prompt_param) from None

    def check_request(self, prompt_ids: list[int], params: SamplingParams, prompt_param: str = "prompt",
                      names: dict | None = None) -> CheckedRequest:
        """The engine's request check (length, vocabulary, stop strings): the CheckedRequest to
        generate, or a 400."""
        try:
            return self.engine.check_request(prompt_ids, params)
        except InvalidRequestError as exc:
            raise self.refusal(exc, prompt_param, names) from None

    @staticmethod
    def refusal(exc: InvalidRequestError, prompt_param: str = "prompt", names: dict | None = None) -> APIError:
        """An engine refusal as a 400 whose param is the field the client wrote (`names` maps the
        engine's field names to the request's, e.g. logprobs -> top_logprobs)."""
        param = getattr(exc, "param", None)
        param = prompt_param if param == "prompt" else (names or {}).get(param, param)
        return bad_request(str(exc), param)

    def engine_failure(self) -> str:
        return self.engine.dead_error or "its step loop has stopped"

    def check_running(self) -> None:
        if self.draining:
            raise APIError(503, SHUTDOWN_MESSAGE, headers={"Retry-After": "1", "Connection": "close"})
        if not self.engine.healthy:
            log.error("refusing a request: the engine is not running: %s", self.engine_failure())
            raise APIError(503, "The engine is not running (it stopped; the server log says why).",
                           headers={"Retry-After": "30"})

    def waiting(self) -> int:
        """Sequences waiting: the engine's gauge, or what this server admitted that has not started
        when that is more (the gauge lags by up to a step behind requests just submitted)."""
        # With nothing of ours in flight the engine cannot be holding waiting requests; its gauge
        # can still read >0 when the last request was aborted while idle (no step refreshed it).
        engine_waiting = self.engine.stats().num_waiting if self.in_flight else 0
        return max(engine_waiting, self.unstarted)

    def check_capacity(self, seqs: int = 1) -> None:
        """Whether `seqs` more sequences may wait: 400 for a request that alone needs more than
        max_waiting, 503 + Retry-After while the others leave no room."""
        self.check_running()
        if seqs > self.max_waiting:
            raise bad_request(f"this request needs {seqs} sequences (prompts x n), more than the {self.max_waiting} "
                              "this server lets wait at once (max_waiting)", "n")
        if self.waiting() + seqs > self.max_waiting:
            self.metrics.rejections.inc()
            raise APIError(503, BUSY_MESSAGE, headers={"Retry-After": "1", "retry-after-ms": "1000"})

    def admit(self, seqs: int) -> Admission:
        """check_capacity, then hold the seats; call right before submitting (no await in between),
        and release the Admission when the response is over."""
        self.check_capacity(seqs)
        return Admission(self, seqs)

    def sampling_params(self, req, *, max_tokens: int | None, logprobs: int | None,
                        names: dict | None = None, prompt_logprobs: int | None = None, grammar=None) -> SamplingParams:
        """Request fields over generation_config.json defaults over SamplingParams defaults; grammar:
        the request's compiled constraint (compile_constraint)."""
        def pick(name: str, fallback):
            value = getattr(req, name, None)
            return value if value is not None else self.defaults.get(name, fallback)

        self.check_priority(req)

        try:
            return SamplingParams(
                n=req.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0), presence_penalty=pick("presence_penalty", 0.0),
                frequency_penalty=pick("frequency_penalty", 0.0), repetition_penalty=pick("repetition_penalty", 1.0),
                seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
                max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                logit_bias=getattr(req, "logit_bias", None),  # Responses has none of the three
                allowed_token_ids=getattr(req, "allowed_token_ids", None), bad_words=getattr(req, "bad_words", None),
                grammar=grammar)
        except InvalidRequestError as exc:
            raise self.refusal(exc, names=names) from None

    # -- shutdown --------------------------------------------------------------------------------
    def begin_drain(self) -> float:
        """SIGTERM: refuse new requests now; cut the ones in flight when the grace is nearly over (a
        second, or half the grace when it is shorter, is left for the cut responses and the exit).
        Returns the seconds until the cut."""
        if self.draining:
            return 0.0
        self.draining = True
        cut_in = self.shutdown_grace_s - min(1.0, self.shutdown_grace_s / 2)
        log.info("shutting down: new requests get 503; %d in flight may finish for %.1f s", self.in_flight, cut_in)
        self.loop.call_later(cut_in, self.stopping.set)
        return cut_in

    def close(self) -> None:
        self.responses.cancel_all()
        self._large.shutdown(wait=False, cancel_futures=True)
        self.grammar_pool.shutdown(wait=False, cancel_futures=True)

    # -- running ---------------------------------------------------------------------------------
    def generate(self, request_id: str, request: CheckedRequest, prompt: str | None = None,
                 cache_salt: str | None = None, multimodal=None, admission: Admission | None = None,
                 grammar_field: str = "response_format", priority: int = 0):
        """engine.generate of a checked request (check_request) with metrics; engine failures become
        APIErrors (500, or 400 for a request the engine refused). Closing this iterator closes the engine's (abort).
        multimodal: the prompt's images/videos (a MultimodalPrompt from `self.media.prompt`);
        admission: the seats this prompt's n sequences hold, given back at its first output;
        grammar_field: the field named when the request's grammar is stopped (grammar_mask_budget_ms);
        priority: vLLM's, lower first under scheduling_policy priority (checked by sampling_params)."""
        # the adapter the `model` check chose, read now, in the route's task (the stream is read in another)
        return self._generate(request_id, request, prompt, cache_salt, multimodal, admission, grammar_field,
                              priority, REQUEST_ADAPTER.get())

    async def _generate(self, request_id, request, prompt, cache_salt, multimodal, admission, grammar_field,
                        priority, adapter):
        params = request.params
        tracker = self.metrics.tracker(params.n, params.max_tokens)
        log.info("request %s: %d prompt tokens, n=%d, max_tokens=%s%s", request_id, len(request.prompt_token_ids),
                 params.n, params.max_tokens, f", priority {priority}" if priority else "")
        gen = self.engine.generate(request_id, request, prompt=prompt, cache_salt=cache_salt, multimodal=multimodal,
                                   **({"priority": priority} if priority else {}),
                                   **({"lora_name": adapter} if adapter else {}))
        held = params.n if admission is not None else 0  # this prompt's share of the request's seats
        try:
            with self.engine_call(request_id):
                async with contextlib.aclosing(gen):
                    async for out in gen:
                        if held:
                            admission.release(held)
                            held = 0
                        tracker.on_output(out)
                        if out.error and out.error.startswith(GRAMMAR_STOPPED):  # the client's grammar, not a bug
                            raise bad_request(out.error, grammar_field)
                        if out.error:
                            raise internal_error("the engine failed this request", request_id, detail=out.error)
                        if out.finished:
                            tracker.on_finish(out)
                        yield out
        finally:
            if held:
                admission.release(held)

    @contextlib.contextmanager
    def engine_call(self, request_id: str | None = None):
        """A request in flight on the engine: counted while it runs; the engine refusing it is a 400,
        failing it a 500 (its text logged, not sent)."""
        self.in_flight += 1
        try:
            yield
        except InvalidRequestError as exc:
            raise self.refusal(exc) from None
        except RuntimeError as exc:
            raise internal_error("the engine failed this request", request_id, exc) from None
        finally:
            self.in_flight -= 1

    def stopped_error(self) -> APIError:
        return APIError(503, STOPPED_MESSAGE, headers={"Connection": "close"})
