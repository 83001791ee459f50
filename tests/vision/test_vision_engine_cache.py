"""The engine's handling of media over a request's life: items encoded when a chunk first needs
them and freed once every sequence of the request has prefilled their pads (shared by n samples),
prefix-cache keys that tell same-sized images apart, and MTP drafts on mRoPE positions."""

from __future__ import annotations

import gc
import weakref

import torch
from vision_cases import BARE_VID, IMG, VID, chat, generate_cases, image

from util import assert_close

from qv import LLM, SamplingParams
from qv.model.batch import build_step_batch
from qv.model.cache import allocate_cache

CASES = {c["name"]: c for c in generate_cases()}


def build(llm: LLM, case: dict):
    text = case["text"].replace(BARE_VID, VID)
    return llm.engine.multimodal.from_data(llm.tokenizer.encode(text, add_special_tokens=False),
                                           case.get("images", []), case.get("videos", []))


def test_encoded_on_first_need_and_freed_after_prefill(tiny_engine, vision_dir):
    """Chunks of 16 through 3 images, two samples: an item is encoded in the step whose chunk first
    reaches it, once for both samples, kept while either sample still has its pads to prefill,
    and nothing is left after prefill."""
    llm = tiny_engine(model=vision_dir, max_num_batched_tokens=16)
    eng = llm.engine
    mp = build(llm, CASES["gen-3"])
    eng.add_request("r", mp.token_ids, SamplingParams(n=2, temperature=0, max_tokens=3), multimodal=mp)
    seqs = list(eng.scheduler.waiting)
    ms = eng.media.states[seqs[0]]
    assert ms is eng.media.states[seqs[1]] and len(ms.seqs) == 2
    reached: set[int] = set()
    while eng.has_unfinished_requests():
        before = [s.num_computed_tokens for s in seqs]
        encoded_before = eng.media.stats.items_encoded
        eng.step()
        after = [s.num_computed_tokens for s in seqs]
        now = set()
        for b, a in zip(before, after):
            now |= set(mp.items_in(b, min(a, len(mp))))
        assert eng.media.stats.items_encoded - encoded_before == len(now - reached), (before, after)
        reached |= now
        low = min(a for a, s in zip(after, seqs) if not s.finished) if not all(s.finished for s in seqs) else len(mp)
        assert set(ms.encoded) == {i for i in reached if mp.item_span[i][1] > low}, (after, set(ms.encoded))
    assert reached == {0, 1, 2} and eng.media.stats.items_encoded == 3 and not ms.encoded


def test_media_state_goes_with_its_sequences(tiny_engine, vision_dir):
    """The vision steps keep a request's MediaState per sequence, weakly: once its sequences are gone (the request
    finished, a later step ran) nothing of it is left, and a text step again may replay a graph."""
    llm = tiny_engine(model=vision_dir)
    eng = llm.engine
    mp = build(llm, CASES["gen-3"])
    eng.add_request("r", mp.token_ids, SamplingParams(n=2, temperature=0, max_tokens=2), multimodal=mp)
    seqs = list(eng.scheduler.waiting)
    assert len(eng.media.states) == 2 and not eng.media.replayable(seqs, True)
    gone = weakref.ref(eng.media.states[seqs[0]])
    while eng.has_unfinished_requests():
        eng.step()
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=2))  # a later step
    del seqs
    gc.collect()
    assert not eng.media.states and gone() is None and eng.media.replayable(list(eng.scheduler.running), True)


def _prompt(images):
    return {"prompt": chat(f"Look {IMG} and {IMG} then {IMG} now. Which one is red?"),
            "multi_modal_data": {"image": images}}


def _same(name, a, b, tol=1e-4):
    x, y = a.outputs[0], b.outputs[0]
    assert x.token_ids == y.token_ids, name
    errs = [abs(p[t].logprob - q[t].logprob) for t, p, q in zip(x.token_ids, x.logprobs, y.logprobs)]
    assert max(errs) < tol, (name, errs)


def test_prefix_cache_keys_include_media(tiny_engine, vision_dir):
    """Three same-sized images; a repeat reuses the prefix past them, a request whose third image
    has other pixels (identical token ids) reuses only blocks before that image's first pad, and
    every output equals the same request on an engine without prefix caching."""
    imgs = [image(200 + k, 64, 64) for k in range(3)]
    other = imgs[:2] + [image(299, 64, 64)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    cached = tiny_engine(model=vision_dir, block_size=16, gdn_snapshot_interval=16)
    a1, a2, b = (cached.generate(_prompt(x), params)[0] for x in (imgs, imgs, other))
    fa, fb = tiny_engine(model=vision_dir, prefix_caching=False).generate([_prompt(imgs), _prompt(other)], params)
    mp = cached.engine.multimodal.from_data(cached.tokenizer.encode(_prompt(imgs)["prompt"], add_special_tokens=False),
                                            imgs)
    third = mp.item_span[2][0]
    assert a1.prompt_token_ids == b.prompt_token_ids == mp.token_ids  # the pads cannot tell them apart
    assert a1.num_cached_tokens == 0
    assert a2.num_cached_tokens > mp.item_span[2][1], (a2.num_cached_tokens, mp.item_span)
    assert 0 < b.num_cached_tokens <= third, (b.num_cached_tokens, third)
    print(f"prompt {len(mp)} tokens, third image pads {mp.item_span[2]}: cached {a2.num_cached_tokens} on the repeat, "
          f"{b.num_cached_tokens} with the third image changed")
    _same("repeat", a2, fa)
    _same("first", a1, fa)
    _same("third image changed", b, fb)
    lp = lambda o: torch.tensor([e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])  # noqa
    assert fa.outputs[0].token_ids != fb.outputs[0].token_ids or (lp(fa) - lp(fb)).abs().max() > 1e-3


def _reference_drafts(eng, mp, k: int) -> tuple[int, list[torch.Tensor]]:
    """The first sampled token and the MTP head's output states after it (one per draft), in one piece: the target over
    the whole prompt (mRoPE positions, vision rows), the head over every prompt row at the same
    positions, then k-1 single steps at index + rope_delta."""
    text, head, tower, cfg = eng.runner.model, eng.spec.head, eng.media.tower, eng.model_config
    t, bs = len(mp), 16
    table = list(range((t + k) // bs + 2))
    cache = allocate_cache(cfg, len(table), bs, 1, torch.float32, torch.float32, torch.float32, "cpu",
                           extra_attention_layers=(cfg.num_hidden_layers,))
    encoded = {i: tower(it.pixel_values, [it.grid_thw]) for i, it in enumerate(mp.items)}
    ids = torch.tensor(mp.token_ids)
    pos = mp.positions_for(0, t)
    batch = build_step_batch([t], [t], [table], [0], bs)
    h = text.forward(ids, pos, batch, cache, inputs_embeds=mp.embed_chunk(text.embed, ids, 0, encoded))
    first = int(text.compute_logits(h[t - 1:])[0, :cfg.vocab_size].argmax())
    state = head.forward(torch.tensor(mp.token_ids[1:] + [first]), h, pos, batch, cache)[t - 1:]
    states = [state]
    for s in range(1, k):
        step = build_step_batch([1], [t + s], [table], [0], bs)
        state = head.forward(type(head).draft_ids(head, state), state, torch.tensor([t - 1 + s + mp.rope_delta]), step,
                             cache)
        states.append(state)
    return first, states


def test_mtp_drafts_on_mrope_positions(tiny_engine):
    """Prefill in chunks of 16 with MTP speculation: the head's states behind the drafts the engine
    proposes after the prompt equal the one-piece computation on mRoPE positions (prompt rows) and
    index + delta (draft steps), for images, a video and both."""
    llm = tiny_engine(mtp=True, spec="mtp", spec_k=3, max_num_batched_tokens=16)
    eng = llm.engine
    head, seen = eng.spec.head, []
    draft_ids = head.draft_ids
    head.draft_ids = lambda out: (seen.append(out.clone()), draft_ids(out))[1]  # records, changes nothing
    for name in ("gen-3", "gen-video", "gen-mixed", "gen-20"):
        mp = build(llm, CASES[name])
        eng.add_request(name, mp.token_ids, SamplingParams(temperature=0, max_tokens=8), multimodal=mp)
        seq = eng.scheduler.waiting[-1]
        while not seq.output_token_ids:
            seen.clear()
            eng.step()
        first, states = _reference_drafts(eng, mp, 3)
        assert seq.output_token_ids[0] == first and len(seen) == 3 and len(seq.drafts.tokens) == 3
        errs = [assert_close(f"{name} MTP state {j}", got, want, 1e-4) for j, (got, want) in enumerate(zip(seen, states))]
        print(f"{name}: MTP state rel errors {[f'{e:.1e}' for e in errs]}")
        while eng.has_unfinished_requests():
            eng.step()
