"""One request's prompt with images/videos, in the form a chunked-prefill engine needs: the
expanded token ids, mRoPE positions for any chunk (and for decode tokens after it), which media
items a chunk touches, the chunk's input embeddings from those items' encodings, and the media
content hashes for the prefix-cache key (the pad tokens of two same-sized images are identical;
their hashes are not)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from qv.model.vision_inputs import decode_positions, mrope_positions
from qv.model.vision_processor import VisionItem, VisionTokenIds, expand_vision_tokens


def media_hash(item: VisionItem) -> str:
    """Content hash of a preprocessed item: equal pixels, grid and timestamps, equal hash."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{item.kind}:{item.grid_thw}:{item.timestamps}".encode())
    h.update(item.pixel_values.contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class MultimodalPrompt:
    token_ids: list[int]
    items: tuple[VisionItem, ...]  # in prompt order
    positions: torch.Tensor  # [3, T] int64
    rope_delta: int
    pad_index: np.ndarray  # [M] prompt index of each vision row (rows of all items, in order)
    item_rows: tuple[tuple[int, int], ...]  # rows [r0, r1) of each item
    item_span: tuple[tuple[int, int], ...]  # prompt indices [first pad, last pad + 1) of each item
    hashes: tuple[str, ...]

    @classmethod
    def build(cls, prompt_ids: Sequence[int], items: Sequence[VisionItem], ids: VisionTokenIds,
              encode: Callable[[str], list[int]], spatial_merge_size: int) -> "MultimodalPrompt":
        tokens = expand_vision_tokens(prompt_ids, items, ids, encode)
        pos, delta = mrope_positions(tokens, [it.grid_thw for it in items if it.kind == "image"],
                                     [it.grid_thw for it in items if it.kind == "video"], ids.image, ids.video,
                                     spatial_merge_size)
        arr = np.asarray(tokens)
        pad_index = np.flatnonzero((arr == ids.image) | (arr == ids.video))
        bounds = np.cumsum([0] + [it.num_tokens for it in items])
        rows = tuple((int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]))
        spans = tuple((int(pad_index[a]), int(pad_index[b - 1]) + 1) for a, b in rows)
        return cls(tokens, tuple(items), pos, delta, pad_index, rows, spans, tuple(media_hash(it) for it in items))

    def __len__(self) -> int:
        return len(self.token_ids)

    def positions_for(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of tokens start .. end-1 (prompt tokens from the table, later
        ones, i.e. generated tokens, continue at index + rope_delta)."""
        t = len(self.token_ids)
        head = self.positions[:, start:min(end, t)]
        if end <= t:
            return head
        return torch.cat([head, decode_positions(max(start, t), end - max(start, t), self.rope_delta)], dim=1)

    def items_in(self, start: int, end: int) -> list[int]:
        """Indices of the items with vision rows among prompt tokens start .. end-1."""
        return [i for i, (a, b) in enumerate(self.item_span) if a < end and b > start]

    def embed_chunk(self, embed, input_ids: torch.Tensor, start: int, encoded: dict[int, torch.Tensor]) -> torch.Tensor:
        """Input embeddings [L, H] for prompt tokens start .. start+L-1: text embeddings with the
        vision rows in place. `encoded[i]` is item i's tower output, needed for every i in
        `items_in(start, start + L)`."""
        h = embed(input_ids)
        lo, hi = np.searchsorted(self.pad_index, [start, start + input_ids.shape[0]])
        if lo == hi:
            return h
        h = h.clone()
        for i in self.items_in(start, start + input_ids.shape[0]):
            if i not in encoded:
                raise KeyError(f"media item {i} is needed by this chunk but was not encoded")
            r0, r1 = self.item_rows[i]
            a, b = max(r0, lo), min(r1, hi)  # this item's rows that fall in the chunk
            local = torch.as_tensor(self.pad_index[a:b] - start, device=h.device)
            h[local] = encoded[i][a - r0:b - r0].to(h.dtype)
        return h

    @property
    def mm_hashes(self) -> list[tuple[int, str]]:
        """(first pad position, content hash) per item: the engine's prefix-cache key for media
        (Sequence.mm_hashes). One entry per item is enough because block digests chain: every
        block from the item's first pad on depends on it."""
        return [(span[0], h) for span, h in zip(self.item_span, self.hashes)]
