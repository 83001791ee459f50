"""Offline API with vLLM's conventions: `LLM(model=PATH, **levers).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from qv.config import EngineConfig
from qv.engine.engine import LLMEngine
from qv.engine.request import InvalidRequestError, RequestOutput, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, device: str | None = None, dtype: str | None = None, **levers):
        self.config = EngineConfig.from_env(model=model, device=device, dtype=dtype, **levers)
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"], add_special_tokens=False)
        raise InvalidRequestError(f"a prompt is a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run all prompts to completion (batched together) and return outputs in prompt order."""
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, Seq) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        order = []
        for prompt, p in zip(prompts, params):
            text, ids = self._prompt_ids(prompt)
            rid = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(rid, ids, p, prompt=text)
            order.append(rid)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in order]
