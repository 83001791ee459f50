"""SystemOne answers from per-option probabilities, formatted exactly as Clef's `systemone()`
(`systemone_answer`): 4-decimal rounding, choice options and score levels in the order the
request listed them (not the encoded order), the same keys in the same order."""

from __future__ import annotations

from typing import Any

from qv.clef.encode import EncodedQuestion, EncodedRecord


def answer(question: EncodedQuestion, probabilities: dict[str, float]) -> dict[str, Any]:
    """One question's answer from {option id: probability}."""
    if question.type_name == "noul":
        return {"type": "noul", "noul": round(probabilities["true"], 4)}
    if question.type_name == "choice":
        options = [str(option) for option in question.criteria]
        choice = max(options, key=probabilities.__getitem__)  # first of equal maxima, in request order
        return {
            "type": "choice",
            "choice": choice,
            "confidence": round(probabilities[choice], 4),
            "probabilities": {option: round(probabilities[option], 4) for option in options},
        }
    levels = [str(index) for index in range(len(question.criteria))]
    return {
        "type": "score",
        "score": round(sum(index * probabilities[level] for index, level in enumerate(levels)), 4),
        "confidence": round(max(probabilities[level] for level in levels), 4),
        "legend": dict(zip(levels, question.criteria)),
        "probabilities": {level: round(probabilities[level], 4) for level in levels},
    }


def answers(record: EncodedRecord, probabilities: list[list[float]]) -> dict[str, dict[str, Any]]:
    """{question id: answer} in question order; probabilities[i] follows record.questions[i].option_ids."""
    if len(probabilities) != len(record.questions):
        raise ValueError(f"{len(probabilities)} probability lists for {len(record.questions)} questions")
    return {q.question_id: answer(q, dict(zip(q.option_ids, p))) for q, p in zip(record.questions, probabilities)}


def response(model: str, record: EncodedRecord, probabilities: list[list[float]]) -> dict[str, Any]:
    """The whole systemone response body (Clef reports 0 output tokens: a record is one prefill)."""
    return {"model": model, "answers": answers(record, probabilities),
            "usage": {"input_tokens": record.num_tokens, "output_tokens": 0}}
