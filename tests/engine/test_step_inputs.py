"""The step's named input buffers (qv/engine/step_inputs.py): a step's batch is views of buffers
allocated once, its upload covers every byte the step filled, a tensor-parallel worker that receives
the leading bytes cuts equal views, and a replayed graph's padding is inert."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qv.engine.step_inputs import FIELDS, StepCapacity, StepInputs, StepShape

CAP = StepCapacity(rows=40, seqs=6, blocks=9, k1=3)


def _filled(inputs: StepInputs, shape: StepShape, rng: np.random.Generator) -> None:
    """Random values in every part of every field the shape uses; poison everywhere else."""
    for f in FIELDS:
        inputs.host[f.name].reshape(-1)[:] = 77 if f.dtype != torch.bool else True
        inputs.device_fields[f.name].reshape(-1).fill_(99 if f.dtype != torch.bool else True)
    for f in FIELDS:
        if f.name in ("block_tables", "sampling"):
            continue
        n = shape.used(f)
        inputs.host[f.name][:n] = rng.integers(0, 2 if f.dtype == torch.bool else 1000, n)
    table = inputs.host_table(inputs.table_stride(shape))
    table[:shape.seqs, :shape.width] = rng.integers(0, 1000, (shape.seqs, shape.width))


def _shape(**kw) -> StepShape:
    base = dict(seqs=4, rows=11, logits=5, width=7, max_query_len=5, max_seq_len=50, num_spec=2, spec_rows=6,
                draft_k=2, delta_rows=3, pending=1)
    return StepShape(**(base | kw))


def _spec():
    """A Speculator's gdn_meta, enough for a verifying step's views."""
    return type("Spec", (), {"gdn_meta": staticmethod(
        lambda slots, init, s, t, rest: type("G", (), dict(state_slots=slots, has_initial_state=init,
                                                           cu_seqlens_rest=rest))())})


def _batch_tensors(inputs: StepInputs, shape: StepShape) -> dict[str, torch.Tensor]:
    b = inputs.batch(shape, _spec())
    return dict(cu=b.cu_seqlens_q, slots=b.attn.slot_mapping, tables=b.attn.block_tables, lens=b.attn.seq_lens,
                state=b.gdn.state_slots, init=b.gdn.has_initial_state, rest=b.gdn.cu_seqlens_rest,
                logits=b.logits_indices, delta=b.delta_rows, ids=inputs.field("ids", shape.rows),
                positions=inputs.field("positions", shape.rows), next_ids=inputs.field("next_ids", shape.rows))


def test_the_upload_carries_every_filled_byte_and_views_read_them():
    rng = np.random.default_rng(0)
    inputs, shape = StepInputs(CAP, torch.device("cpu")), _shape()
    _filled(inputs, shape, rng)
    inputs.send(shape)
    t = _batch_tensors(inputs, shape)
    h = inputs.host
    assert t["ids"].tolist() == h["ids"][:11].tolist() and t["next_ids"].tolist() == h["next_ids"][:11].tolist()
    assert t["tables"].tolist() == inputs.host_table(7)[:4, :7].tolist() and t["tables"].is_contiguous()
    assert t["rest"].tolist() == h["cu_seqlens_rest"][:3].tolist() and t["delta"].tolist() == h["delta_rows"][:3].tolist()
    assert t["logits"].tolist() == h["logits_indices"][:5].tolist() and t["init"].tolist() == h["has_initial_state"][:4].tolist()
    base = inputs.device_fields["ids"].untyped_storage().data_ptr()
    for name, x in t.items():  # views of the one device buffer: nothing allocated per step
        assert x.untyped_storage().data_ptr() == base, name
    assert _batch_tensors(inputs, shape)["ids"].data_ptr() == t["ids"].data_ptr()  # the same address every step


def test_small_fields_share_one_copy():
    inputs = StepInputs(CAP, torch.device("cpu"))
    spans = inputs._spans(_shape(num_spec=0, spec_rows=0, delta_rows=0, pending=0))
    per_seq_end = inputs.offsets["ids"]
    assert spans[0][0] == 0 and spans[0][1] >= per_seq_end  # cu .. state_slots and the row fields in one copy
    assert len(spans) <= len(FIELDS)


def test_a_worker_cuts_equal_views_from_the_leading_bytes():
    """The tensor-parallel broadcast: the driver's leading worker_bytes into a second StepInputs of the
    same capacity (a worker's), whose views equal the driver's; the driver-only fields are not needed."""
    rng = np.random.default_rng(1)
    for shape in (_shape(), _shape(num_spec=0, spec_rows=0, delta_rows=0, seqs=6, rows=40, width=9)):
        driver, worker = StepInputs(CAP, torch.device("cpu")), StepInputs(CAP, torch.device("cpu"))
        _filled(driver, shape, rng)
        driver.send(shape)
        n = driver.worker_bytes(shape)
        driver.alloc(100, torch.int64)  # the driver's sampling settings: no part of the count
        assert driver.worker_bytes(shape) == worker.worker_bytes(shape) == n
        worker.worker_buffer[:n].copy_(driver.worker_buffer[:n])
        got, want = _batch_tensors(worker, shape), _batch_tensors(driver, shape)
        for name in want:
            if want[name] is None:
                assert got[name] is None, name
            else:
                assert torch.equal(got[name], want[name]), name
        assert n <= driver.offsets["drafts"]


def test_rows_grouped_by_delta_slot_reach_the_batch_a_worker_and_the_graphs():
    """LoRA's delta rows (delta_slots): the rows and every slot's start are fields the upload carries, the
    batch's DeltaGroups are views of them, a worker cuts equal ones from the leading bytes, and a graph
    captures the whole slot-start field (a replay reads every slot's start); without slots none of that."""
    rng = np.random.default_rng(3)
    cap = StepCapacity(rows=40, seqs=6, blocks=9, k1=3, delta_slots=3)
    shape = _shape(delta_rows=5, delta_slot_starts=4, delta_max_rows=3)
    driver, worker = StepInputs(cap, torch.device("cpu")), StepInputs(cap, torch.device("cpu"))
    _filled(driver, shape, rng)
    driver.host["delta_slot_start"][:4] = [0, 2, 2, 5]
    driver.send(shape)
    n = driver.worker_bytes(shape)
    assert n >= driver.offsets["delta_slot_start"] + 4 * 8  # the slot starts go to the workers
    worker.worker_buffer[:n].copy_(driver.worker_buffer[:n])
    for inputs in (driver, worker):
        g = inputs.batch(shape, _spec()).delta_rows
        assert g.rows.tolist() == driver.host["delta_rows"][:5].tolist()
        assert g.slot_start.tolist() == [0, 2, 2, 5] and g.max_rows == 3
        assert g.rows.untyped_storage().data_ptr() == inputs.worker_buffer.untyped_storage().data_ptr()
    captured = driver.graph_delta_rows(8)
    assert captured.slot_start.data_ptr() == driver.device_fields["delta_slot_start"].data_ptr()
    assert captured.slot_start.numel() == 4 and captured.rows.numel() == captured.max_rows == 8
    assert captured.rows.data_ptr() == driver.device_fields["delta_rows"].data_ptr()
    plain = StepInputs(CAP, torch.device("cpu"))
    assert plain.graph_delta_rows(8) is None
    assert isinstance(plain.batch(_shape(num_spec=0, spec_rows=0)).delta_rows, torch.Tensor)  # Clef's plain rows
    assert plain.batch(_shape(num_spec=0, spec_rows=0, delta_rows=0)).delta_rows is None


def test_padding_to_a_graph_size_is_inert():
    rng = np.random.default_rng(2)
    inputs = StepInputs(CAP, torch.device("cpu"))
    shape = _shape(num_spec=0, spec_rows=0, delta_rows=0, pending=0, seqs=3, rows=3, logits=3, pad_seqs=4, pad_rows=4)
    _filled(inputs, shape, rng)
    inputs.pad(shape, scratch_slot=5)
    inputs.send(shape)
    d = inputs.device_fields
    assert int(d["slot_mapping"][3]) == -1 and int(d["ids"][3]) == 0 and int(d["positions"][3]) == 0
    assert int(d["seq_lens"][3]) == 1 and int(d["state_slots"][3]) == 5 and not bool(d["has_initial_state"][3])
    assert int(d["block_tables"][3, 0]) != 99  # the padding's table row went up with the upload, graph-wide
    assert inputs.batch(shape).attn.block_tables.stride(0) == CAP.blocks


def test_engine_steps_are_views_of_the_runner_buffers(tiny_engine, monkeypatch):
    """Every step's ids, positions and batch tensors lie in the runner's one input buffer."""
    from qv import SamplingParams
    from qv.engine.runner import ModelRunner

    llm = tiny_engine(max_num_seqs=4)
    runner = llm.engine.runner
    buf = runner.inputs.worker_buffer
    lo, hi = buf.data_ptr(), buf.data_ptr() + buf.numel()
    seen, prepare = [], ModelRunner.prepare

    def spied(self, plan):
        st = prepare(self, plan)
        b = st.batch
        for x in (st.ids, st.positions, st.next_ids, b.cu_seqlens_q, b.attn.slot_mapping, b.attn.block_tables,
                  b.attn.seq_lens, b.gdn.state_slots, b.gdn.has_initial_state):
            assert x.numel() == 0 or lo <= x.data_ptr() < hi
        seen.append(st.ids.data_ptr())
        return st

    monkeypatch.setattr(ModelRunner, "prepare", spied)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}, {"prompt_token_ids": [7, 8]}],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(seen) >= 4 and len(set(seen)) == 1


@pytest.mark.gpu
def test_a_replayed_step_copies_nothing_in(tiny_engine):
    """Real CUDA graphs (triton kernels, fp32): every decode step after the prefill replays a graph whose
    captured ids, positions and block tables are the step's own input views, and its forward (DecodeGraphs.run)
    runs no copy or fill op: the upload already wrote the inputs and the padding. Tokens equal graphs off."""
    from qv import SamplingParams
    from qv.engine.cuda_graphs import DecodeGraphs
    from qv.engine.runner import ModelRunner

    prompts = [{"prompt_token_ids": list(range(5 + 9 * i, 20 + 9 * i))} for i in range(3)]  # 3 rows: graph of 4
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    levers = dict(device="cuda", kv_cache_bytes=256 << 20, kernels="triton", dtype="float32", max_num_seqs=4,
                  max_model_len=256)
    eager = [o.outputs[0].token_ids for o in tiny_engine(cuda_graphs=False, **levers).generate(prompts, params)]
    llm = tiny_engine(cuda_graphs=True, **levers)
    runner = llm.engine.runner
    assert runner.graphs is not None
    ops, replays, run, prepare = [], [], DecodeGraphs.run, ModelRunner.prepare

    def profiled_run(self, rows):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = run(self, rows)
        ops.extend(e.name for e in prof.events())
        replays.append(rows)
        return out

    def checked_prepare(self, plan):
        st = prepare(self, plan)
        if st.graphs is not None:  # the graph reads these very tensors
            assert st.ids.data_ptr() == st.graphs.ids.data_ptr()
            assert st.batch.attn.block_tables.data_ptr() == st.graphs.block_tables.data_ptr()
            assert st.batch.attn.seq_lens.data_ptr() == st.graphs.seq_lens.data_ptr()
        return st

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DecodeGraphs, "run", profiled_run)
        mp.setattr(ModelRunner, "prepare", checked_prepare)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert replays == [3] * 5, replays
    copies = [name for name in ops if any(k in name for k in ("copy_", "fill_", "index_put", "zero_"))]
    assert not copies, copies
    assert out == eager
