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

    def _multimodal(self, prompt, ids: list[int]):
        """vLLM's `multi_modal_data` ({"image": [...], "video": [...]}, one item or a list each) for a
        prompt whose ids hold one `<|image_pad|>` / `<|video_pad|>` placeholder per item."""
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if not data:
            return None
        unknown = sorted(set(data) - {"image", "video"})
        if unknown:
            raise InvalidRequestError(f"multi_modal_data takes 'image' and 'video', not {', '.join(unknown)}")
        if self.engine.multimodal is None:
            raise InvalidRequestError(f"this model serves no images or videos: {self.engine.media_off}")
        as_list = lambda x: [] if x is None else list(x) if isinstance(x, list) else [x]  # noqa: E731
        return self.engine.multimodal.from_data(ids, as_list(data.get("image")), as_list(data.get("video")))

    def generate(self, prompts, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_name: str | None = None) -> list[RequestOutput]:
        """Run all prompts to completion (batched together) and return outputs in prompt order;
        lora_name: a served LoRA adapter (enable_lora, lora_modules) they all run on."""
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
            mp = self._multimodal(prompt, ids)
            rid = str(self._next_id)
            self._next_id += 1
            self.engine.add_request(rid, mp.token_ids if mp else ids, p, prompt=text, multimodal=mp,
                                    lora_name=lora_name)
            order.append(rid)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in order]

    def decide(self, bodies: dict | list[dict]) -> dict | list[dict]:
        """Clef decisions offline: systemone request bodies -> systemone responses, run together
        (validated and encoded as POST /v1/systemone does; any model name is accepted). `images`
        entries are PIL images or HxWx3 uint8 arrays here (URLs are not fetched), `assets` carry
        `data_base64`."""
        from qv.clef.answers import response as decision_response

        single = isinstance(bodies, dict)
        bodies = [bodies] if single else list(bodies)
        encoded = [self._encode_clef(b) for b in bodies]
        order = []
        try:
            for _, rec in encoded:
                order.append(f"clef-{self._next_id}")
                self._next_id += 1
                self.engine.add_clef(order[-1], rec)
        except InvalidRequestError:  # one refused: none of this call's records stays queued
            for rid in order:
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            done.update((out.request_id, out) for out in self.engine.step() if out.finished)
        failed = [f"{rid}: {done[rid].error}" for rid in order if done[rid].clef is None]
        if failed:
            raise RuntimeError("Clef records failed: " + "; ".join(failed))
        outs = [decision_response(d.model, rec, done[rid].clef.probabilities) for (d, rec), rid in zip(encoded, order)]
        return outs[0] if single else outs

    def encode_clef(self, body: dict):
        """A systemone body -> the EncodedRecord the engine runs (images preprocessed here)."""
        return self._encode_clef(body)[1]

    def _encode_clef(self, body: dict):
        from qv.clef.request import encode_request, validate

        clef, mm = self.engine.clef, self.engine.multimodal
        if clef is None:
            raise InvalidRequestError("this model serves no Clef decisions (no Clef head in its folder, or clef=False)")
        decision = validate(body)
        images = [self._clef_image(src, where) for src, where in decision.image_sources()] if mm is not None else []
        return decision, encode_request(self.tokenizer, decision, clef.cap, cap_name=clef.cap_name, images=images,
                                        multimodal=mm)

    def _clef_image(self, source, where: str):
        """One offline record image (a PIL image, an array, or an asset's base64) -> its VisionItem."""
        import base64
        import binascii
        import io

        from PIL import Image, UnidentifiedImageError

        from qv.engine.media import IMAGE_FORMATS

        if isinstance(source, str):
            try:
                source = Image.open(io.BytesIO(base64.b64decode(source, validate=True)), formats=IMAGE_FORMATS)
            except (binascii.Error, UnidentifiedImageError):
                raise InvalidRequestError(f"{where}: offline, images are PIL images, HxWx3 uint8 arrays or base64 "
                                          "image data (URLs are fetched by the server only)") from None
        try:
            return self.engine.multimodal.processor.image(source)
        except (ValueError, TypeError) as exc:  # the processor's MediaError, or not an image at all
            raise InvalidRequestError(f"{where}: {exc}") from None
