"""Token-level packing of chat examples: truncation policy, length statistics, and the too-short check.

Used in two places with the same code: on the caller (with the preset's tokenizer, when it can be loaded there)
to fail before any job is launched, and in the job to build the training and generation arrays.

Policy for one example of ``sequence_length`` L (``<bos>`` + user turn + model turn):

- the prefix (chat header, instruction, question) and the suffix (end of user turn, start of model turn) are
  never cut; if they alone (plus one answer token, or plus ``max_new_tokens`` when generating) do not fit,
  that is a :class:`SequenceLengthError` naming the example and a length that works;
- the body (PubMedQA abstract, the message to rewrite) is cut at its end to make room for the answer;
- the response is cut only when it does not fit even with an empty body (reported).

Only the response tokens carry loss (``response_mask``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .data import length_stats

Tokenize = Callable[[list[str]], list[list[int]]]


class SequenceLengthError(ValueError):
    """sequence_length cannot hold an example's prompt; the message names the example and a length that fits."""


def make_tokenize(tokenizer) -> Tokenize:
    """Wrap a keras-hub tokenizer (batched strings -> ragged ids) as ``list[str] -> list[list[int]]``."""

    def tokenize(texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        out = tokenizer.tokenize(list(texts))
        if hasattr(out, "to_list"):  # tf.RaggedTensor
            return [[int(t) for t in row] for row in out.to_list()]
        return [[int(t) for t in np.asarray(row).tolist()] for row in out]

    return tokenize


@dataclass
class Segments:
    ids: list[str]
    prefix: list[list[int]]
    body: list[list[int]]
    suffix: list[list[int]]
    response: list[list[int]]

    def __len__(self) -> int:
        return len(self.ids)


def segment(examples: Sequence[dict], tokenize: Tokenize, batch: int = 256) -> Segments:
    def run(key: str) -> list[list[int]]:
        values = [e[key] for e in examples]
        unique = sorted(set(values))
        if len(unique) <= 4:  # the suffix: the same string everywhere
            table = dict(zip(unique, tokenize(unique)))
            return [table[v] for v in values]
        out: list[list[int]] = []
        for start in range(0, len(values), batch):
            out.extend(tokenize(values[start : start + batch]))
        return out

    return Segments([str(e["id"]) for e in examples], run("prefix"), run("body"), run("suffix"), run("response"))


def _round_up(value: int, multiple: int = 64) -> int:
    return int(-(-value // multiple) * multiple)


def check_fits(
    seg: Segments, sequence_length: int, *, generate_tokens: int | None = None, what: str = "training"
) -> None:
    """Raise :class:`SequenceLengthError` if some example's fixed prompt part cannot fit."""
    if len(seg) == 0:
        return
    tail = generate_tokens if generate_tokens is not None else 1
    fixed = [1 + len(p) + len(s) for p, s in zip(seg.prefix, seg.suffix)]
    worst = max(range(len(seg)), key=lambda i: fixed[i])
    if fixed[worst] + tail <= sequence_length:
        return
    full = [f + len(b) + len(r) for f, b, r in zip(fixed, seg.body, seg.response)]
    no_body = max(f + (generate_tokens if generate_tokens is not None else len(r)) for f, r in zip(fixed, seg.response))
    p95 = length_stats(full)["p95"]
    needed = f"{fixed[worst]} tokens for the chat template, instruction and question alone (nothing of its body)"
    needed += (
        f", plus max_new_tokens={generate_tokens} to generate"
        if generate_tokens is not None
        else ", plus at least one answer token"
    )
    raise SequenceLengthError(
        f"sequence_length={sequence_length} is too small for the prompt ({what}): example {seg.ids[worst]!r} needs "
        f"{needed}. Use sequence_length >= {_round_up(no_body)} (the longest prompt without its body, with its "
        f"{'generation' if generate_tokens is not None else 'answer'}, needs {no_body}; 95% of the complete "
        f"examples fit in {p95})" + ("" if generate_tokens is None else " or lower max_new_tokens") + "."
    )


@dataclass
class Packed:
    token_ids: np.ndarray  # (N, L) int32
    padding_mask: np.ndarray  # (N, L) bool
    response_mask: np.ndarray  # (N, L) bool: tokens that carry loss (training) / empty (prompts)
    lengths: np.ndarray  # (N,) tokens used
    stats: dict = field(default_factory=dict)


def pack(
    seg: Segments,
    sequence_length: int,
    bos_id: int,
    pad_id: int,
    *,
    generate_tokens: int | None = None,
    what: str = "training",
) -> Packed:
    """Training rows (``generate_tokens=None``: prompt + response) or generation prompts (prompt only, room left
    for ``generate_tokens`` new tokens)."""
    check_fits(seg, sequence_length, generate_tokens=generate_tokens, what=what)
    n, length = len(seg), sequence_length
    token_ids = np.full((n, length), pad_id, dtype="int32")
    padding_mask = np.zeros((n, length), dtype=bool)
    response_mask = np.zeros((n, length), dtype=bool)
    lengths = np.zeros((n,), dtype="int32")
    body_cut = response_cut = dropped = 0
    full_lengths, response_lengths = [], []
    for i in range(n):
        prefix, body, suffix = seg.prefix[i], seg.body[i], seg.suffix[i]
        response = seg.response[i] if generate_tokens is None else []
        reserve = generate_tokens if generate_tokens is not None else 0
        full = 1 + len(prefix) + len(body) + len(suffix) + len(response) + reserve
        full_lengths.append(full - reserve)
        response_lengths.append(len(seg.response[i]))
        room_for_body = length - reserve - (1 + len(prefix) + len(suffix) + len(response))
        if room_for_body < len(body):
            body_cut += 1
            dropped += len(body) - max(room_for_body, 0)
            body = body[: max(room_for_body, 0)]
        row = [bos_id] + prefix + body + suffix
        if generate_tokens is None:
            room = length - len(row)
            if room < len(response):
                response_cut += 1
                dropped += len(response) - room
                response = response[:room]
            response_mask[i, len(row) : len(row) + len(response)] = True
            row = row + response
        token_ids[i, : len(row)] = row
        padding_mask[i, : len(row)] = True
        lengths[i] = len(row)
    stats = {
        "what": what,
        "examples": n,
        "sequence_length": length,
        "full_tokens": length_stats(full_lengths),
        "response_tokens": length_stats(response_lengths),
        "used_tokens": length_stats(lengths.tolist()),
        "body_truncated": body_cut,
        "response_truncated": response_cut,
        "tokens_dropped": int(dropped),
        "fill": round(float(padding_mask.mean()), 4) if n else 0.0,
    }
    if generate_tokens is not None:
        stats["max_new_tokens"] = generate_tokens
    return Packed(token_ids, padding_mask, response_mask, lengths, stats)


def describe(stats: dict) -> str:
    """One log line for a Packed.stats."""
    full, resp = stats["full_tokens"], stats["response_tokens"]
    if not stats["examples"]:
        return f"{stats['what']}: no examples"
    line = (
        f"{stats['what']}: {stats['examples']} examples, sequence_length {stats['sequence_length']}; "
        f"full length median {full['median']} / p95 {full['p95']} / max {full['max']} tokens; "
        f"answers median {resp['median']} / max {resp['max']}; truncated: {stats['body_truncated']} bodies, "
        f"{stats['response_truncated']} answers ({stats['tokens_dropped']} tokens dropped)"
    )
    if "max_new_tokens" in stats:
        line += f"; {stats['max_new_tokens']} new tokens generated at most"
    return line
