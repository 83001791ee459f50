"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' log-softmax over the prompt,
for prompts spanning several prefill chunks and several logits slices, with a prefix-cache hit
on offer (it must not be taken), under preemption, and with an image in the prompt."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine_oracle import LOGPROB_BOUND, assert_logprob_close, hf_model
from qv import LLM, SamplingParams
from qv.engine import prompt_logprobs as plp
from qv.engine.engine import LLMEngine
from qv.engine.request import InvalidFieldError

TOP = 3
TIE = 1e-4  # ranks may differ where two logprobs are this close (fp32 against float64)


@pytest.fixture
def small_slices(monkeypatch, tiny_dirs):
    """Slices of 5 logits rows, so that a chunk of 16 rows takes several, the last one ragged."""
    from qv.config import ModelConfig

    vocab = ModelConfig.from_dir(tiny_dirs("tiny")).vocab_size
    monkeypatch.setattr(plp, "SLICE_BYTES", 5 * plp.BYTES_PER_LOGIT * vocab)


@torch.no_grad()
def hf_prompt_logprobs(model_dir: str, prompt: list[int], **inputs) -> torch.Tensor:
    """[T, V] float64 log-softmax of transformers' logits at every prompt position."""
    model = hf_model(model_dir)
    logits = model(input_ids=torch.tensor([prompt]), **inputs).logits[0].double()
    return torch.log_softmax(logits, -1)


def assert_entries_match(name: str, model_dir: str, prompt: list[int], entries: list, ref: torch.Tensor,
                         tokenizer, top_n: int = TOP, contexts: bool = True) -> None:
    """Every entry: the prompt token's logprob and rank, then the top-n (ranks 1..n), each logprob
    within the oracle bound of transformers' and each rank consistent with its distribution."""
    assert len(entries) == len(prompt) and entries[0] is None, name
    for p in range(1, len(prompt)):
        entry, lp_ref = entries[p], ref[p - 1]
        tok = prompt[p]
        assert tok in entry and list(entry)[0] == tok, f"{name}: entry {p} does not start with the prompt token"
        ranked = sorted((lp.rank, tid) for tid, lp in entry.items() if tid != tok or lp.rank <= top_n)
        assert [r for r, _ in ranked][:top_n] == list(range(1, top_n + 1)), f"{name}: entry {p} ranks {ranked}"
        for tid, lp in entry.items():
            ref_lp = float(lp_ref[tid])
            if contexts:
                assert_logprob_close(f"{name} entry {p} token {tid}", prompt[:p], tid, lp.logprob, ref_lp, model_dir)
            else:
                assert abs(lp.logprob - ref_lp) < LOGPROB_BOUND * 10, f"{name} entry {p} token {tid}"
            lo, hi = int((lp_ref > ref_lp + TIE).sum()) + 1, int((lp_ref > ref_lp - TIE).sum()) + 1
            assert lo <= lp.rank <= hi, f"{name}: entry {p} token {tid} rank {lp.rank}, transformers {lo}..{hi}"
            assert lp.decoded_token == tokenizer.decode([tid], skip_special_tokens=False,
                                                        clean_up_tokenization_spaces=False)


def _run(llm: LLM, prompts: list[list[int]], params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_chunked_prompt_equals_transformers(tiny_engine, tiny_dirs, small_slices, async_scheduling):
    model_dir = str(tiny_dirs("tiny"))
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (71, 2, 1, 33)]
    llm = tiny_engine(model=model_dir, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    assert plp.slice_rows(llm.engine.model_config.vocab_size) == 5
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP, logprobs=1)
    outs = _run(llm, prompts, params)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        entries = out.prompt_logprobs
        assert_entries_match(f"prompt {i} (len {len(prompt)}, seed {seed})", model_dir, prompt, entries,
                             hf_prompt_logprobs(model_dir, prompt), llm.tokenizer)
        # the last prompt row's logprobs are the first output token's: the same rows, the same values
        first = out.outputs[0].token_ids[0]
        assert out.outputs[0].logprobs[0][first].logprob == pytest.approx(
            float(hf_prompt_logprobs(model_dir, prompt)[-1, first]), abs=1e-4)
    plain = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outs]
    assert all(o.prompt_logprobs is None for o in plain)


def test_prefix_cache_hit_is_not_taken(tiny_engine, tiny_dirs, small_slices):
    """A cached prefix (snapshots every 32 tokens) would skip rows whose logprobs are asked: the
    request computes its whole prompt, and a plain request after it still gets the hit."""
    model_dir = str(tiny_dirs("tiny"))
    rng = random.Random(11)
    prompt = [rng.randrange(300) for _ in range(90)]
    llm = tiny_engine(model=model_dir, max_num_batched_tokens=24, block_size=16, gdn_snapshot_interval=32)
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    warm = _run(llm, [prompt], greedy)[0]
    assert warm.num_cached_tokens == 0
    computed = []
    execute = llm.engine.runner.execute
    llm.engine.runner.execute = lambda plan: computed.append(sum(n for _, n in plan.scheduled)) or execute(plan)
    asked = _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=TOP))[0]
    assert asked.num_cached_tokens == 0
    assert sum(computed) == len(prompt) + 1  # every prompt row, then one decode step
    assert_entries_match("after a warm run", model_dir, prompt, asked.prompt_logprobs,
                         hf_prompt_logprobs(model_dir, prompt), llm.tokenizer)
    again = _run(llm, [prompt], greedy)[0]
    assert again.num_cached_tokens == 64, "the cache held the prefix, so the test above could have taken it"
    assert again.outputs[0].token_ids == asked.outputs[0].token_ids == warm.outputs[0].token_ids


def test_preemption_mid_prefill(tiny_engine, tiny_dirs):
    """A long prompt prefilling 3 tokens a step beside a growing decode is preempted mid-prompt and
    resumes from a prefix hit short of the rows already asked for: its entries equal transformers'."""
    from qv.config import ModelConfig
    from qv.model.cache import gdn_bytes_per_slot, kv_bytes_per_block

    model_dir = str(tiny_dirs("tiny"))
    rng = random.Random(0)
    short, long = [rng.randrange(300) for _ in range(20)], [rng.randrange(300) for _ in range(120)]
    cfg = ModelConfig.from_dir(model_dir)
    block, snap = kv_bytes_per_block(cfg, 16, torch.float32), gdn_bytes_per_slot(cfg, torch.float32, torch.float32)
    # 12 blocks, one GDN snapshot per 2: room for the long prompt, not for it and the short one's growth
    llm = tiny_engine(model=model_dir, block_size=16, kv_cache_bytes=6 * (2 * block + snap), max_num_batched_tokens=4,
                      gdn_snapshot_interval=32)
    preempted = []
    preempt = llm.engine.scheduler._preempt

    def spy(seq, plan):
        if seq.prompt_logprobs is not None:
            preempted.append((seq.prompt_logprobs.launched, seq.num_computed_tokens))
        return preempt(seq, plan)

    llm.engine.scheduler._preempt = spy
    outs = llm.generate([{"prompt_token_ids": short}, {"prompt_token_ids": long}],
                        [SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                         SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)])
    assert preempted and all(0 < launched < len(long) - 1 for launched, _ in preempted), preempted
    assert llm.engine.stats.prefix_cache_hits > 0, "the readmission was meant to resume from a hit"
    assert_entries_match("preempted prompt", model_dir, long, outs[1].prompt_logprobs,
                         hf_prompt_logprobs(model_dir, long), llm.tokenizer, top_n=2)


def test_n_samples_share_one_prompt(tiny_engine, tiny_dirs):
    model_dir = str(tiny_dirs("tiny"))
    llm = tiny_engine(model=model_dir)
    prompt = list(range(5, 45))
    out = _run(llm, [prompt], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=0))[0]
    assert len(out.outputs) == 3 and len(out.prompt_logprobs) == len(prompt)
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # prompt_logprobs=0: the prompt token alone
    ref = hf_prompt_logprobs(model_dir, prompt)
    assert_entries_match("n=3", model_dir, prompt, out.prompt_logprobs, ref, llm.tokenizer, top_n=0)


def test_image_prompt_equals_transformers(tiny_engine, tiny_dirs, small_slices):
    """A prompt holding an image: the vision rows and mRoPE positions reach the logits rows too."""
    from qv.model.vision_processor import VisionProcessor

    model_dir = str(tiny_dirs("tiny"))
    llm = tiny_engine(model=model_dir, max_num_batched_tokens=16)
    tok = llm.tokenizer
    rng = np.random.default_rng(3)
    image = rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)
    text = "Look <|vision_start|><|image_pad|><|vision_end|> and tell."
    ids = tok.encode(text, add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": image}},
                       SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP))[0]
    prompt = list(out.prompt_token_ids)
    item = VisionProcessor.from_dir(model_dir).image(image)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert prompt.count(pad) == item.num_tokens > 1
    kinds = torch.tensor([[1 if t == pad else 0 for t in prompt]])
    ref = hf_prompt_logprobs(model_dir, prompt, pixel_values=item.pixel_values.double(),
                             image_grid_thw=torch.tensor([item.grid_thw]), mm_token_type_ids=kinds)
    assert_entries_match("image prompt", model_dir, prompt, out.prompt_logprobs, ref, tok, contexts=False)


def test_bad_values_name_the_field(tiny_engine):
    with pytest.raises(InvalidFieldError, match="prompt_logprobs must be non-negative") as e:
        SamplingParams(prompt_logprobs=-1)
    assert e.value.param == "prompt_logprobs"
    with pytest.raises(InvalidFieldError):
        SamplingParams(prompt_logprobs=True)
    llm = tiny_engine(max_logprobs=4)
    engine: LLMEngine = llm.engine
    with pytest.raises(InvalidFieldError, match="greater than max allowed: 4") as e:
        engine.add_request("r", [1, 2, 3], SamplingParams(prompt_logprobs=5))
    assert e.value.param == "prompt_logprobs" and not engine.has_unfinished_requests()


@pytest.mark.gpu
def test_gpu_triton_graphs_async_equals_transformers(tiny_engine, tiny_dirs, small_slices):
    """On the GPU: Triton kernels, decode graphs, async steps and the pinned-memory copy of each
    step's rows (its own CUDA event) give transformers' values."""
    model_dir = str(tiny_dirs("tiny"))
    rng = random.Random(9)
    prompts = [[rng.randrange(300) for _ in range(n)] for n in (97, 40, 3)]
    llm = tiny_engine(model=model_dir, device="cuda", kernels="triton", dtype="float32", kv_cache_bytes=256 << 20,
                      max_num_batched_tokens=16, async_scheduling=True)
    assert llm.engine.runner.graphs is not None
    outs = _run(llm, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=TOP))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_entries_match(f"gpu prompt {i}", model_dir, prompt, out.prompt_logprobs,
                             hf_prompt_logprobs(model_dir, prompt), llm.tokenizer)
