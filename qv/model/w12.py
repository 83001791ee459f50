"""W12 attention projections (the `w12` lever): where the checkpoint leaves `self_attn.{q,k,v}_proj` dense in
bf16/fp16 (Qwen's GPTQ releases do, on purpose: int8 hurts there), their fused weight is packed at load into
12-bit codes with a scale per row (qv.kernels.linear.pack_w12: 1.5 bytes a weight, 0.75x bf16).

On GPUs the pack is cached in the state directory, one file per layer under w12/<model key>/, named by the
tensor-parallel rank and world; each file records the model key, the weight's shape, the rank and a
fingerprint of the dense weight it was packed from, and a file whose record does not match is rejected
(packed again and rewritten), so a changed checkpoint, shard or shape never loads a stale pack.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qv.kernels.linear import W12Weight, pack_w12

log = logging.getLogger(__name__)
PACK_FORMAT = "qv-w12-v1"
DENSE_16 = (torch.bfloat16, torch.float16)
FINGERPRINT_STRIDE = 4099  # every 4099th weight (a prime: no alignment with rows) and the shape


def model_key(model_dir: str | Path, load_format: str, seed: int) -> str:
    """Names a model for the cache: its folder, its config.json and how its weights are made (random: the seed)."""
    path = Path(model_dir).resolve()
    config = path / "config.json"
    h = hashlib.sha256(str(path).encode())
    h.update(config.read_bytes() if config.is_file() else b"")
    h.update(f"{load_format}:{seed if load_format == 'random' else ''}".encode())
    return f"{path.name}-{h.hexdigest()[:16]}"


def fingerprint(w: torch.Tensor) -> str:
    sample = w.detach().flatten()[::FINGERPRINT_STRIDE].float().cpu().numpy().tobytes()
    return hashlib.sha256(sample + json.dumps(list(w.shape)).encode()).hexdigest()[:32]


class PackCache:
    """Where one model's packs live for one rank (None root: no cache, pack every time)."""

    def __init__(self, root: Path | None, key: str, rank: int = 0, world: int = 1):
        self.dir = None if root is None else Path(root) / "w12" / key
        self.key, self.rank, self.world = key, rank, world
        self.hits = self.rejected = 0

    def _path(self, name: str) -> Path:
        return self.dir / f"{name}.tp{self.world}r{self.rank}.safetensors"

    def _record(self, w: torch.Tensor) -> dict[str, str]:
        return {"format": PACK_FORMAT, "model": self.key, "shape": f"{w.shape[0]}x{w.shape[1]}",
                "rank": str(self.rank), "world": str(self.world), "fingerprint": fingerprint(w)}

    def pack(self, name: str, w: torch.Tensor) -> W12Weight:
        """The W12 pack of dense weight `w` (module `name`): from the cache where its record matches."""
        if self.dir is None:
            return pack_w12(w)
        record, path = self._record(w), self._path(name)
        if path.is_file():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                if f.metadata() == record:
                    self.hits += 1
                    return W12Weight(*(f.get_tensor(t).to(w.device) for t in ("lo", "hi", "scale")))
            self.rejected += 1
            log.warning("W12 cache %s does not match this model, shape or rank: packing again", path)
        packed = pack_w12(w)
        tmp = path.with_suffix(".tmp")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tensors = {"lo": packed.lo.cpu(), "hi": packed.hi.cpu(), "scale": packed.scale.cpu()}
            save_file(tensors, str(tmp), metadata=record)
            tmp.replace(path)  # whole files only: a start killed mid-write leaves no torn pack
        except OSError as e:  # a read-only or full state directory costs the next start a pack, nothing more
            log.warning("W12 cache %s not written (%s): the next start packs again", path, e)
        return packed


def apply_w12(layers, cache: PackCache) -> int:
    """Packs the q/k/v linears (fused or not) of every full-attention layer among `layers` (DecoderLayers, the
    MTP head's included) whose weight is dense bf16/fp16; the number of weights packed. Other formats (GPTQ, FP8)
    and fp32 weights stay as they are."""
    count = 0
    for layer in layers:
        if layer.kind != "full_attention":
            continue
        for i, part in enumerate(layer.mixer.qkv.parts):
            w = part.weight
            if isinstance(w, torch.Tensor) and w.dtype in DENSE_16:
                part.weight = cache.pack(f"layers.{layer.index}.qkv.{i}", w)
                count += 1
    return count
