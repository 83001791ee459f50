"""Qwen3.5 building blocks: Linear (dense, GPTQ at 8 or 4 bits or block FP8, with optional low-rank row deltas),
gated full attention, Gated DeltaNet and the SwiGLU MLP. Math goes through qv.kernels only."""

from __future__ import annotations

import torch

from qv import kernels as K
from qv.kernels.grouped_delta import DeltaGroups
from qv.kernels.linear import FP8Weight, GPTQWeight
from qv.model.batch import StepBatch
from qv.model.cache import GDNState, KVCache
from qv.model.delta_bank import DeltaBank
from qv.model_config import ModelConfig


class Linear:
    """y = x W^T (+ b). `weight` is a dense [N, K] tensor, a GPTQWeight or an FP8Weight; several checkpoint
    modules may be fused along N (q/k/v, gate/up, ...): `member_sizes` are their output widths, which
    the low-rank deltas of `bank` (Clef's, served LoRA adapters': qv/model/delta_bank.py) address.
    Under tensor parallelism `shard` says how the weight is cut ("column", "row", "vocab"), and a
    row-parallel Linear sums its partial outputs over `reduce`, its deltas' partial outputs with them
    (qv/model/parallel.py, delta_shard: each rank's deltas are cut like its weight)."""

    def __init__(self, weight: torch.Tensor | GPTQWeight | FP8Weight, bias: torch.Tensor | None = None,
                 reduce=None):  # a qv.model.parallel.TPGroup (that module builds on this one)
        self.weight = weight
        self.bias = bias
        self.bank: DeltaBank | None = None
        self.member_sizes: list[int] = [self.out_features]
        self.reduce = reduce
        self.shard: str | None = None
        self.pieces: list[int] | None = None  # column-parallel: the full output pieces this shard holds a block of

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor, delta_rows: torch.Tensor | DeltaGroups | None = None) -> torch.Tensor:
        """delta_rows: the rows that add low-rank deltas, grouped by bank slot (a plain row tensor: slot 0)."""
        y = K.linear(x, self.weight, self.bias)
        if self.bank is not None and delta_rows is not None:
            y = self.bank.apply(y, x, delta_rows)
        return y if self.reduce is None else self.reduce.all_reduce_sum(y)


def _fusable(a: Linear, b: Linear) -> bool:
    """Whether two linears over the same input concatenate along N into one weight: one format (dense
    of one dtype, GPTQ with the same groups and zero kind, or FP8 with the same blocks, the first's rows ending
    on a scale block), no bias, no deltas."""
    if (a.bias is not None or b.bias is not None or a.bank is not None or b.bank is not None
            or a.reduce is not None or b.reduce is not None):
        return False
    wa, wb = a.weight, b.weight
    if isinstance(wa, torch.Tensor) and isinstance(wb, torch.Tensor):
        return wa.dtype == wb.dtype
    if isinstance(wa, GPTQWeight) and isinstance(wb, GPTQWeight):
        return (wa.bits == wb.bits and wa.scales.shape[0] == wb.scales.shape[0] and (wa.zeros is None) == (wb.zeros is None)
                and torch.equal(wa.g_idx, wb.g_idx))
    if isinstance(wa, FP8Weight) and isinstance(wb, FP8Weight):
        return wa.block == wb.block and wa.out_features % wa.block[0] == 0
    return False


def _concat(run: list[Linear]) -> Linear:
    ws = [p.weight for p in run]
    if len(run) == 1:
        return run[0]
    if isinstance(ws[0], torch.Tensor):
        out = Linear(torch.cat(ws, dim=0))
    elif isinstance(ws[0], FP8Weight):
        out = Linear(FP8Weight(torch.cat([w.weight for w in ws]), torch.cat([w.scale_inv for w in ws]), ws[0].block))
    else:
        zeros = None if ws[0].zeros is None else torch.cat([w.zeros for w in ws], dim=1)
        out = Linear(GPTQWeight(torch.cat([w.qweight for w in ws], dim=1), torch.cat([w.scales for w in ws], dim=1),
                                zeros, ws[0].g_idx, ws[0].group_size, ws[0].bits))
    out.shard = run[0].shard  # members are column shards alike (row-parallel ones all-reduce and never fuse)
    return out


def fuse_linears(parts: list[Linear]) -> list[list[int]]:
    """Runs of consecutive members that fuse (member indices per run). Fusing saves launches and re-reads
    of the activations; a member of another format (a dense in_proj_b beside GPTQ in_proj_qkv) starts a run."""
    runs = [[0]]
    for i in range(1, len(parts)):
        if _fusable(parts[runs[-1][-1]], parts[i]):
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


class FusedLinear:
    """Linears over one input computing the concatenation of `sizes` output columns, one per member;
    consecutive members of one format run as one fused Linear (`parts`)."""

    def __init__(self, members: list[Linear], sizes: list[int]):
        self.sizes = sizes
        self.member_pieces = [m.pieces for m in members]  # how each member was cut (Clef deltas are cut alike)
        self.runs = fuse_linears(members)
        self.parts = [_concat([members[i] for i in run]) for run in self.runs]
        for part, run in zip(self.parts, self.runs):
            part.member_sizes = [sizes[j] for j in run]

    def member(self, index: int) -> tuple[Linear, int, int]:
        """The Linear computing member `index`, and the output columns [start, end) that are its."""
        for part, run in zip(self.parts, self.runs):
            if index in run:
                start = sum(self.sizes[j] for j in run if j < index)
                return part, start, start + self.sizes[index]
        raise IndexError(f"FusedLinear has {len(self.sizes)} members, not {index + 1}")

    def __call__(self, x: torch.Tensor, delta_rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        out = []
        for part, run in zip(self.parts, self.runs):
            y = part(x, delta_rows)
            out.extend(y.split([self.sizes[j] for j in run], dim=-1) if len(run) > 1 else [y])
        return out

    def concat(self, x: torch.Tensor, delta_rows: torch.Tensor | None = None) -> torch.Tensor:
        """All output columns as one [T, sum(sizes)] tensor."""
        if len(self.parts) == 1:
            return self.parts[0](x, delta_rows)
        return torch.cat([p(x, delta_rows) for p in self.parts], dim=-1)


class GatedAttention:
    """Full attention with a sigmoid output gate, per-head q/k RMSNorm, partial (m)RoPE and GQA."""

    def __init__(self, cfg: ModelConfig, qkv: FusedLinear, o_proj: Linear, q_norm: torch.Tensor,
                 k_norm: torch.Tensor):
        self.cfg = cfg
        self.qkv, self.o_proj = qkv, o_proj
        self.q_norm, self.k_norm = q_norm, k_norm
        self.scale = cfg.head_dim**-0.5

    @property
    def core_width(self) -> int:
        """Columns of `core`'s output rows."""
        return self.cfg.num_attention_heads * self.cfg.head_dim

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        core_in, carry = self.before_core(x, positions, batch.delta_rows)
        return self.after_core(self.core(core_in, batch, kv), carry, batch.delta_rows)

    def before_core(self, x: torch.Tensor, positions: torch.Tensor, delta_rows) -> tuple[list, list]:
        """The token-wise part before the attention: ([q, k, v] after their norms and rotation, [gate])."""
        cfg, t = self.cfg, x.shape[0]
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_gate, k, v = self.qkv(x, delta_rows)
        q_gate = q_gate.view(t, hq, 2 * d)  # per head [query | gate]
        q = K.rms_norm(q_gate[..., :d].reshape(t * hq, d), self.q_norm, cfg.rms_norm_eps).view(t, hq, d)
        gate = q_gate[..., d:].reshape(t, hq * d)
        k = K.rms_norm(k.reshape(t * hkv, d), self.k_norm, cfg.rms_norm_eps).view(t, hkv, d)
        v = v.reshape(t, hkv, d)
        q, k = K.rope(q, k, positions, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)
        return [q, k, v], [gate]

    def core(self, core_in: list, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """The part across rows: the KV writes and the attention over the cache, [T, heads * head_dim]."""
        q, k, v = core_in
        a = batch.attn
        K.write_kv(k, v, kv.k, kv.v, a.slot_mapping, kv.k_scale, kv.v_scale)
        o = None
        if kv.sparse is not None:  # sparse attention levers: refresh the page tables, attend to kept blocks
            o = kv.sparse.attend(q, kv.k, kv.v, kv.k_scale, kv.v_scale, a.slot_mapping, a.block_tables,
                                 batch.cu_seqlens_q, a.seq_lens, batch.max_query_len, a.max_seq_len, self.scale)
        if o is None:
            o = K.paged_attention(q, kv.k, kv.v, a.block_tables, batch.cu_seqlens_q, a.seq_lens, self.scale,
                                  kv.k_scale, kv.v_scale, batch.max_query_len, a.max_seq_len, k_new=k, v_new=v)
        return o.view(q.shape[0], self.core_width)

    def after_core(self, o: torch.Tensor, carry: list, delta_rows) -> torch.Tensor:
        """The token-wise part after: the output gate and o_proj."""
        (gate,) = carry
        return self.o_proj(K.sigmoid_mul(o, gate), delta_rows)


class GatedDeltaNet:
    """Linear attention with the gated delta rule: conv1d over [q|k|v], per-head recurrence,
    gated RMSNorm with z, output projection."""

    def __init__(self, cfg: ModelConfig, in_proj: FusedLinear, out_proj: Linear, conv_weight: torch.Tensor,
                 A_log: torch.Tensor, dt_bias: torch.Tensor, norm_weight: torch.Tensor):
        self.cfg = cfg
        self.in_proj, self.out_proj = in_proj, out_proj  # in_proj: members qkv, z, b, a (one GEMV when one format)
        self.conv_weight, self.A_log, self.dt_bias, self.norm_weight = conv_weight, A_log, dt_bias, norm_weight

    @property
    def core_width(self) -> int:
        """Columns of `core`'s output rows."""
        return self.cfg.linear_num_value_heads * self.cfg.linear_value_head_dim

    def __call__(self, x: torch.Tensor, batch: StepBatch, st: GDNState, layer: int) -> torch.Tensor:
        core_in, carry = self.before_core(x, batch.delta_rows)
        return self.after_core(self.core(core_in, batch, st, layer), carry, batch.delta_rows)

    def before_core(self, x: torch.Tensor, delta_rows) -> tuple[list, list]:
        """The token-wise part before the recurrence: ([mixed q|k|v before the conv, a, b], [z])."""
        mixed, z, b, a = self.in_proj(x, delta_rows)
        return [mixed.contiguous(), a, b], [z]

    def core(self, core_in: list, batch: StepBatch, st: GDNState, layer: int) -> torch.Tensor:
        """The part along each sequence: the causal conv and the gated delta rule, [T, v heads * v dim]."""
        cfg = self.cfg
        mixed, a, b = core_in
        t = mixed.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, kd = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_key_dim
        g, cu = batch.gdn, batch.cu_seqlens_q
        if g.num_spec_seqs:  # before the conv overwrites the state it starts from
            conv_states_per_position(mixed, st.conv, cu, g.state_slots, g.has_initial_state,
                                     g.intermediate_conv[layer])
        mixed = K.causal_conv1d(mixed, self.conv_weight, st.conv, cu, g.state_slots, g.has_initial_state, True,
                                batch.max_query_len)
        q = mixed[:, :kd].view(t, hk, dk)
        k = mixed[:, kd:2 * kd].view(t, hk, dk)
        v = mixed[:, 2 * kd:].view(t, hv, dv)
        rule = lambda rows, cu_, seqs, inter: K.gated_delta_rule(  # noqa: E731
            q[rows], k[rows], v[rows], a[rows], b[rows], self.A_log, self.dt_bias, st.ssm, cu_, g.state_slots[seqs],
            g.has_initial_state[seqs], state_scale=st.ssm_scale, intermediate_states=inter,
            max_query_len=batch.max_query_len)
        if not g.num_spec_seqs:
            o = rule(slice(None), cu, slice(None), None)
        else:  # verification rows keep per-position states; the rest (prefill chunks, decodes) do not
            s_, ts = g.num_spec_seqs, g.num_spec_tokens
            o = torch.empty_like(v)
            o[:ts] = rule(slice(0, ts), cu[:s_ + 1], slice(0, s_), g.intermediate_states[layer])
            if ts < t:
                o[ts:] = rule(slice(ts, t), g.cu_seqlens_rest, slice(s_, None), None)
        return o.reshape(t, hv * dv)

    def after_core(self, o: torch.Tensor, carry: list, delta_rows) -> torch.Tensor:
        """The token-wise part after: the gated RMSNorm with z and out_proj."""
        cfg, t = self.cfg, o.shape[0]
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        (z,) = carry
        o = K.gated_rms_norm(o.reshape(t * hv, dv), z.reshape(t * hv, dv), self.norm_weight, cfg.rms_norm_eps)
        return self.out_proj(o.view(t, hv * dv), delta_rows)


def conv_states_per_position(x: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                             state_slots: torch.Tensor, has_initial_state: torch.Tensor, out: torch.Tensor) -> None:
    """out[i, t] = the conv state (last W-1 inputs) after position t of sequence i, for the first
    out.shape[0] sequences (rows past a sequence's length hold don't-care values). Pure indexing."""
    s, lmax, w1 = out.shape[0], out.shape[1], out.shape[2]
    prev = conv_state[state_slots[:s]] * has_initial_state[:s, None, None].to(conv_state.dtype)
    idx = (cu_seqlens[:s, None].long() + torch.arange(lmax, device=x.device)[None, :]).clamp(max=x.shape[0] - 1)
    hist = torch.cat([prev, x[idx].to(conv_state.dtype)], dim=1)  # [S, W-1+Lmax, C]
    out.copy_(hist.unfold(1, w1, 1)[:, 1:lmax + 1].permute(0, 1, 3, 2))


class MLP:
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, gate_up: FusedLinear, down: Linear):
        self.gate_up, self.down = gate_up, down

    def __call__(self, x: torch.Tensor, delta_rows: torch.Tensor | None) -> torch.Tensor:
        return self.down(K.silu_mul(self.gate_up.concat(x, delta_rows)), delta_rows)
