"""A Clef record -> token ids + question spans + option spans, token for token what Cloudflare's
`encode_record` (joint_schema_model.py) produces: same template text, same option order (noul
true/false, choice sorted by id, score by index), same silent truncation of the state.

The template is re-stated here (qv cannot depend on the test-only clef-finetune package); the
tests compare every field against `encode_record` itself. All template pieces of a record are
tokenized in one batched tokenizer call, which gives the same ids as one call per piece (each
piece is tokenized on its own either way) without ~5 Python round trips per option.

The state is tokenized last, and only as far as the record has room: a prefix of its text long
enough to hold the tokens that fit (`truncated_ids`), so a 10 MB state costs what its first
max_length tokens cost, with the ids tokenizing the whole state would give.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SYSTEM_PROMPT = (
    "Read the complete state and schema. Decide every field jointly. Each answer "
    "must be exactly one of that field's allowed options."
)
PREFIX = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\nSTATE:\n"
SUFFIX = "\n<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nJOINT SCHEMA DECISIONS:"
SCHEMA_HEADER = "\n\nSCHEMA FIELDS:\n"
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
QUESTION_TYPES = {"noul": 0, "choice": 1, "score": 2}
NOUL_CRITERIA = {
    "true": "The proposition is true or the answer is yes.",
    "false": "The proposition is false or the answer is no.",
}
DEFAULT_MAX_LENGTH = 16384  # Clef's own default record length
STATE_CHARS_PER_TOKEN = 6  # first guess at the characters a state token covers; the cut doubles while short
STABLE_MARGIN = 64  # characters a kept token must end before the cut, out of reach of what the cut changes
WORD_END = re.compile(r"\S\s")  # a cut after a word and before whitespace leaves every pre-token whole
WORD_END_WINDOW = 4096

Tokenize = Callable[[list[str]], list[list[int]]]
OffsetTokenize = Callable[[str], tuple[list[int], list[int]]]  # text -> ids, end character of each


def render(value: Any) -> str:
    """Strings as they are, anything else as compact sorted JSON (Clef's `render`)."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)


def question_options(question: dict[str, Any]) -> list[tuple[str, Any]]:
    """(option id, description) in the order the record lists them."""
    kind = str(question["type"])
    if kind == "noul":
        criteria = dict(NOUL_CRITERIA)
        criteria.update(question.get("criteria") or {})
        return [(key, criteria[key]) for key in ("true", "false")]
    if kind == "choice":
        return sorted((str(key), value) for key, value in question["criteria"].items())
    return [(str(index), value) for index, value in enumerate(question["criteria"])]


@dataclass(frozen=True)
class EncodedQuestion:
    question_id: str
    question_type: int  # 0 noul, 1 choice, 2 score
    question_span: tuple[int, int]  # [start, end) of the instruction tokens in input_ids
    option_spans: tuple[tuple[int, int], ...]  # [start, end) of each option's JSON tokens
    option_ids: tuple[str, ...]  # encoded order (choice: sorted)
    type_name: str = field(default="", compare=False)
    criteria: Any = field(default=None, compare=False, repr=False)  # as the request gave it (answer order, legend)


@dataclass(frozen=True)
class EncodedRecord:
    input_ids: tuple[int, ...]
    questions: tuple[EncodedQuestion, ...]
    record_id: str = "unknown"
    state_tokens: int = 0  # state tokens kept
    state_truncated: bool = False  # the length limit cut the state
    media_offset: int = 0  # where the images' tokens start (right after the prefix), when there are any
    media_tokens: int = 0  # how many tokens they take (placeholders expanded, the newline after them)
    # the images as the engine takes them: a qv.model.vision_prompt.MultimodalPrompt over input_ids
    multimodal: Any = field(default=None, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_options(self) -> int:
        return sum(len(q.option_ids) for q in self.questions)

    @property
    def checksum(self) -> str:
        """Identity of the token sequence, so the worker can refuse a record that is not the one
        the endpoint encoded (length + checksum). See `TokenChecksum` for the streamed form."""
        c = TokenChecksum()
        c.update(self.input_ids)
        return c.hexdigest()


class TokenChecksum:
    """sha256 over the token ids as little-endian int64, fed in any number of pieces: the engine
    hashes each chunk it runs and gets the checksum of the whole record without keeping it."""

    def __init__(self):
        self._h = hashlib.sha256()
        self.num_tokens = 0

    def update(self, ids: Sequence[int] | np.ndarray) -> None:
        arr = np.asarray(ids, dtype="<i8")
        self._h.update(arr.tobytes())
        self.num_tokens += arr.size

    def hexdigest(self) -> str:
        return self._h.hexdigest()[:32]


class SchemaTooLong(ValueError):
    """The template, images and schema alone exceed max_length (carries the counts)."""

    def __init__(self, fixed: int, max_length: int, schema: int, media: int = 0):
        self.fixed, self.max_length, self.schema, self.media = fixed, max_length, schema, media
        super().__init__(f"schema requires {fixed} tokens before state; maximum is {max_length}")


def batch_tokenizer(tokenizer: Any) -> Tokenize:
    """A list-of-texts -> list-of-ids function for a transformers tokenizer (called like Clef
    calls it: `add_special_tokens=False`) or a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return lambda texts: [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return lambda texts: list(tokenizer(texts, add_special_tokens=False).input_ids) if texts else []


def offsets_tokenizer(tokenizer: Any) -> OffsetTokenize | None:
    """text -> (ids, end character offset of each id) for a fast transformers tokenizer or a
    `tokenizers.Tokenizer`; None for tokenizers without offsets (the state is then tokenized whole)."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        def encode(text: str):
            e = tokenizer.encode(text, add_special_tokens=False)
            return e.ids, [end for _, end in e.offsets]
        return encode
    if not getattr(tokenizer, "is_fast", False):
        return None

    def encode_fast(text: str):
        e = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(e.input_ids), [end for _, end in e.offset_mapping]
    return encode_fast


def truncated_ids(text: str, budget: int, tokenize: Tokenize, offsets: OffsetTokenize | None) -> tuple[list[int], bool]:
    """The first `budget` ids of `text`, as tokenizing all of it gives them, and whether it has more.

    Only a prefix is tokenized: cut after a word (every pre-token before the cut is then whole,
    as in the full text), and long enough that the last kept token ends STABLE_MARGIN characters
    before the cut; a cut that holds too few tokens doubles. So the work is bounded by what
    `budget` tokens can hold, not by the length of the state."""
    if budget <= 0:
        return [], bool(text)
    cut = budget * STATE_CHARS_PER_TOKEN + STABLE_MARGIN
    while offsets is not None and cut < len(text):
        word_end = WORD_END.search(text, cut - 1, cut + WORD_END_WINDOW)
        if word_end is not None:
            cut = word_end.start() + 1
        ids, ends = offsets(text[:cut])
        if len(ids) > budget and ends[budget - 1] + STABLE_MARGIN <= cut:
            return list(ids[:budget]), True
        cut *= 2
    ids = tokenize([text])[0]
    return list(ids[:budget]), len(ids) > budget


class _Pieces:
    """Texts to tokenize in one batch; each `add` returns the index of its ids."""

    def __init__(self):
        self.texts: list[str] = []

    def add(self, text: str) -> int:
        self.texts.append(text)
        return len(self.texts) - 1


def _schema_plan(questions: dict[str, Any], pieces: _Pieces) -> list[tuple]:
    """Queue every schema text piece for tokenization; returns where each piece's ids will be:
    ("header", piece) then per question ("question", id, question, head, instructions, allowed,
    [(option id, label, option JSON, newline)], end)."""
    plan = [("header", pieces.add(SCHEMA_HEADER))]
    for index, (qid, question) in enumerate(questions.items()):
        head = pieces.add(f"\nFIELD {index + 1}\nID: {qid}\nTYPE: {question['type']}\nINSTRUCTION: ")
        instructions = question.get("instructions")
        if instructions is None or instructions == "":
            instructions = str(qid)
        body = pieces.add(render(instructions))
        allowed = pieces.add("\nALLOWED OPTIONS:\n")
        options = []
        for option_index, (option_id, description) in enumerate(question_options(question)):
            semantics = {"option_id": option_id}
            if description is not None:
                semantics["description"] = description
            options.append((option_id, pieces.add(f"OPTION {option_index + 1}: "), pieces.add(render(semantics)),
                            pieces.add("\n")))
        plan.append(("question", qid, question, head, body, allowed, options, pieces.add("END FIELD\n")))
    return plan


def _assemble_schema(plan: list[tuple], ids: list[list[int]]) -> tuple[list[int], list[EncodedQuestion]]:
    schema = list(ids[plan[0][1]])
    out: list[EncodedQuestion] = []
    for _, qid, question, head, body, allowed, options, end in plan[1:]:
        schema += ids[head]
        q_start = len(schema)
        schema += ids[body]
        q_end = len(schema)
        schema += ids[allowed]
        spans, option_ids = [], []
        for option_id, label, sem, newline in options:
            schema += ids[label]
            start = len(schema)
            schema += ids[sem]
            spans.append((start, len(schema)))
            option_ids.append(option_id)
            schema += ids[newline]
        schema += ids[end]
        out.append(EncodedQuestion(str(qid), QUESTION_TYPES[str(question["type"])], (q_start, q_end), tuple(spans),
                                   tuple(option_ids), str(question["type"]), question.get("criteria")))
    return schema, out


def media_text(num_images: int) -> str:
    """The text Clef's processor call tokenizes for a record's images: one placeholder per image,
    then a newline; its tokens go right after the prefix ("...STATE:\n")."""
    return IMAGE_PLACEHOLDER * num_images + "\n"


def encode_record(tokenizer: Any, record: dict[str, Any], max_length: int = DEFAULT_MAX_LENGTH,
                  max_state_tokens: int | None = None, tokenize: Tokenize | None = None,
                  media_ids: Sequence[int] | None = None) -> EncodedRecord:
    """Encode a record exactly like Clef's `encode_record`. No request validation: see
    qv.clef.request for that. A record with images needs `media_ids`: the tokens of
    `media_text(len(images))` with each image placeholder expanded to that image's vision tokens
    (what Clef's processor call returns); they count towards max_length, as in Clef. Videos are
    refused (Clef serves none).

    Raises SchemaTooLong when the template, images and schema alone exceed max_length; the state
    is cut to what fits, silently, as in Clef.
    """
    if record.get("videos"):
        raise ValueError("records with videos are not supported")
    if record.get("images") and media_ids is None:
        raise ValueError("a record with images needs media_ids (its image placeholders expanded; see media_text)")
    tokenize = tokenize or batch_tokenizer(tokenizer)
    pieces = _Pieces()
    plan = _schema_plan(record["questions"], pieces)
    prefix, suffix = pieces.add(PREFIX), pieces.add(SUFFIX)
    ids = tokenize(pieces.texts)
    schema_ids, questions = _assemble_schema(plan, ids)
    prefix_ids, suffix_ids = ids[prefix], ids[suffix]
    media_offset, media = len(prefix_ids), list(media_ids or ())
    prefix_ids = prefix_ids + media
    fixed = len(prefix_ids) + len(schema_ids) + len(suffix_ids)
    if fixed > max_length:
        raise SchemaTooLong(fixed, max_length, len(schema_ids), len(media))
    budget = max_length - fixed if max_state_tokens is None else min(max_length - fixed, max_state_tokens)
    state_ids, truncated = truncated_ids(render(record["state"]), budget, tokenize,
                                         offsets_tokenizer(tokenizer) if tokenizer is not None else None)
    offset = len(prefix_ids) + len(state_ids)
    shifted = tuple(
        EncodedQuestion(q.question_id, q.question_type, _shift(q.question_span, offset),
                        tuple(_shift(s, offset) for s in q.option_spans), q.option_ids, q.type_name, q.criteria)
        for q in questions
    )
    input_ids = tuple(prefix_ids + state_ids + schema_ids + suffix_ids)
    if not input_ids or not shifted:
        raise ValueError("record produced no model input or questions")
    return EncodedRecord(input_ids, shifted, str(record.get("id", "unknown")), len(state_ids), truncated,
                         media_offset if media else 0, len(media))


def _shift(span: tuple[int, int], offset: int) -> tuple[int, int]:
    return (span[0] + offset, span[1] + offset)


def all_spans(record: EncodedRecord) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Question spans then option spans (question order, encoded option order), the question of
    each option, and the number of options per question: the layout the joint head works in."""
    spans = [q.question_span for q in record.questions]
    owner: list[int] = []
    counts: list[int] = []
    for i, q in enumerate(record.questions):
        spans.extend(q.option_spans)
        owner.extend([i] * len(q.option_spans))
        counts.append(len(q.option_spans))
    return spans, owner, counts


def option_token_ids(record: EncodedRecord) -> Sequence[Sequence[int]]:
    """The token ids of each option span (encoded order), for the head's lexical vectors."""
    ids = record.input_ids
    return [ids[s:e] for q in record.questions for s, e in q.option_spans]
