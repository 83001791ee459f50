"""What every endpoint needs: the engine, the served names, the levers the server reads, and the
checks that come before any request reaches the engine (model name, context length, capacity)."""

from __future__ import annotations

import contextlib
import time
import uuid

from qv.config import EngineConfig
from qv.engine.request import InvalidRequestError, SamplingParams
from qv.server.errors import BUSY_MESSAGE, APIError, bad_request
from qv.server.media import ServerMedia
from qv.server.metrics import ServerMetrics


def random_id(prefix: str, sep: str = "-") -> str:
    """chatcmpl-/cmpl- ids as OpenAI writes them; Responses API ids use `_` (resp_, msg_, fc_)."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"


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
        self.max_waiting = cfg.max_waiting
        self.max_logprobs = cfg.max_logprobs
        self.created = int(time.time())
        self.in_flight = 0  # requests of this server between submission and their last output
        self.metrics = ServerMetrics(engine, self.model_name, self.max_model_len)
        self.media = ServerMedia(cfg, getattr(engine, "multimodal", None))  # image/video parts of chat requests
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        self.special_ids = frozenset(i for i, t in decoder.items() if getattr(t, "special", False))

    # -- checks before a request is queued -----------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_names:
            raise APIError(404, f"The model `{name}` does not exist.", "model")

    def check_logprobs(self, n: int | None, param: str) -> None:
        if n is not None and n > self.max_logprobs:
            raise bad_request(f"Requested {param} of {n}, which is greater than max allowed: {self.max_logprobs}", param)

    def check_length(self, n_prompt: int, max_tokens: int | None, prompt_param: str) -> None:
        """vLLM's context-length errors, with the token counts."""
        limit = self.max_model_len
        if n_prompt >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your prompt contains {n_prompt} "
                "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                "of the input prompt.", prompt_param)
        if max_tokens is not None and n_prompt + max_tokens > limit:
            total = n_prompt + max_tokens
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested {max_tokens} output "
                f"tokens and your prompt contains {n_prompt} input tokens, for a total of {total} tokens "
                f"({n_prompt} + {max_tokens} = {total} > {limit}). Please reduce the length of the input prompt or "
                "the number of requested output tokens.", "max_tokens")

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.check_request(prompt_ids, params)
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from None

    def engine_failure(self) -> str:
        return self.engine.dead_error or "its step loop has stopped"

    def check_running(self) -> None:
        if not self.engine.healthy:
            raise APIError(503, f"The engine is not running: {self.engine_failure()}", headers={"Retry-After": "30"})

    def check_capacity(self) -> None:
        self.check_running()
        # With nothing of ours in flight the engine cannot be holding waiting requests; its gauge
        # can still read >0 when the last request was aborted while idle (no step refreshed it),
        # and trusting it then would refuse every request from that moment on.
        waiting = self.engine.stats().num_waiting if self.in_flight else 0
        if waiting >= self.max_waiting:
            self.metrics.rejections.inc()
            raise APIError(503, BUSY_MESSAGE, headers={"Retry-After": "1", "retry-after-ms": "1000"})

    def sampling_params(self, req, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Request fields over generation_config.json defaults over SamplingParams defaults."""
        def pick(name: str, fallback):
            value = getattr(req, name, None)
            return value if value is not None else self.defaults.get(name, fallback)

        try:
            return SamplingParams(
                n=req.n, temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
                min_p=pick("min_p", 0.0), presence_penalty=pick("presence_penalty", 0.0),
                frequency_penalty=pick("frequency_penalty", 0.0), repetition_penalty=pick("repetition_penalty", 1.0),
                seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
                max_tokens=max_tokens, min_tokens=req.min_tokens, logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens)
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from None

    # -- running ---------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       prompt: str | None = None, cache_salt: str | None = None, multimodal=None):
        """engine.generate with metrics; engine failures become APIErrors (500, or 400 for a
        request the engine refused). Closing this iterator closes the engine's (abort).
        multimodal: the prompt's images/videos (a MultimodalPrompt from `self.media.prompt`)."""
        tracker = self.metrics.tracker(params.n, params.max_tokens)
        gen = self.engine.generate(request_id, prompt_ids, params, prompt=prompt, cache_salt=cache_salt,
                                   multimodal=multimodal)
        with self.engine_call():
            async with contextlib.aclosing(gen):
                async for out in gen:
                    tracker.on_output(out)
                    if out.error:
                        raise APIError(500, f"the engine failed this request: {out.error}")
                    if out.finished:
                        tracker.on_finish(out)
                    yield out

    @contextlib.contextmanager
    def engine_call(self):
        """A request in flight on the engine: counted while it runs; the engine refusing it is a 400,
        failing it a 500."""
        self.in_flight += 1
        try:
            yield
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from None
        except RuntimeError as exc:
            raise APIError(500, str(exc)) from None
        finally:
            self.in_flight -= 1
