"""Incremental detokenization: multi-byte UTF-8 split across byte-level tokens is never shown
half-decoded, and the streamed text always equals a full decode."""

from __future__ import annotations

from transformers import AutoTokenizer

from qv.engine.detokenizer import IncrementalDetokenizer

TEXT = " Привет, мир! こんにちは 😀 café — “quotes” and ünïcödé done"


def test_streamed_text_equals_full_decode(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(str(tiny_dirs("tiny")))
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the fixture must split some characters across tokens"
    prompt = tok.encode("Say:", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    seen = []
    for i in ids:
        d.add_token(i)
        seen.append(d.text)
        assert "\ufffd" not in d.text
        assert TEXT.startswith(d.text)
    assert d.text == TEXT
    assert len(set(seen)) > len(TEXT.split()), "text should grow token by token"


def test_stop_string_split_across_tokens(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(str(tiny_dirs("tiny")))
    ids = tok.encode(TEXT, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["мир!"])
    hit = None
    for i in ids:
        hit = d.add_token(i)
        assert "мир" not in d.visible_text(False)  # a partial stop string is held back while running
        if hit:
            break
    assert hit == "мир!" and d.text == " Привет, "


def test_prompt_ending_inside_a_character_stays_out_of_the_output(tiny_dirs):
    """A token-id prompt may stop mid-character (a client continuing a generation cut inside an
    emoji): those bytes belong to the prompt and never show in the output text."""
    tok = AutoTokenizer.from_pretrained(str(tiny_dirs("tiny")))
    emoji = tok.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1, "the fixture must split the emoji across tokens"
    prompt = tok.encode("Say hi", add_special_tokens=False) + emoji[:1]
    out = tok.encode(" there", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt)
    for i in out:
        d.add_token(i)
    assert d.text == " there"
