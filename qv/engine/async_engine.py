"""The engine's asyncio front, used by the server: LLMEngine's step loop on its own thread. Each
request is an async iterator of cumulative outputs; leaving it early aborts the request and frees
its cache at once. Callers talk to the thread through typed commands on one queue."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from dataclasses import dataclass

from qv.config import EngineConfig
from qv.engine.clef_rows import ClefResult
from qv.engine.engine import EngineStats, LLMEngine
from qv.engine.multimodal import MultimodalPrompt
from qv.engine.request import InvalidRequestError, SamplingParams
from qv.engine.request_check import CheckedRequest

log = logging.getLogger("qv")


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int] | CheckedRequest
    params: SamplingParams | None
    prompt: str | None
    cache_salt: str | None
    mm_hashes: list[tuple[int, str]] | None
    multimodal: MultimodalPrompt | None
    priority: int = 0
    lora_name: str | None = None


@dataclass(frozen=True)
class _AddClef:
    request_id: str
    record: object


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _ResetPrefixCache:
    done: concurrent.futures.Future


@dataclass(frozen=True)
class _Wake:
    """Nothing to do: lets the loop see _stop."""


_Command = _Add | _AddClef | _Abort | _ResetPrefixCache | _Wake


def _put_latest(q: asyncio.Queue, item) -> None:
    """Queue `item` in place of the outputs its reader has not taken: outputs are cumulative, so a
    reader that is behind (a stream whose client reads nothing) holds one output, not every step's."""
    while not q.empty() and not isinstance(item, BaseException):
        older = q.get_nowait()
        if isinstance(older, BaseException):  # a failure stays, and ends the request first
            item = older
    q.put_nowait(item)


class AsyncLLMEngine:
    """LLMEngine on its own thread; requests are async iterators of cumulative RequestOutputs."""

    def __init__(self, cfg: EngineConfig):
        self.engine = LLMEngine(cfg)
        e = self.engine
        self.tokenizer, self.model_config, self.model_name = e.tokenizer, e.model_config, e.model_name
        self.max_model_len, self.generation_defaults = e.max_model_len, e.generation_defaults
        self.clef_cap = (e.clef.cap, e.clef.cap_name) if e.clef else None  # Clef served: record cap, what sets it
        self.lora = e.lora  # served LoRA adapters (qv/engine/lora_rows.py), None when enable_lora is off
        self.multimodal = e.multimodal  # MultimodalInputs, or None without a vision tower
        self.media_off = e.media_off  # why images and videos are off (None: on)
        self.compile_grammar = e.compile_grammar  # structured outputs: thread-safe, cached (call it off the loop)
        self.dead_error: str | None = None
        self._commands: queue.Queue = queue.Queue()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._futures: set[concurrent.futures.Future] = set()  # answers owed by the engine thread
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="qv-engine", daemon=True)
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self.engine.stats

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> CheckedRequest:
        """LLMEngine.check_request (pure: safe off the engine thread)."""
        return self.engine.check_request(prompt_token_ids, params)

    async def generate(self, request_id: str, prompt_token_ids: list[int] | CheckedRequest,
                       params: SamplingParams | None = None, prompt: str | None = None, cache_salt: str | None = None,
                       mm_hashes: list[tuple[int, str]] | None = None, multimodal: MultimodalPrompt | None = None,
                       priority: int = 0, lora_name: str | None = None):
        """A CheckedRequest, or the prompt's ids and params (checked on the engine thread);
        multimodal: the prompt's images/videos; priority: vLLM's; lora_name: a served LoRA adapter
        (LLMEngine.add_request)."""
        command = _Add(request_id, prompt_token_ids, params, prompt, cache_salt, mm_hashes, multimodal, priority,
                       lora_name)
        async with contextlib.aclosing(self._outputs(request_id, command)) as outputs:
            async for out in outputs:
                yield out

    async def decide(self, request_id: str, record) -> ClefResult:
        """Run one Clef record (LLMEngine.add_clef) on the engine thread; returns its ClefResult
        (answers in systemone's format). InvalidRequestError: the engine refused the record;
        RuntimeError: it failed. Cancelling the await aborts the record and frees its cache."""
        out = None
        async with contextlib.aclosing(self._outputs(request_id, _AddClef(request_id, record))) as outputs:
            async for out in outputs:
                pass
        if out.clef is None:
            raise RuntimeError(f"the engine failed this Clef record: {out.error or out.outputs[0].finish_reason}")
        return out.clef

    async def _outputs(self, request_id: str, command: _Add | _AddClef):
        """Send `command` (which adds request_id) to the engine thread and yield the request's
        outputs up to the finished one; leaving early aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:  # the dying loop sets dead_error under this lock, then fails what is registered
            if not self.healthy:
                raise RuntimeError(f"the engine is not running: {self.dead_error}")
            if request_id in self._queues:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._queues[request_id] = (loop, q)
        self._commands.put(command)
        finished = False
        try:
            while not finished:
                item = await q.get()
                while not q.empty() and not isinstance(item, BaseException):
                    item = q.get_nowait()  # outputs are cumulative: a slow reader skips to the latest
                if isinstance(item, BaseException):
                    finished = True  # the engine refused or failed it: nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._queues.pop(request_id, None)
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def reset_prefix_cache(self) -> bool:
        """LLMEngine.reset_prefix_cache, run on the engine thread between steps."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.healthy:
                raise RuntimeError(f"the engine is not running: {self.dead_error}")
            self._futures.add(done)
        self._commands.put(_ResetPrefixCache(done))
        try:
            return await asyncio.wrap_future(done)
        finally:
            with self._lock:
                self._futures.discard(done)

    def shutdown(self) -> None:
        self._stop = True
        self._commands.put(_Wake())
        self._thread.join(timeout=10)
        if not self._thread.is_alive():  # the tensor-parallel workers, once no step can start
            self.engine.shutdown()

    # -- engine thread -------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            target = self._queues.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(_put_latest, q, item)

    def _apply(self, cmd: _Command) -> None:
        match cmd:
            case _Add():
                try:
                    self.engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.prompt,
                                            cmd.cache_salt, cmd.mm_hashes, cmd.multimodal, cmd.priority,
                                            cmd.lora_name)
                except InvalidRequestError as exc:
                    self._deliver(cmd.request_id, exc)
            case _AddClef():
                try:
                    self.engine.add_clef(cmd.request_id, cmd.record)
                except InvalidRequestError as exc:
                    self._deliver(cmd.request_id, exc)
            case _Abort():
                self.engine.abort_request(cmd.request_id)
            case _ResetPrefixCache():
                try:
                    cmd.done.set_result(self.engine.reset_prefix_cache())
                except Exception as exc:  # noqa: BLE001 - the caller gets the error; the engine keeps serving
                    cmd.done.set_exception(exc)
            case _Wake():
                pass

    def _loop(self) -> None:
        try:
            while not self._stop:
                block = not self.engine.has_unfinished_requests()
                try:
                    cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
                    self._apply(cmd)
                    while True:
                        self._apply(self._commands.get_nowait())
                except queue.Empty:
                    pass
                if self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        self._deliver(out.request_id, out)
        except BaseException as exc:  # the engine is dead: fail every waiting request, keep the reason
            log.exception("engine loop failed")
            with self._lock:  # under the lock: a caller either sees dead_error or is in the lists below
                self.dead_error = f"{type(exc).__name__}: {exc}"
                pending, futures = list(self._queues), list(self._futures)
            for rid in pending:
                self._deliver(rid, RuntimeError(f"the engine failed: {self.dead_error}"))
            for fut in futures:
                if not fut.done():
                    fut.set_exception(RuntimeError(f"the engine failed: {self.dead_error}"))
