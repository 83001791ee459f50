"""The on-disk layout of Clef's joint schema head (JointSchemaHead in Cloudflare's
joint_schema_model.py): `joint_head_config.json`'s keys and the name and shape of every tensor in
`joint_head.safetensors`. One statement of the format, read by the loader (qv/clef/head.py) and
written by the embedded default model (qv/model/tiny.py); tests/clef checks it against
JointSchemaHead's own state dict."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

HEAD_WEIGHTS = "joint_head.safetensors"
HEAD_CONFIG = "joint_head_config.json"
# the scalars of the head (a 0-dim tensor each)
SCALARS = ("prior_logit_scale", "joint_logit_scale", "residual_gate")


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int
    width: int
    routing_layers: int
    layers: int
    heads: int
    feedforward: int

    @classmethod
    def from_json(cls, path: str | Path) -> "HeadConfig":
        raw = json.loads(Path(path).read_text())
        names = list(cls.__dataclass_fields__)
        missing = [n for n in names if n not in raw]
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}")
        return cls(**{n: int(raw[n]) for n in names})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


def expected_shapes(c: HeadConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of JointSchemaHead's state dict and its shape."""
    h, w, f = c.hidden_size, c.width, c.feedforward
    s: dict[str, tuple[int, ...]] = {name: () for name in SCALARS}
    s.update({"hidden_norm.weight": (h,), "hidden_norm.bias": (h,), "type_embedding.weight": (3, w)})
    for p in ("memory", "question", "option_question", "global", "option_context", "option_lexical"):
        s[f"{p}_projection.weight"] = (w, h)
    mha = lambda p: {p + "in_proj_weight": (3 * w, w), p + "in_proj_bias": (3 * w,),  # noqa: E731
                     p + "out_proj.weight": (w, w), p + "out_proj.bias": (w,)}
    norm = lambda p: {p + ".weight": (w,), p + ".bias": (w,)}  # noqa: E731
    for i in range(c.routing_layers):
        p = f"evidence_layers.{i}."
        s.update(mha(p + "attention.") | norm(p + "query_norm") | norm(p + "memory_norm") | norm(p + "feedforward_norm"))
        s.update({p + "feedforward.0.weight": (f, w), p + "feedforward.0.bias": (f,), p + "feedforward.3.weight": (w, f),
                  p + "feedforward.3.bias": (w,)})
    for i in range(c.layers):
        p = f"layers.{i}."
        s.update(mha(p + "self_attn.") | mha(p + "multihead_attn.") | norm(p + "norm1") | norm(p + "norm2") | norm(p + "norm3"))
        s.update({p + "linear1.weight": (f, w), p + "linear1.bias": (f,), p + "linear2.weight": (w, f), p + "linear2.bias": (w,)})
    s.update(norm("option_summary_norm") | norm("field_norm") | norm("option_norm"))
    s.update({"residual_scorer.0.weight": (w, 4 * w), "residual_scorer.0.bias": (w,),
              "residual_scorer.3.weight": (1, w), "residual_scorer.3.bias": (1,)})
    return s
