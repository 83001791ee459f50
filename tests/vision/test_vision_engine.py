"""The engine with images and videos: greedy tokens and logprobs of qv.LLM against transformers'
Qwen3_5ForConditionalGeneration on the tiny folder (1, 3 and 20 images, a video, both kinds), in
batches that mix text-only and multimodal prompts, whole, with prefill chunks cutting through
images and video frames, and under a vision budget that spreads encoding over many steps."""

from __future__ import annotations

import pytest
import torch
from vision_cases import BARE_VID, VID, chat, generate_cases, hf_inputs

from qv import LLM, SamplingParams

NEW = 8
LOGPROB_TOL = 1e-4  # |qv logprob - transformers float64 logprob| of each generated token
TIE = 1e-4  # a divergence where transformers' top two logits are this close is a numerical tie
MM_CASES = {c["name"]: c for c in generate_cases()}
MM_NAMES = ["gen-1", "gen-3", "gen-20", "gen-video", "gen-mixed"]
TEXTS = {"text-short": chat("Tell me about the sea."), "text-long": chat(" ".join(f"w{k}" for k in range(90)))}


def engine_prompt(case: dict) -> dict:
    """vLLM's offline form: the prompt with one placeholder per item, the media beside it."""
    return {"prompt": case["text"].replace(BARE_VID, VID),
            "multi_modal_data": {"image": case.get("images", []), "video": case.get("videos", [])}}


def hf_reference(hf_model, hf_model_fp32, inputs: dict) -> tuple[list[int], list[float], list[float]]:
    """(greedy tokens of transformers' fp32 generate, float64 logprob of each, top-1 minus top-2
    float64 logit margin at each step)."""
    t = inputs["input_ids"].shape[1]
    with torch.no_grad():
        tokens = hf_model_fp32.generate(**inputs, do_sample=False, max_new_tokens=NEW)[0, t:].tolist()
        fed = torch.tensor([tokens[:-1]])
        long = dict(inputs, input_ids=torch.cat([inputs["input_ids"], fed], 1),
                    attention_mask=torch.ones(1, t + fed.shape[1], dtype=torch.long))
        if "mm_token_type_ids" in inputs:
            long["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(fed)], 1)
        logits = hf_model(**long).logits[0, t - 1:].double()
    lps = torch.log_softmax(logits, -1)
    top2 = logits.topk(2, dim=-1).values
    return tokens, [float(lps[i, tok]) for i, tok in enumerate(tokens)], (top2[:, 0] - top2[:, 1]).tolist()


@pytest.fixture(scope="module")
def refs(hf_processed, hf_model, hf_model_fp32, tokenizer) -> dict:
    out = {name: hf_reference(hf_model, hf_model_fp32, hf_inputs(hf_processed[name])) for name in MM_NAMES}
    for name, text in TEXTS.items():
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        out[name] = hf_reference(hf_model, hf_model_fp32, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return out


def check(name: str, out, ref) -> float:
    """Same greedy tokens (up to a numerical tie) and logprobs; returns the largest logprob error."""
    tokens, lps, margins = ref
    comp = out.outputs[0]
    worst = 0.0
    for i, (a, b) in enumerate(zip(comp.token_ids, tokens)):
        if a != b:
            assert margins[i] < TIE, f"{name}: token {i}: qv {a} != transformers {b} (margin {margins[i]:.2e})"
            return worst
        err = abs(comp.logprobs[i][a].logprob - lps[i])
        assert err < LOGPROB_TOL, f"{name}: token {i} logprob off by {err:.2e}"
        worst = max(worst, err)
    assert len(comp.token_ids) == len(tokens), f"{name}: {len(comp.token_ids)} tokens, transformers {len(tokens)}"
    return worst


def run(tiny_engine, vision_dir, names: list[str], **levers):
    llm = tiny_engine(model=vision_dir, **levers)
    prompts = [engine_prompt(MM_CASES[n]) if n in MM_CASES else {"prompt": TEXTS[n]} for n in names]
    return llm, llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, logprobs=0))


MIXED = ["text-short", "gen-1", "gen-3", "text-long", "gen-20", "gen-video", "gen-mixed"]


@pytest.mark.parametrize("levers", [
    dict(),  # one prefill step for everything, one tower call for all 28 items
    dict(max_num_batched_tokens=16, max_num_seqs=8),  # chunks cut through images and video frames
    dict(max_num_batched_tokens=96, vision_max_patches_per_step=40),  # encoding spread over many steps
], ids=["whole", "chunk16", "budget40"])
def test_engine_equals_hf(tiny_engine, levers, vision_dir, refs, hf_processed):
    """Text-only and multimodal prompts batched together: every prompt's tokens and logprobs equal
    transformers', the expanded prompt equals HF's processor, each item is encoded exactly once and
    no step encodes past the budget (unless one item alone is larger)."""
    llm, outs = run(tiny_engine, vision_dir, MIXED, **levers)
    worst = 0.0
    for name, out in zip(MIXED, outs):
        if name in MM_CASES:
            assert out.prompt_token_ids == hf_processed[name]["input_ids"][0].tolist(), name
        worst = max(worst, check(f"{name} {levers}", out, refs[name]))
    st = llm.engine.media.stats
    items = [it for n in MIXED if n in MM_CASES for it in _items(llm, n)]
    assert st.items_encoded == len(items) == 28
    budget = levers.get("vision_max_patches_per_step", llm.config.vision_max_patches_per_step)
    assert st.max_patches_in_step <= max(budget, max(it.pixel_values.shape[0] for it in items))
    if "vision_max_patches_per_step" in levers:
        assert st.steps_with_encoding >= sum(it.pixel_values.shape[0] for it in items) // budget
    print(f"{levers}: max logprob error {worst:.2e}; {st}")


def test_preemption_reencodes(tiny_engine, vision_dir, refs):
    """A KV cache of 12 blocks of 16 for prompts of 76, 93 and 46 tokens (+8 each): two are admitted,
    their decode growth preempts one (recompute), its freed encodings are encoded again on
    readmission, and every output still equals transformers'."""
    from qv.config import ModelConfig
    from qv.model.cache import kv_bytes_per_block

    names = ["gen-3", "gen-mixed", "gen-1"]
    budget = 12 * kv_bytes_per_block(ModelConfig.from_dir(vision_dir), 16, torch.float32)
    llm, outs = run(tiny_engine, vision_dir, names, block_size=16, kv_cache_bytes=budget, prefix_caching=False,
                    max_num_batched_tokens=64)
    for name, out in zip(names, outs):
        check(f"{name} preempted", out, refs[name])
    st = llm.engine.media.stats
    assert llm.engine.stats.num_preemptions > 0 and st.items_encoded > 7, (llm.engine.stats, st)
    print(f"{llm.engine.stats.num_preemptions} preemptions, {st.items_encoded} item encodings for 7 items")


def _items(llm, name):
    return llm.engine.multimodal.from_data(llm.tokenizer.encode(engine_prompt(MM_CASES[name])["prompt"], add_special_tokens=False),
                                           MM_CASES[name].get("images", []), MM_CASES[name].get("videos", [])).items


def test_wrong_media_is_caught(tiny_engine, vision_dir, refs):
    """Control: the same prompts with their images reversed (same placeholders, other pixels)
    miss transformers' logprobs by far more than the tolerance, so the checks above can fail."""
    case = dict(MM_CASES["gen-3"], images=MM_CASES["gen-3"]["images"][::-1])
    llm = tiny_engine(model=vision_dir)
    out = llm.generate(engine_prompt(case), SamplingParams(temperature=0, max_tokens=NEW, logprobs=0))[0]
    tokens, lps, _ = refs["gen-3"]
    comp = out.outputs[0]
    n = next((i for i, (a, b) in enumerate(zip(comp.token_ids, tokens)) if a != b), len(tokens))
    errs = [abs(comp.logprobs[i][comp.token_ids[i]].logprob - lps[i]) for i in range(n)]
    assert n < len(tokens) or max(errs) > 100 * LOGPROB_TOL, errs
    print(f"images reversed: tokens equal for {n} of {len(tokens)}, max logprob error {max(errs, default=0):.2e}")


def test_mtp_speculation_equals_hf(tiny_engine, tiny_dirs, vision_dir, refs):
    """MTP speculation over multimodal and text rows (drafts verified on mRoPE positions): the same
    tokens and logprobs as transformers. The MTP folder shares every base tensor with the tiny one."""
    from safetensors.torch import load_file

    mtp_dir = tiny_dirs("tiny", mtp=True)
    base, with_mtp = load_file(str(vision_dir / "model.safetensors")), load_file(str(mtp_dir / "model.safetensors"))
    assert all(torch.equal(v, with_mtp[k]) for k, v in base.items())
    names = ["gen-3", "text-short", "gen-video", "gen-mixed"]
    llm, outs = run(tiny_engine, mtp_dir, names, spec="mtp", spec_k=2, max_num_batched_tokens=32)
    worst = max(check(f"{name} spec=mtp", out, refs[name]) for name, out in zip(names, outs))
    st = llm.engine.spec.stats
    assert st.num_drafts > 0
    print(f"spec=mtp: max logprob error {worst:.2e}, {st.num_drafts} drafts, mean acceptance {st.mean_acceptance_length:.2f}")
