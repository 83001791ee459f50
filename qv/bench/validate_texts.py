"""The built-in inputs of `qv validate`: prompts for the reference comparison, natural-text passages
for MTP acceptance, the filler and the planted code word and facts of the retrieval gates, and Clef
records. Plain data and the prompt builders; the gates are in qv/bench/validate.py."""

from __future__ import annotations

import random
from dataclasses import dataclass

REFERENCE_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Translate to German: The weather is nice today, so we will walk to the market.",
    "List three prime numbers greater than 100, separated by commas:",
)
IMAGE_PROMPT = "<|vision_start|><|image_pad|><|vision_end|>Describe this picture in one sentence."


def sample_image(seed: int):
    """A 96x128 picture of soft gradients and a few seeded blocks (PIL), the same for every run."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:96, 0:128]
    pixels = np.stack([x * 2, y * 2, (x + y)], axis=-1).astype(np.uint8)
    for _ in range(4):
        r, c = rng.integers(0, 80), rng.integers(0, 110)
        pixels[r:r + 16, c:c + 18] = rng.integers(0, 256, 3)
    return Image.fromarray(pixels, "RGB")


# natural prose for MTP acceptance (the original measured 3.6-3.8 tokens a step on natural text)
PASSAGES = (
    "The lighthouse stood at the end of a narrow spit of rock, and for most of the year the only people who "
    "walked out to it were the keeper and the boy who brought his groceries on Thursdays. In winter the waves "
    "climbed the rocks and broke against the lower windows, and the keeper would sit by the stove and read",
    "To bake a simple loaf of bread, mix five hundred grams of flour with ten grams of salt and seven grams of "
    "dried yeast. Add three hundred and fifty millilitres of warm water and stir until no dry flour remains. "
    "Knead the dough on a floured surface for about ten minutes, until it is smooth and springs back when",
    "The committee met on Tuesday to review the budget for the coming year. The chair opened the meeting by "
    "thanking the members for their work on the previous report, and then asked the treasurer to summarise "
    "the main changes. The treasurer explained that the cost of maintaining the building had risen sharply",
    "Rivers shape the land they cross. Over thousands of years a river carves a valley, carries sand and stone "
    "downstream, and drops them where the current slows, building plains and deltas. People have always "
    "settled near rivers, because they provide water for drinking and farming, fish to eat, and a road for",
)

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
          "The river flows past the old mill, and the wind moves through the trees. ")
MAX_RETRIEVAL_TOKENS = 243_173  # the original's longest code-word prompt
FACT_DEPTHS = (0.05, 0.50, 0.95)
FACT_NAMES = ("blue", "green", "amber")


@dataclass(frozen=True)
class Probe:
    """A long prompt with something planted in it and the text the greedy answer must hold verbatim."""

    name: str
    prompt_ids: list[int]
    expected: str


def code_word(seed: int) -> str:
    return str(random.Random(seed).randint(10_000, 99_999))


def _filler_ids(tokenizer, n: int) -> list[int]:
    unit = tokenizer.encode(FILLER, add_special_tokens=False)
    return (unit * (n // len(unit) + 1))[:n]


def code_word_probe(tokenizer, total_tokens: int, word: str) -> Probe:
    """The code word at the start, filler to `total_tokens`, then the question, in the passkey
    retrieval form (a completion: any model, base or instruct, continues it with the word)."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    head = enc(f"There is a code word hidden in this text. The code word is {word}. Remember it. ")
    tail = enc(" What is the code word? The code word is")
    filler = _filler_ids(tokenizer, max(0, total_tokens - len(head) - len(tail)))
    return Probe("code word", head + filler + tail, word)


def fact_probes(tokenizer, total_tokens: int, seed: int) -> list[Probe]:
    """Facts planted at 5 / 50 / 95 % of a filler prompt; one question each after it."""
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    rng = random.Random(seed + 1)
    facts = [(name, str(rng.randint(100, 999))) for name in FACT_NAMES]
    planted = [enc(f" The {name} number is {value}. ") for name, value in facts]
    tails = [enc(f" What is the {name} number? The {name} number is") for name, _ in facts]
    body_len = max(0, total_tokens - sum(map(len, planted)) - max(map(len, tails)))
    body = _filler_ids(tokenizer, body_len)
    for depth, ids in sorted(zip(FACT_DEPTHS, planted), reverse=True):  # deepest first: earlier offsets hold
        at = int(depth * len(body))
        body[at:at] = ids
    return [Probe(f"{name} number at {int(100 * depth)}%", body + tail, value)
            for (name, value), depth, tail in zip(facts, FACT_DEPTHS, tails)]


CLEF_RECORDS = (
    {"model": "clef", "state": "Our checkout started returning errors and orders are blocked.",
     "questions": {"outage": {"type": "noul", "instructions": "Is a service down?"},
                   "urgency": {"type": "score", "criteria": ["Can wait", "This week", "Today"]},
                   "team": {"type": "choice", "instructions": "Which team should take it?",
                            "criteria": {"billing": "money matters", "tech": None, "ops": ["outages", "latency"]}}}},
    {"model": "clef", "state": {"ticket": 4821, "customer": "A. Rivera", "text": "I was charged twice for one order.",
                                "tags": ["billing", "refund"]},
     "questions": {"refund": {"type": "noul", "instructions": "Should we refund?"},
                   "tone": {"type": "choice", "criteria": {"calm": None, "annoyed": None, "angry": None}}}},
    {"model": "clef", "state": "Login page loads slowly in the evening for some users in Europe. " * 20,
     "questions": {"severity": {"type": "score", "instructions": "How severe?",
                                "criteria": ["cosmetic", "minor", "major", "critical"]}}},
)
