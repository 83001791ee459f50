"""Self-distillation of a tiny checkpoint's `mtp.*` head on the target's own greedy continuations
(CPU, a few hundred steps), so its drafts are often right and acceptance tests mean something.

At position p the head sees (embedding of t_{p+1}, target hidden h_p) and learns the target's
distribution for t_{p+2}. The forward here is the head's math written with the fp32 reference ops,
which are differentiable; serving runs qv.spec.mtp.MTPHead on the same tensors.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from qv.kernels.rms_norm.reference import rms_norm
from qv.kernels.rope.reference import rope
from qv.kernels.silu_mul.reference import silu_mul
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache
from qv.model.qwen3_5 import load_text_model
from qv.model_config import ModelConfig


def _save_updates(model_dir: Path, updates: dict[str, torch.Tensor]) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    missing = sorted(set(updates) - set(tensors))
    if missing:
        raise KeyError(f"fit produced tensors absent from the checkpoint: {missing[:5]}")
    tensors.update({k: v.detach().to(tensors[k].dtype).contiguous() for k, v in updates.items()})
    save_file(tensors, str(path), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------------
# the MTP head: self-distillation on the target's own greedy continuations
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def _target_pass(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(final-norm hidden [L, H], logits [L, V]) of the target over one sequence."""
    cfg = model.cfg
    bs = 16
    blocks = -(-len(ids) // bs)
    cache = allocate_cache(cfg, blocks, bs, 1, torch.float32, torch.float32, torch.float32, "cpu")
    batch = build_step_batch([len(ids)], [len(ids)], [list(range(blocks))], [0], bs,
                             logits_rows=list(range(len(ids))))
    hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), batch, cache)
    return hidden, model.compute_logits(hidden)


def _mtp_forward(p: dict[str, torch.Tensor], cfg: ModelConfig, embed: torch.Tensor, lm_head: torch.Tensor,
                 next_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Differentiable head over [B, L] positions 0..L-1 -> logits [B, L, V]."""
    eps, d, hq, hkv = cfg.rms_norm_eps, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    bsz, length, _ = hidden.shape
    e = rms_norm(embed[next_ids], p["mtp.pre_fc_norm_embedding.weight"], eps)
    h = rms_norm(hidden, p["mtp.pre_fc_norm_hidden.weight"], eps)
    x = torch.cat([e, h], -1) @ p["mtp.fc.weight"].t()
    lp = "mtp.layers.0."
    y = rms_norm(x, p[lp + "input_layernorm.weight"], eps)
    qg = (y @ p[lp + "self_attn.q_proj.weight"].t()).view(bsz, length, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(bsz, length, hq * d)
    k = (y @ p[lp + "self_attn.k_proj.weight"].t()).view(bsz, length, hkv, d)
    v = (y @ p[lp + "self_attn.v_proj.weight"].t()).view(bsz, length, hkv, d)
    q = rms_norm(q, p[lp + "self_attn.q_norm.weight"], eps)
    k = rms_norm(k, p[lp + "self_attn.k_norm.weight"], eps)
    pos = torch.arange(length)
    q, k = zip(*[rope(q[b], k[b], pos, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)
                 for b in range(bsz)])
    q, k = torch.stack(q).transpose(1, 2), torch.stack(k).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), is_causal=True, enable_gqa=True)
    o = o.transpose(1, 2).reshape(bsz, length, hq * d) * torch.sigmoid(gate)
    x = x + o @ p[lp + "self_attn.o_proj.weight"].t()
    y = rms_norm(x, p[lp + "post_attention_layernorm.weight"], eps)
    gu = torch.cat([y @ p[lp + "mlp.gate_proj.weight"].t(), y @ p[lp + "mlp.up_proj.weight"].t()], -1)
    x = x + silu_mul(gu) @ p[lp + "mlp.down_proj.weight"].t()
    return rms_norm(x, p["mtp.norm.weight"], eps) @ lm_head.t()


def fit_mtp_head(model_dir: str | Path, steps: int = 300, seed: int = 0, num_seqs: int = 32, gen_len: int = 48,
                 lr: float = 1e-2, log=print) -> float:
    """Self-distil the head on the target's distributions over random token sequences (which cover the
    whole vocabulary) and over its own greedy continuations. Returns the final KL loss."""
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    model = load_text_model(str(model_dir), cfg)
    rng = random.Random(seed)
    seqs = _greedy_corpus(model, cfg, rng, num_seqs, gen_len)
    data = [_target_pass(model, s) for s in seqs]
    length = min(len(s) for s in seqs) - 1
    ids = torch.tensor([s[1:length + 1] for s in seqs])  # t_{p+1}
    hidden = torch.stack([h[:length] for h, _ in data])  # h_p
    teacher = torch.stack([torch.log_softmax(lg[1:length + 1], -1) for _, lg in data])  # target at p+1
    tensors = load_file(str(model_dir / "model.safetensors"))
    params = {k: v.float().clone().requires_grad_(True) for k, v in tensors.items() if k.startswith("mtp.")}
    embed, lm_head = model.embed_tokens, model.lm_head.weight
    opt = torch.optim.Adam(params.values(), lr=lr)
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        logits = _mtp_forward(params, cfg, embed, lm_head, ids, hidden)[..., :cfg.vocab_size]
        loss = F.kl_div(torch.log_softmax(logits, -1), teacher[..., :cfg.vocab_size], log_target=True,
                        reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"mtp fit step {step}: KL {loss.item():.4f}")
    _save_updates(model_dir, params)
    return loss.item()


@torch.no_grad()
def _greedy(model, prompt: list[int], n: int) -> list[int]:
    """Prompt + n greedy tokens, decoding one token per forward through the cache."""
    cfg, bs = model.cfg, 16
    blocks = -(-(len(prompt) + n) // bs)
    cache = allocate_cache(cfg, blocks, bs, 1, torch.float32, torch.float32, torch.float32, "cpu")
    table = [list(range(blocks))]
    ids, start = list(prompt), 0
    for _ in range(n):
        batch = build_step_batch([len(ids) - start], [len(ids)], table, [0], bs)
        h = model.forward(torch.tensor(ids[start:]), torch.arange(start, len(ids)), batch, cache)
        start = len(ids)
        ids.append(int(model.compute_logits(h[batch.logits_indices])[0, :cfg.vocab_size].argmax()))
    return ids


def _greedy_corpus(model, cfg: ModelConfig, rng: random.Random, num_seqs: int, gen_len: int) -> list[list[int]]:
    """Random token sequences (3/4) and random prompts with the target's greedy continuations (1/4),
    all of one length."""
    length = 16 + gen_len
    seqs = []
    for i in range(num_seqs):
        if i % 4 == 0:
            seqs.append(_greedy(model, [rng.randrange(cfg.vocab_size) for _ in range(16)], gen_len))
        else:
            seqs.append([rng.randrange(cfg.vocab_size) for _ in range(length)])
    return seqs
