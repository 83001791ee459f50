"""Images and videos in the engine.

- `MultimodalInputs` turns a prompt with media placeholders plus its images/videos into a
  `MultimodalPrompt` (the checkpoint's processor, placeholder expansion, mRoPE positions, media
  hashes for the prefix-cache key). The server and `LLM.generate` build prompts with it; the
  server turns media bytes into items with `open` and `item`.
- `MediaState` is one request's media: the prompt and the tower outputs of its items, cached
  while some sequence of the request still has that item's pad tokens to prefill, then freed.
  `VisionSteps.states` maps each sequence to its request's MediaState (weakly keyed by the Sequence).
- `VisionSteps` runs the tower inside engine steps. `fit(plan)` (right after scheduling) lets
  each prefill chunk reach only media whose encoding fits this step's budget
  (`vision_max_patches_per_step`, in patches before the merge; an item larger than the budget
  is encoded alone in a step of its own) and cuts the chunk before the first pad of the first
  item that does not fit. The runner then calls `step_inputs`, which encodes every item the
  step needs in one tower call (attention kept per frame by cu_seqlens) and gives the step's
  rotary positions and input embeddings:
    * no multimodal row: None, None (the text path, CUDA graphs as before);
    * multimodal rows past their prompts only (decode, verification): 1-D positions
      index + rope_delta (mRoPE with three equal axes is plain RoPE), so graphs still replay;
    * any multimodal prompt row: [3, T] positions (text-only rows repeat their index on the three
      axes) and, when a chunk holds vision pads, embeddings with the tower rows in place: eager.
  KV slots, block tables and the MTP drafter's slot arithmetic keep using token indices.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Sequence as Seq

import numpy as np
import torch

from qv.config import ConfigError, ModelConfig
from qv.engine.media import OpenedMedia, VideoLimits, frame_picker, open_media, preprocess
from qv.engine.step_feature import StepFeature
from qv.errors import InvalidRequestError
from qv.model.vision_processor import MediaError, VisionItem, VisionProcessor, VisionTokenIds
from qv.model.vision_prompt import MultimodalPrompt


class MultimodalInputs:
    """Prompt building for one checkpoint: `prompt(ids, items)` or `from_data(ids, images, videos)`."""

    def __init__(self, model_dir, cfg: ModelConfig, tokenizer):
        if cfg.vision is None or None in (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id,
                                          cfg.vision_end_token_id):
            raise ConfigError(f"{model_dir}: config.json lacks the vision config or the vision token ids")
        self.processor = VisionProcessor.from_dir(model_dir)
        self.token_ids = VisionTokenIds(cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id,
                                        cfg.vision_end_token_id)
        self.merge_size = cfg.vision.spatial_merge_size
        self._tokenizer = tokenizer

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def prompt(self, prompt_ids: Seq[int], items: Seq[VisionItem]) -> MultimodalPrompt:
        """Items in the order of the prompt's placeholders; a count or kind mismatch is an
        InvalidRequestError naming it."""
        try:
            return MultimodalPrompt.build(list(prompt_ids), list(items), self.token_ids, self._encode, self.merge_size)
        except (MediaError, ValueError) as exc:
            raise InvalidRequestError(str(exc)) from None

    def from_data(self, prompt_ids: Seq[int], images: Seq = (), videos: Seq = ()) -> MultimodalPrompt:
        """vLLM's `multi_modal_data`: images (PIL images or HxWx3 uint8 arrays) and videos (TxHxWx3
        uint8 arrays, or (frames, fps) pairs; no fps means 24) in the order their placeholders
        appear among the prompt's image pads and video pads respectively."""
        try:
            imgs = [self.processor.image(im) for im in images]
            vids = [self.processor.video(*(v if isinstance(v, tuple) else (v, None))) for v in videos]
        except MediaError as exc:
            raise InvalidRequestError(str(exc)) from None
        return self.prompt(prompt_ids, self.in_prompt_order(prompt_ids, imgs, vids))

    def open(self, data: bytes, kind: str, limits: VideoLimits = VideoLimits()) -> OpenedMedia:
        """The header of one image or video (`qv.engine.media.open_media`), a video file's pixels
        counted for the frames this checkpoint's processor samples (MediaError on a refusal)."""
        return open_media(data, kind, frame_picker(self.processor), limits)

    def item(self, opened: OpenedMedia) -> VisionItem:
        """Decode and preprocess one item whose header `open` read (MediaError,
        an InvalidRequestError, on any refusal). CPU work: call it from a worker thread."""
        return preprocess(self.processor, opened)

    def in_prompt_order(self, prompt_ids: Seq[int], images: list, videos: list) -> list:
        """Interleave separate image and video lists by their placeholders' order in the prompt
        (leftovers go last, so the count check in `prompt` names the mismatch)."""
        its = {self.token_ids.image: iter(images), self.token_ids.video: iter(videos)}
        out = [next(its[t], None) for t in prompt_ids if t in its]
        return [x for x in out if x is not None] + list(its[self.token_ids.image]) + list(its[self.token_ids.video])


@dataclass(eq=False)
class MediaState:
    """One request's media; its sequences (n samples) share the encodings."""

    mp: MultimodalPrompt
    # weakly: VisionSteps maps each of them to this state, and a strong link back would keep both alive forever
    seqs: weakref.WeakSet = field(default_factory=weakref.WeakSet)
    encoded: dict[int, torch.Tensor] = field(default_factory=dict)  # item -> tower rows [tokens, hidden]

    def needs_prompt_rows(self, start: int) -> bool:
        return start < len(self.mp)

    def release(self) -> None:
        """Free the encodings whose pads every live sequence of the request has prefilled (a
        preempted sequence restarts from 0 and re-encodes what it needs)."""
        live = [s.num_computed_tokens for s in self.seqs if not s.finished]
        done = min(live) if live else len(self.mp)
        for i in [i for i in self.encoded if self.mp.item_span[i][1] <= done]:
            del self.encoded[i]


@dataclass
class VisionStats:
    items_encoded: int = 0
    patches_encoded: int = 0
    max_patches_in_step: int = 0
    steps_with_encoding: int = 0


class VisionSteps(StepFeature):
    def __init__(self, tower, max_patches_per_step: int, max_tokens: int, device: torch.device):
        self.tower, self.budget, self.device = tower, max_patches_per_step, device
        pin = device.type == "cuda"
        self._host1 = torch.zeros(max_tokens, dtype=torch.int64, pin_memory=pin)
        self._host3 = torch.zeros(3 * max_tokens, dtype=torch.int64, pin_memory=pin)
        self._dev1 = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self._dev3 = torch.zeros(3 * max_tokens, dtype=torch.int64, device=device)
        self.pending: list[tuple[MediaState, int]] = []
        self.stats = VisionStats()
        self.states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> its request's MediaState

    def add(self, seq, media: MediaState) -> None:
        """A new sequence of a request with images or videos (media: check_multimodal's)."""
        self.states[seq] = media
        media.seqs.add(seq)

    # -- scheduling ----------------------------------------------------------------------------
    def fit_plan(self, plan) -> None:
        """StepFeature: the vision budget (fit)."""
        self.fit(plan)

    def after_forward(self, scheduled, scheduler) -> list[str]:
        """StepFeature: free the encodings whose pads are all prefilled."""
        self.after_step(scheduled)
        return []

    def holds_next_step(self, scheduler) -> bool:
        """StepFeature: while any sequence has images or videos, steps stay synchronous."""
        return bool(self.states) and any(q in self.states for q in (*scheduler.running, *scheduler.waiting))

    def replayable(self, seqs, deltas_captured: bool) -> bool:
        """StepFeature: a sequence with media runs mRoPE positions (and vision rows) that no graph captured."""
        return not self.states or not any(s in self.states for s in seqs)

    def fit(self, plan) -> None:
        """Cut prefill chunks so this step's new encodings stay within the budget (in place on
        `plan.scheduled`; a chunk cut to nothing leaves the step, its sequence keeps running)."""
        self.pending, used, kept = [], 0, []
        planned: set[tuple[int, int]] = set()
        for seq, n in plan.scheduled:
            ms = self.states.get(seq)
            start = seq.num_computed_tokens
            if ms is not None and ms.needs_prompt_rows(start):
                end = start + n
                for i in ms.mp.items_in(start, min(end, len(ms.mp))):
                    if i in ms.encoded or (id(ms), i) in planned:
                        continue
                    cost = ms.mp.items[i].pixel_values.shape[0]
                    if used and used + cost > self.budget:  # encode it in a later step
                        end = ms.mp.item_span[i][0]
                        break
                    used += cost
                    planned.add((id(ms), i))
                    self.pending.append((ms, i))
                n = end - start
            if n > 0:
                kept.append((seq, n))
        plan.scheduled[:] = kept

    def after_step(self, scheduled) -> None:
        states = (self.states.get(s) for s, _ in scheduled)
        for ms in {id(ms): ms for ms in states if ms is not None}.values():
            ms.release()

    # -- the step ------------------------------------------------------------------------------
    def encode_pending(self) -> None:
        """One tower call over every item `fit` planned for this step; outputs split per item (views
        of the one output, whose memory goes back when the last of them is released)."""
        if not self.pending:
            return
        items = [ms.mp.items[i] for ms, i in self.pending]
        out = self.tower(torch.cat([it.pixel_values for it in items]), [it.grid_thw for it in items])
        rows = np.cumsum([0] + [it.num_tokens for it in items])
        for k, (ms, i) in enumerate(self.pending):
            ms.encoded[i] = out[rows[k]:rows[k + 1]]
        patches = sum(it.pixel_values.shape[0] for it in items)
        s = self.stats
        s.items_encoded += len(items)
        s.patches_encoded += patches
        s.max_patches_in_step = max(s.max_patches_in_step, patches)
        s.steps_with_encoding += 1
        self.pending = []

    @torch.inference_mode()
    def step_inputs(self, model, seqs: list, starts: np.ndarray, q_lens: np.ndarray, cu: np.ndarray,
                    pos: np.ndarray, ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(rotary positions, input embeddings) of a step, None where the text path applies
        (module docstring). `pos` are the rows' token indices, `ids` the step's ids on the device."""
        self.encode_pending()
        mm = [(i, self.states[s]) for i, s in enumerate(seqs) if s in self.states] if self.states else []
        if not mm:
            return None, None
        ntok = int(cu[len(seqs)])
        prompt = [(i, ms) for i, ms in mm if ms.needs_prompt_rows(int(starts[i]))]
        if not prompt:
            host = self._host1.numpy()[:ntok]
            host[:] = pos
            for i, ms in mm:
                host[cu[i]:cu[i + 1]] += ms.mp.rope_delta
            self._dev1[:ntok].copy_(self._host1[:ntok], non_blocking=True)
            return self._dev1[:ntok], None
        host3 = self._host3.numpy()[:3 * ntok].reshape(3, ntok)
        host3[:] = pos
        for i, ms in mm:
            a = int(starts[i])
            host3[:, cu[i]:cu[i + 1]] = ms.mp.positions_for(a, a + int(q_lens[i])).numpy()
        self._dev3[:3 * ntok].copy_(self._host3[:3 * ntok], non_blocking=True)
        return self._dev3[:3 * ntok].view(3, ntok), self._embeddings(model, prompt, starts, cu, ids)

    def _embeddings(self, model, prompt, starts, cu, ids) -> torch.Tensor | None:
        h = None
        for i, ms in prompt:
            a = int(starts[i])
            b = min(a + int(cu[i + 1] - cu[i]), len(ms.mp))
            if not ms.mp.items_in(a, b):
                continue
            if h is None:
                h = model.embed(ids)
            c0 = int(cu[i])
            h[c0:c0 + b - a] = ms.mp.embed_chunk(model.embed, ids[c0:c0 + b - a], a, ms.encoded)
        return h

    def draft_deltas(self, seqs: list, draft_seqs: np.ndarray, device) -> torch.Tensor | None:
        """Rope delta of each drafting sequence (MTP drafts sit past the prompt: index + delta)."""
        states = [self.states.get(seqs[j]) for j in draft_seqs]
        deltas = [ms.mp.rope_delta if ms is not None else 0 for ms in states]
        return torch.tensor(deltas, dtype=torch.int64).to(device) if any(deltas) else None


def check_multimodal(has_tower: bool, prompt_token_ids: Seq[int], mm_hashes, mp: MultimodalPrompt | None
                     ) -> MediaState | None:
    """A new request's MediaState (None without media), or the InvalidRequestError that refuses it."""
    if mp is None:
        return None
    if not has_tower:
        raise InvalidRequestError("this model serves no images or videos (no vision tower, or media_max_images "
                                  "and media_max_videos are 0)")
    if list(prompt_token_ids) != mp.token_ids:
        raise InvalidRequestError("with media, prompt_token_ids must be the multimodal prompt's (expanded) token ids")
    if mm_hashes is not None and list(mm_hashes) != mp.mm_hashes:
        raise InvalidRequestError("mm_hashes differ from the multimodal prompt's own media hashes")
    return MediaState(mp)
