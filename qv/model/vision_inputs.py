"""How encoded images and videos enter the text model: mRoPE (t, h, w) positions for a prompt
with vision tokens (HF `Qwen3_5Model.get_rope_index`), the offset decode positions continue
from, and the input embeddings with vision rows in place of the pad tokens."""

from __future__ import annotations

import itertools
from typing import Sequence

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2


def mrope_positions(input_ids: Sequence[int] | torch.Tensor, image_grids: Sequence[tuple[int, int, int]],
                    video_grids: Sequence[tuple[int, int, int]], image_token_id: int, video_token_id: int,
                    spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Positions [3, T] (int64) of an expanded prompt and its rope delta.

    Text advances all three axes by one per token. A run of pad tokens is one image, or one
    temporal patch of a video (each patch is its own run between timestamp text): its tokens
    get t = start, h = start + row, w = start + col on the merged grid, and the next token
    starts at start + max(rows, cols). Decode position of token i (i >= T) is i + delta.
    """
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    kinds = [IMAGE if t == image_token_id else VIDEO if t == video_token_id else TEXT for t in ids]
    grids = {IMAGE: iter([tuple(g) for g in image_grids]),
             VIDEO: iter([(1, h, w) for t, h, w in video_grids for _ in range(t)])}  # one grid per patch
    m = spatial_merge_size
    chunks: list[torch.Tensor] = []
    pos = 0
    for kind, run in itertools.groupby(kinds):
        n = len(list(run))
        if kind == TEXT:
            chunks.append(torch.arange(pos, pos + n).expand(3, n))
            pos += n
            continue
        grid = next(grids[kind], None)
        name = "image" if kind == IMAGE else "video frame"
        if grid is None:
            raise ValueError(f"prompt has more {name} runs than grids")
        gh, gw = grid[1] // m, grid[2] // m
        if n != gh * gw:
            raise ValueError(f"a {name} run has {n} pad tokens; its grid {grid} needs {gh * gw}")
        hh, ww = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        chunks.append(torch.stack([torch.full((n,), pos), hh.reshape(-1) + pos, ww.reshape(-1) + pos]))
        pos += max(gh, gw)
    for kind, it in grids.items():
        if next(it, None) is not None:
            raise ValueError(f"more {'image' if kind == IMAGE else 'video frame'} grids than pad runs in the prompt")
    positions = torch.cat(chunks, dim=1) if chunks else torch.zeros(3, 0, dtype=torch.long)
    delta = int(positions.max()) + 1 - len(ids) if ids else 0
    return positions.long(), delta


def decode_positions(start: int, count: int, rope_delta: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[3, count] positions of tokens start .. start+count-1 that follow a prompt (all axes equal)."""
    return (torch.arange(start, start + count, device=device) + rope_delta).expand(3, count)


def embed_with_vision(embed, input_ids: torch.Tensor, vision_embeds: torch.Tensor | None,
                      media_token_ids: Sequence[int]) -> torch.Tensor:
    """Text embeddings [T, H] with the rows of media pad tokens replaced, in order, by
    `vision_embeds` [M, H] (the tower's output for the items in prompt order). `embed` maps ids
    to embeddings (the text model's `embed`)."""
    h = embed(input_ids)
    mask = torch.isin(input_ids, torch.tensor(list(media_token_ids), device=input_ids.device))
    m = int(mask.sum())
    have = 0 if vision_embeds is None else vision_embeds.shape[0]
    if m != have:
        raise ValueError(f"{m} media pad tokens but {have} vision embeddings")
    if m:
        h = h.clone()
        h[mask] = vision_embeds.to(h.dtype)
    return h
