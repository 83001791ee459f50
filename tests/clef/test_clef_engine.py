"""Clef records through the ENGINE (LLMEngine.add_clef): prefill-only requests with their own cache
salt, deltas on their rows only, the head fed chunk by chunk, answers when the last chunk ran.

- 4 records + 4 chats in the same steps: each chat's tokens equal the chat run alone, each record's
  answers equal the record run alone; every mixed step's delta rows are exactly the records' rows.
- A record of >= 4096 tokens in 512-token chunks (max_num_batched_tokens=512) answers as in one chunk.
- A record preempted by a tight KV cache restarts from its first token (head state reset) and
  answers as if it had run once.
- At most clef_slots records in flight; the worker refuses a record whose tokens are not the ones
  the endpoint encoded (length + checksum); aborts free everything.
"""

from __future__ import annotations

import random

import pytest

from clef_records import make_record, max_dp, run_engine
from qv.clef.request import encode_request
from qv.config import EngineConfig
from qv.engine.engine import LLMEngine
from qv.engine.request import InvalidRequestError, SamplingParams
from qv.model.delta_bank import DeltaGroups
from qv.model.cache import kv_bytes_per_block

NMAX = 34816
BOUND = 1e-5  # max |dp| vs the record alone: batch composition only reorders fp32 sums (~1e-7)
CHAT = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(tiny_engine, folder, **levers) -> LLMEngine:
    levers.setdefault("max_model_len", 8192)
    return tiny_engine(model=folder, device="cpu", **levers).engine


def run(eng: LLMEngine, records: dict, chats: dict | None = None, chat_params: SamplingParams = CHAT) -> dict:
    return run_engine(eng, records, chats, chat_params)


def spy_steps(eng: LLMEngine) -> list:
    """Record, per step: which batch rows are Clef rows and the delta rows the runner passed."""
    steps = []
    prepare = eng.runner.prepare

    def spied(plan):
        st = prepare(plan)
        expected = [r for i, s in enumerate(st.seqs) if eng.clef.owns(s) for r in range(st.cu[i], st.cu[i + 1])]
        d = st.batch.delta_rows  # slot 0's group (Clef's rows are grouped in the step's delta fields)
        got = None if d is None else (d.rows if isinstance(d, DeltaGroups) else d).tolist()
        steps.append({"kinds": [eng.clef.owns(s) for s in st.seqs], "expected": expected, "got": got,
                      "pieces": st.pieces is not None,
                      "clef_rows": {s.request_id: int(st.cu[i + 1] - st.cu[i]) for i, s in enumerate(st.seqs)
                                    if eng.clef.owns(s)}})
        return st

    eng.runner.prepare = spied
    return steps


@pytest.fixture(scope="module")
def alone(tiny_engine, clef_dirs):
    """One engine on layout (b) that runs things one at a time (the 'alone' side)."""
    return make_engine(tiny_engine, clef_dirs["adapters"], max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def records(tokenizers):
    tok = tokenizers["adapters"]
    return {f"r{i}": encode_request(tok, make_record(700 + i, small=True), NMAX) for i in range(4)}


def test_mixed_batches_through_the_engine(tiny_engine, clef_dirs, alone, records):
    rng = random.Random(3)
    vocab = alone.model_config.vocab_size
    chats = {f"c{j}": [rng.randrange(3, min(vocab, 250)) for _ in range(rng.randint(5, 60))] for j in range(4)}
    # a budget that takes every chat and record in the first step but the last record's second half
    budget = sum(map(len, chats.values())) + sum(r.num_tokens for r in records.values()) - records["r3"].num_tokens // 2
    # the long-prefill share off (every record may take the budget beside the chats): one batch mixes them all
    eng = make_engine(tiny_engine, clef_dirs["adapters"], max_num_batched_tokens=budget,
                      long_prefill_token_threshold=budget,
                      max_long_partial_prefills=4)
    steps = spy_steps(eng)
    mixed = run(eng, records, chats)
    mixed_steps = [s for s in steps if any(s["kinds"]) and not all(s["kinds"])]
    assert mixed_steps, "no step held both Clef and chat rows: the test did not mix them"
    assert all(s["got"] == s["expected"] for s in steps if any(s["kinds"])), "delta rows are not the Clef rows"
    assert all(s["got"] is None for s in steps if not any(s["kinds"]))
    assert max(sum(s["kinds"]) for s in steps) == 4, "the four records were never in flight together"
    for rid, ids in chats.items():
        ref = run(alone, {}, {rid: ids})[rid]
        assert mixed[rid].outputs[0].token_ids == ref.outputs[0].token_ids, rid
    worst = 0.0
    for rid, rec in records.items():
        ref = run(alone, {rid: rec})[rid].clef
        got = mixed[rid].clef
        worst = max(worst, max_dp(got.probabilities, ref.probabilities))
        assert list(got.answers) == list(ref.answers)
        assert all(got.answers[q].get("choice") == ref.answers[q].get("choice") for q in got.answers)
        assert mixed[rid].outputs[0].finish_reason == "stop" and mixed[rid].outputs[0].token_ids == []
    print(f"\nengine mixed batch: {len(mixed_steps)} mixed steps, Clef max |dp| vs alone {worst:.1e}")
    assert worst <= BOUND
    st = eng.stats
    assert st.generation_tokens == 4 * CHAT.max_tokens + 4  # one engine token per record, like the original
    assert st.prompt_tokens == sum(map(len, chats.values())) + sum(r.num_tokens for r in records.values())


def test_records_beside_chats_run_async_as_they_run_sync(tiny_engine, clef_dirs, records):
    """Async scheduling keeps running while records prefill beside decoding chats: steps with record rows launch
    before the last step is collected, the chats' tokens equal the synchronous engine's and the records' answers
    its answers (fp32 reorderings only)."""
    rng = random.Random(11)
    chats = {f"c{j}": [rng.randrange(3, 250) for _ in range(rng.randint(5, 40))] for j in range(3)}
    out, overlapped = {}, {}
    for mode in (False, True):  # small chunks: each record takes several steps beside the chats' decodes
        eng = make_engine(tiny_engine, clef_dirs["adapters"], async_scheduling=mode, max_num_batched_tokens=96)
        runner, in_flight, launches = eng.runner, [0], []
        execute, collect = runner.execute, runner.collect

        def spied_execute(plan, execute=execute, in_flight=in_flight, launches=launches, eng=eng):
            launches.append((in_flight[0], any(eng.clef.owns(q) for q, _ in plan.scheduled)))
            in_flight[0] += 1
            return execute(plan)

        def spied_collect(h, collect=collect, in_flight=in_flight):
            in_flight[0] -= 1
            return collect(h)

        runner.execute, runner.collect = spied_execute, spied_collect
        out[mode] = run(eng, records, chats)
        overlapped[mode] = sum(1 for busy, has_record in launches if busy and has_record)
    assert overlapped[False] == 0 and overlapped[True] > 0, overlapped  # record steps launched over another
    for rid in chats:
        assert out[True][rid].outputs[0].token_ids == out[False][rid].outputs[0].token_ids, rid
    worst = 0.0
    for rid in records:
        got, ref = out[True][rid].clef, out[False][rid].clef
        worst = max(worst, max_dp(got.probabilities, ref.probabilities))
        assert [a.get("choice") for a in got.answers.values()] == [a.get("choice") for a in ref.answers.values()]
        assert out[True][rid].outputs[0].finish_reason == "stop"
    print(f"\nasync vs sync: {overlapped[True]} record steps launched over another, Clef max |dp| {worst:.1e}")
    assert worst <= BOUND


def test_warm_up_runs_a_record_and_leaves_no_trace(tiny_engine, clef_dirs, alone, records, caplog):
    """Start-up's warm-up (LLMEngine.warm_up, called directly: the engine calls it on CUDA) runs one Clef
    record through the delta rows and the head, in chunks of under MANY_ROWS rows (as a step target makes them
    beside decodes: the grouped deltas' few-row kernels) and of the whole budget; then statistics are zero and
    answers equal a cold engine's."""
    import logging

    from qv.engine.engine import WARM_UP_SMALL_CHUNK
    from qv.kernels.grouped_delta.configs import MANY_ROWS

    eng = make_engine(tiny_engine, clef_dirs["adapters"], max_num_batched_tokens=256)
    added, chunks = [], []
    add, execute = eng.add_clef, eng.runner.execute
    eng.add_clef = lambda rid, rec: added.append(rec.num_tokens) or add(rid, rec)
    eng.runner.execute = lambda plan: chunks.extend(
        n for seq, n in plan.scheduled if seq.request_id.startswith("qv-warm-up-clef")) or execute(plan)
    with caplog.at_level(logging.INFO, logger="qv"):
        eng.warm_up()
    assert "and one Clef record (twice) in" in caplog.text
    assert len(added) == 2 and added[0] == added[1] and 256 < added[0] <= 1024, added  # more than one 256-token chunk
    assert WARM_UP_SMALL_CHUNK < MANY_ROWS and max(chunks) == 256, chunks
    assert max(chunks[:added[0] // WARM_UP_SMALL_CHUNK]) == WARM_UP_SMALL_CHUNK, chunks
    assert not eng.has_unfinished_requests() and not eng.requests
    assert eng.stats.prompt_tokens == 0 and eng.stats.generation_tokens == 0
    warm, cold = run(eng, records), run(alone, records)
    assert max(max_dp(warm[r].clef.probabilities, cold[r].clef.probabilities) for r in records) <= BOUND


def test_warm_up_skips_a_record_whose_questions_do_not_fit(tiny_engine, clef_dirs, caplog):
    """A Clef cap under the record's template and questions: the warm-up logs why and runs the rest."""
    import logging

    eng = make_engine(tiny_engine, clef_dirs["adapters"], max_model_len=512, max_num_batched_tokens=256,
                      clef_nmax=300)
    with caplog.at_level(logging.INFO, logger="qv"):
        eng.warm_up()
    assert "warm-up: no Clef record (record too long" in caplog.text
    assert "warmed up: 3 dummy requests" in caplog.text and "Clef record in" not in caplog.text  # 300 > 256
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("delta_host", [False, True])
def test_records_replay_piecewise_graphs(tiny_engine, clef_dirs, alone, records, monkeypatch, delta_host):
    """With piecewise graphs (their capture faked on the CPU: tests/graph_fakes.py), steps with records' rows
    replay them, the deltas grouped in bank slot 0 over the step's delta fields, and answers and chats equal
    the eager engine's. Deltas streamed from host memory are not captured: those steps run eagerly."""
    from graph_fakes import faithful_pieces
    from qv.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "eager_reason", lambda *a: None)
    monkeypatch.setattr("qv.engine.runner.ModelRunner.enable_decode_graphs",
                        lambda self, slot: setattr(self, "scratch_slot", slot))
    runs = faithful_pieces(monkeypatch)
    rng = random.Random(4)
    chats = {f"c{j}": [rng.randrange(3, 250) for _ in range(rng.randint(5, 40))] for j in range(2)}
    eng = make_engine(tiny_engine, clef_dirs["adapters"], max_num_batched_tokens=256, clef_delta_host=delta_host,
                      piecewise_graph_max_rows=512)
    assert eng.runner.pieces.deltas is not delta_host
    steps = spy_steps(eng)
    some = {k: records[k] for k in ("r0", "r1")}
    got = run(eng, some, chats)
    with_records = [s["pieces"] for s in steps if any(s["kinds"])]
    assert with_records and all(p is not delta_host for p in with_records), with_records
    assert runs
    for rid, rec in some.items():
        assert max_dp(got[rid].clef.probabilities, run(alone, {rid: rec})[rid].clef.probabilities) <= BOUND
    for rid, ids in chats.items():
        assert got[rid].outputs[0].token_ids == run(alone, {}, {rid: ids})[rid].outputs[0].token_ids, rid


def test_long_record_chunked_equals_one_chunk(tiny_engine, clef_dirs, tokenizers):
    record = make_record(77, n_questions=4, small=True)
    record["state"] = " ".join(["the checkout returns errors after the payment step and orders stay blocked"] * 58)
    rec = encode_request(tokenizers["release"], record, NMAX)
    assert rec.num_tokens >= 4096, rec.num_tokens
    results, chunks = {}, {}
    for budget in (512, 8192):
        eng = make_engine(tiny_engine, clef_dirs["release"], max_num_batched_tokens=budget)
        steps = spy_steps(eng)
        results[budget] = run(eng, {"long": rec})["long"].clef
        chunks[budget] = [s["clef_rows"]["long"] for s in steps]
    assert chunks[8192] == [rec.num_tokens] and len(chunks[512]) == -(-rec.num_tokens // 512)
    dp = max_dp(results[512].probabilities, results[8192].probabilities)
    print(f"\nengine: {rec.num_tokens}-token record in {len(chunks[512])} chunks of 512 vs one chunk: max |dp| {dp:.1e}")
    assert dp <= BOUND
    assert results[512].answers.keys() == results[8192].answers.keys()


def test_preempted_record_restarts_cleanly(tiny_engine, clef_dirs, alone, tokenizers):
    rec = encode_request(tokenizers["adapters"], make_record(903, n_questions=1, state_size=80), NMAX)
    budget = 12  # the record gets 11 rows a step beside the chat's decode row: ~50 steps of prefill
    steps = -(-rec.num_tokens // (budget - 1))
    assert steps > 40, rec.num_tokens
    # Room for the record plus the chat's 2 blocks and one growth block (what admission asks for). The
    # chat, admitted first, keeps decoding; by the record's last chunks the two no longer fit, so the
    # newest (the record) is preempted, and readmitted once the chat is done.
    blocks = -(-rec.num_tokens // 16) + 3
    eng = make_engine(tiny_engine, clef_dirs["adapters"], max_num_batched_tokens=budget, prefix_caching=False,
                      long_prefill_token_threshold=budget, kv_cache_bytes=blocks * kv_bytes_per_block(alone.model_config, 16, alone.runner.model.dtype))
    chat = SamplingParams(temperature=0.0, max_tokens=steps + 20, ignore_eos=True)
    out = run(eng, {"rec": rec}, {"c": list(range(3, 19))}, chat)
    res = out["rec"].clef
    assert eng.stats.num_preemptions >= 1 and res.restarts >= 1, (eng.stats.num_preemptions, res.restarts)
    ref = run(alone, {"rec": rec})["rec"].clef
    dp = max_dp(res.probabilities, ref.probabilities)
    print(f"\nengine: record preempted {res.restarts}x and recomputed: max |dp| vs alone {dp:.1e}")
    assert dp <= BOUND and ref.restarts == 0
    assert len(out["c"].outputs[0].token_ids) == chat.max_tokens


def test_clef_slots_bound_records_in_flight(tiny_engine, clef_dirs, records):
    eng = make_engine(tiny_engine, clef_dirs["adapters"], max_num_batched_tokens=256, clef_slots=2)
    seen = []
    step = eng.step

    def counted():
        sched = eng.scheduler
        seen.append(sum(1 for s in sched.running + list(sched.waiting) if eng.clef.owns(s)))
        return step()

    eng.step = counted
    for rid, rec in records.items():
        eng.add_clef(rid, rec)
    assert eng.stats.num_waiting == 4  # admitted from the next step on, at most two at a time
    # (async scheduling: this call may launch a second step, and a record's answers come right after its last
    # chunk's launch, so one may finish here already)
    early = {o.request_id: o for o in eng.step() if o.finished}
    assert len(eng.clef.pending) == 2 and eng.stats.num_waiting >= 2  # two wait for a Clef slot
    done = {**early, **run(eng, {})}
    assert sorted(done) == sorted(records) and all(o.clef is not None for o in done.values())
    assert max(seen) == 2 and eng.stats.num_waiting == 0


def test_worker_refuses_a_record_that_is_not_the_encoded_one(alone, records):
    """The engine hashes the token ids each chunk actually ran (from the step's upload) and compares
    them with the record's checksum, taken when it was queued: tokens changed in between are refused."""
    rec = records["r0"]
    alone.add_clef("tampered", rec)
    alone.requests["tampered"].seqs[0].prompt_token_ids[5] += 1
    out = run(alone, {})["tampered"]
    assert out.clef is None and out.outputs[0].finish_reason == "error"
    assert "Clef record refused: the engine ran" in out.error
    assert f"encoded {rec.num_tokens} tokens with checksum {rec.checksum}" in out.error
    assert run_one(alone, "fine", rec).clef is not None  # and the engine carries on


def run_one(eng, rid, rec):
    eng.add_clef(rid, rec)
    return run(eng, {})[rid]


def test_abort_frees_running_and_queued_records(tiny_engine, clef_dirs, records):
    eng = make_engine(tiny_engine, clef_dirs["adapters"], max_num_batched_tokens=64, clef_slots=1)
    free = eng.blocks.num_free
    for rid in ("r0", "r1"):
        eng.add_clef(rid, records[rid])
    eng.step()
    assert eng.blocks.num_free < free
    assert eng.abort_request("r1").outputs[0].finish_reason == "abort"  # waiting for a Clef slot
    assert eng.abort_request("r0").outputs[0].finish_reason == "abort"  # mid-prefill
    while eng.has_unfinished_requests():  # async scheduling: the step in flight is collected (its rows dropped)
        assert not eng.step()
    assert eng.blocks.num_free == free
    assert not eng.clef.jobs and not eng.clef.pending and eng.stats.num_waiting == 0
    with pytest.raises(InvalidRequestError, match="no Clef decisions"):
        make_engine(tiny_engine, clef_dirs["adapters"], clef=False).add_clef("x", records["r0"])


def test_head_state_failure_fails_that_record_before_it_runs(tiny_engine, clef_dirs, records, monkeypatch):
    eng = make_engine(tiny_engine, clef_dirs["adapters"], max_num_batched_tokens=64)
    free, real_state = eng.blocks.num_free, eng.clef.head.state

    def state(record, embedding):
        if record is records["r1"]:
            raise MemoryError("no room for the head state")
        return real_state(record, embedding)

    monkeypatch.setattr(eng.clef.head, "state", state)
    for rid in ("r0", "r1"):
        eng.add_clef(rid, records[rid])
    first = {o.request_id: o for o in eng.step()}
    assert first["r1"].finished and first["r1"].clef is None and "MemoryError" in first["r1"].error
    assert "r1" not in {s.request_id for s in eng.scheduler.running}
    assert run(eng, {})["r0"].clef is not None  # the other record is answered
    assert eng.blocks.num_free == free


def test_offline_decide_refusal_leaves_nothing_queued(tiny_engine, clef_dirs):
    from qv.llm import LLM

    llm = tiny_engine(model=clef_dirs["release"], device="cpu", max_model_len=4096, kv_cache_bytes=1 << 20)
    room = llm.engine.blocks.capacity(True) * llm.engine.blocks.block_size
    small, big = make_record(50, small=True), make_record(51, small=True)
    big["state"] = "word " * (2 * room)
    with pytest.raises(InvalidRequestError, match="the KV cache holds"):
        llm.decide([small, big])
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    assert llm.decide(small)["usage"]["input_tokens"] > 0


def test_offline_llm_decide(tiny_engine, clef_dirs):
    from qv.clef.offline import run_record
    from qv.llm import LLM

    llm = tiny_engine(model=clef_dirs["release"], device="cpu", max_model_len=4096)
    bodies = [make_record(40 + i, small=True) for i in range(2)]
    outs = llm.decide(bodies)
    assert len(outs) == 2 and llm.decide(bodies[0]) == outs[0]
    for body, out in zip(bodies, outs):
        rec = encode_request(llm.tokenizer, body, NMAX)
        probs = run_record(llm.engine.runner.model, llm.engine.clef.head, rec).probabilities()
        assert out["usage"] == {"input_tokens": rec.num_tokens, "output_tokens": 0}
        for q, p in zip(rec.questions, probs):
            a = out["answers"][q.question_id]
            value = a["noul"] if q.type_name == "noul" else a["confidence"]
            expect = p[0] if q.type_name == "noul" else max(p)
            assert abs(value - expect) <= 1e-4, (q.question_id, value, expect)


@pytest.mark.gpu
def test_deltas_in_host_memory_give_the_same_answers(clef_dirs, records):
    """QV_CLEF_DELTA_HOST: the deltas stay in pinned host memory and are copied in per use (the
    branch in qv/model/layers.py that only a GPU takes)."""
    probs = {}
    for host in (False, True):
        eng = LLMEngine(EngineConfig(model=str(clef_dirs["adapters"]), device="cuda", dtype="float32",
                                     max_model_len=8192, clef_delta_host=host, kernels="reference",
                                     kv_cache_bytes=1 << 28))  # two engines in turn: neither plans the whole GPU
        down = eng.runner.model.layers[-1].mlp.down  # LoRA and deabl sit on the last layer's down_proj
        assert down.bank is not None and (down.bank.a.device.type == "cpu") == host
        if host:
            assert down.bank.a.is_pinned() and down.bank.b.is_pinned()
        probs[host] = run(eng, {"r0": records["r0"]})["r0"].clef.probabilities
        del eng
    dp = max(abs(a - b) for qa, qb in zip(probs[False], probs[True]) for a, b in zip(qa, qb))
    # the same values, in fresh device buffers each use: cuBLAS may pick another fp32 reduction
    # order for them (H200, 2026-12-01: 1.04e-6), so not bit-identical; a wrong or stale delta moves
    # the answers by > 1e-3 (test_clef_answers.py::test_deltas_change_clef_rows_only)
    assert dp <= 1e-5, dp
