"""Finding tag markers in text that is still growing (streamed model output).

Both parsers define their result on the *whole* output and stream by re-parsing the text seen so
far, emitting only what no later text can change. `scan` is the one primitive that makes this
safe: it reports the earliest complete marker and, while the text may still grow, where a marker
could still begin (a proper prefix of a marker at the end of the text). Nothing at or after that
point is decided yet.
"""

from __future__ import annotations


def scan(text: str, markers: tuple[str, ...], start: int = 0, final: bool = True) -> tuple[int, str | None, int]:
    """Return (pos, marker, hold).

    pos, marker: the earliest complete occurrence of any marker at or after `start` that no later
    text can pre-empt, else (-1, None). hold: where undecided text begins (len(text) when final,
    or when no marker prefix ends the text). When a partial marker starts before the earliest
    complete one, that occurrence is not yet decided and (-1, None, hold) comes back.
    """
    best, best_marker = -1, None
    for m in markers:
        i = text.find(m, start)
        if i != -1 and (best == -1 or i < best):
            best, best_marker = i, m
    hold = len(text)
    if not final:
        longest = max(len(m) for m in markers)
        for u in range(max(start, len(text) - longest + 1), len(text)):
            tail = text[u:]
            if any(len(tail) < len(m) and m.startswith(tail) for m in markers):
                hold = u
                break
    if best != -1 and best < hold:
        return best, best_marker, hold
    return -1, None, hold
