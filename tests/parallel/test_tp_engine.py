"""Tensor parallelism in the engine, on the CPU: `LLM(tensor_parallel_size=2)` starts one gloo worker
that loads its shard and follows the driver's steps. Greedy tokens and logprobs (the chosen token's
and the top 5 of every step, prompt logprobs too) equal tensor_parallel_size 1's over prompts of
different lengths in chunked prefill with a queue (more prompts than max_num_seqs). A step the worker
did not mirror (a missing compute_logits call, a wrong array view) hangs or breaks the collectives;
a wrong shard or cache id changes the logprobs far beyond the fp32 bound. A killed worker stops the
engine with an error naming it, in bounded time; shutdown stops the worker; levers not built for
N > 1 are refused at start, before any worker starts.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from qv import LLM, SamplingParams
from qv.config import ConfigError, EngineConfig
from qv.engine.tensor_parallel import TensorParallelError, check_levers
from engine.engine_oracle import assert_logprob_close, hf_model  # tests/engine as a namespace package
from util import assert_close

LOGPROB_BOUND = 1e-4  # chosen tokens' logprobs, absolute: the engine oracle's bound (tests/engine/engine_oracle.py)
TOP_BOUND = 1e-5  # each prompt's top-5 logprobs over its steps, relative: the fp32 bound of the model-level test
LEVERS = dict(prefix_caching=False, max_num_batched_tokens=16, max_num_seqs=3, block_size=8)
LENGTHS, MAX_TOKENS, TOP = (37, 3, 21, 9, 30), 10, 5


@pytest.fixture(scope="module")
def case(tiny_dirs):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in LENGTHS]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=TOP,
                             prompt_logprobs=2 if i == 0 else None) for i in range(len(prompts))]
    return str(tiny_dirs("gqa1")), prompts, params, seed  # gqa1: 2 query / 2 KV heads, 2 GDN heads


def generate(tiny_engine, model_dir, prompts, params, **levers):
    llm = tiny_engine(model=model_dir, **LEVERS, **levers)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.engine.shutdown()


def top_logprobs(out) -> torch.Tensor:
    """[steps, TOP] logprobs of each step's top tokens, ordered by rank."""
    rows = []
    for entry in out.outputs[0].logprobs:
        by_rank = sorted((lp.rank, lp.logprob) for lp in entry.values() if lp.rank <= TOP)
        rows.append([lp for _, lp in by_rank[-TOP:]])
    return torch.tensor(rows, dtype=torch.float64)


def close_logprob(name: str, context: list[int], tok: int, tp2: float, tp1: float, model_dir: str) -> float:
    """|TP 2 - TP 1| under LOGPROB_BOUND; where not (an entry fp32 itself holds poorly: the ranks' partial
    sums round differently), TP 2 within the engine oracle's bound of transformers' float64 logprob."""
    err = abs(tp2 - tp1)
    if err >= LOGPROB_BOUND:
        with torch.no_grad():
            logits = hf_model(model_dir)(input_ids=torch.tensor([context])).logits[0, -1]
        ref = float(torch.log_softmax(logits.double(), -1)[tok])
        print(f"{name}: TP 2 {tp2:.7f}, TP 1 {tp1:.7f}, transformers float64 {ref:.7f}")
        assert_logprob_close(name, context, tok, tp2, ref, model_dir)
    return err


@pytest.mark.timeout(300)  # a collective the ranks do not share would wait out the process group timeout
def test_tp2_equals_tp1(tiny_engine, case):
    model_dir, prompts, params, seed = case
    print(f"seed {seed}")
    assert max(LENGTHS) > LEVERS["max_num_batched_tokens"] and len(prompts) > LEVERS["max_num_seqs"]
    ref = generate(tiny_engine, model_dir, prompts, params)
    got = generate(tiny_engine, model_dir, prompts, params, tensor_parallel_size=2)
    errs = []
    for i, (g, r) in enumerate(zip(got, ref)):
        name, out = f"prompt {i} (len {len(prompts[i])}, seed {seed})", g.outputs[0].token_ids
        assert out == r.outputs[0].token_ids, name
        for j, (tok, ge, re) in enumerate(zip(out, g.outputs[0].logprobs, r.outputs[0].logprobs)):
            assert ge[tok].rank == re[tok].rank, f"{name} token {j}"
            errs.append(close_logprob(f"{name} token {j}", prompts[i] + out[:j], tok, ge[tok].logprob,
                                      re[tok].logprob, model_dir))
        assert_close(f"{name} top-{TOP} logprobs", top_logprobs(g), top_logprobs(r), TOP_BOUND)
    lp_got, lp_ref = got[0].prompt_logprobs, ref[0].prompt_logprobs
    assert len(lp_got) == len(lp_ref) == LENGTHS[0] and lp_got[0] is None
    for j, (a, b) in enumerate(zip(lp_got[1:], lp_ref[1:]), start=1):
        assert a.keys() == b.keys(), f"prompt logprobs row {j}"
        for tok in a:
            errs.append(close_logprob(f"prompt logprobs row {j} token {tok}", prompts[0][:j], tok, a[tok].logprob,
                                      b[tok].logprob, model_dir))
    print(f"seed {seed}: {len(errs)} logprobs, median difference {sorted(errs)[len(errs) // 2]:.1e}, "
          f"worst {max(errs):.1e}")


@pytest.mark.timeout(120)
def test_killed_worker_stops_the_engine(tiny_engine, case):
    model_dir, prompts, _, _ = case
    llm = tiny_engine(model=model_dir, tensor_parallel_size=2, **LEVERS)
    engine = llm.engine
    try:
        engine.add_request("a", prompts[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
        for _ in range(3):  # a prefill chunk or two, then decode
            engine.step()
        worker = engine.tp.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(timeout=30)
        for _ in range(2):  # the step after the death, and every one after it
            with pytest.raises(TensorParallelError, match=f"rank 1 exited with code {-signal.SIGKILL}"):
                engine.step()
    finally:
        engine.shutdown()
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_shutdown_stops_the_worker(tiny_engine, case):
    model_dir, prompts, _, _ = case
    llm = tiny_engine(model=model_dir, tensor_parallel_size=2, **LEVERS)
    workers = list(llm.engine.tp.workers)
    assert all(w.is_alive() for w in workers)
    llm.engine.shutdown()
    assert [w.exitcode for w in workers] == [0]  # the stop message, not a kill
    assert not dist.is_initialized()
    llm.engine.shutdown()  # twice is harmless


def test_media_is_refused_before_workers_start(tiny_engine):
    """A checkpoint with a vision tower (mixed: its heads split over 2 ranks) and media left on."""
    with pytest.raises(ConfigError, match="tensor_parallel_size 2 .*images and videos yet: use media_max_images=0"):
        tiny_engine(preset="mixed", tensor_parallel_size=2, **LEVERS)
    assert not multiprocessing.active_children() and not dist.is_initialized()


@pytest.mark.parametrize("kw, match", [
    (dict(media=True, device=torch.device("cpu")), "images and videos yet: use media_max_images=0"),
    (dict(media=False, device=torch.device("cuda")), "CUDA graphs yet .*use cuda_graphs=0"),
])
def test_media_and_cuda_graphs_are_refused(kw, match):
    # no vision fixture or GPU here: the check the start-up path calls, with what it would pass
    with pytest.raises(ConfigError, match=match):
        check_levers(EngineConfig(tensor_parallel_size=2, prefix_caching=False), **kw)


def test_lever_bounds():
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)


@pytest.mark.timeout(120)
def test_interpreter_exit_stops_the_worker(case):
    """An engine never shut down: the worker is gone once the interpreter exits (the engine's finalizer
    sends it the stop message; multiprocessing would terminate a daemonic worker after)."""
    script = ("import sys\nfrom qv import LLM\nif __name__ == '__main__':\n"
              f"    llm = LLM(model={case[0]!r}, tensor_parallel_size=2, **{LEVERS!r})\n"
              "    print(llm.engine.tp.workers[0].pid, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100,
                          cwd=os.getcwd())
    assert done.returncode == 0, done.stderr[-2000:]
    pid = int(done.stdout.split()[-1])
    with pytest.raises(ProcessLookupError):  # gone (exited and reaped by its parent), not left running
        os.kill(pid, 0)
