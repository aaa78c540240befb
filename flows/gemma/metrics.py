"""Scores of the job's generations, computed on the caller: PubMedQA decision accuracy, chrF (sacrebleu)."""

from __future__ import annotations

from .data import DECISIONS, parse_decision


def decision_accuracy(generations: list[dict], column: str) -> dict:
    """yes/no/maybe parsed from ``column`` ("before"/"after") against ``target``."""
    rows = [g for g in generations if g.get(column) is not None]
    if not rows:
        return {"accuracy": None, "count": 0}
    predicted = [parse_decision(g[column]) for g in rows]
    correct = sum(p == g["target"] for p, g in zip(predicted, rows))
    confusion = {t: {p: 0 for p in (*DECISIONS, "unparsed")} for t in DECISIONS}
    for p, g in zip(predicted, rows):
        confusion[g["target"]][p or "unparsed"] += 1
    return {
        "accuracy": round(correct / len(rows), 4),
        "count": len(rows),
        "correct": correct,
        "unparsed": sum(p is None for p in predicted),
        "confusion": confusion,
    }


def chrf(generations: list[dict], column: str) -> dict:
    """Corpus chrF of ``column`` against every reference of each item (sacrebleu, multi-reference)."""
    import sacrebleu

    rows = [g for g in generations if g.get(column) is not None]
    if not rows:
        return {"chrf": None, "count": 0}
    hypotheses = [g[column] for g in rows]
    width = max(len(g["references"]) for g in rows)
    streams = [[g["references"][k] if k < len(g["references"]) else None for g in rows] for k in range(width)]
    score = sacrebleu.corpus_chrf(hypotheses, streams)
    return {"chrf": round(float(score.score), 2), "count": len(rows), "references_per_item": width}


def evaluate(dataset: str, generations: list[dict]) -> dict:
    if dataset == "pubmedqa":
        before, after = decision_accuracy(generations, "before"), decision_accuracy(generations, "after")
        return {
            "metric": "accuracy",
            "before": before["accuracy"],
            "after": after["accuracy"],
            "details": {"before": before, "after": after},
            "count": after["count"],
        }
    before, after = chrf(generations, "before"), chrf(generations, "after")
    return {
        "metric": "chrF",
        "before": before["chrf"],
        "after": after["chrf"],
        "details": {"before": before, "after": after},
        "count": after["count"],
    }
