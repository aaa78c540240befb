"""Gemma LoRA data: PubMedQA, ParaDetox and user JSONL pairs -> chat-formatted examples.

Pure Python (no Keras): runs on the caller, before any job is launched, so bad input fails early and names
the file, the line and the fix.

Every example is a JSON object with the user turn split in three parts, so that a tokenizer-aware step can
shorten the middle one (the PubMedQA abstract, the message to rewrite) when a sequence is too long:

    prefix    "<start_of_turn>user\\n" + instruction + question ...   kept whole
    body      contexts / the text to transform                       truncated at its end if needed
    suffix    "<end_of_turn>\\n<start_of_turn>model\\n"                kept whole
    response  the model turn, ending with "<end_of_turn>"            the only tokens with loss

plus ``id``, ``target`` (PubMedQA decision, or the reference rewrite), ``references`` (all reference
rewrites, for chrF) and ``input`` (a short human-readable view for the sample table).

Splits. PubMedQA: the official 500-item test split (``test_ground_truth.json``, PMID -> decision) is held out
and only the other 500 labelled items are trained on. ParaDetox and JSONL pairs: a fixed held-out part chosen
by a hash of the input text (stable whatever ``max_examples``/``seed`` are), the rest shuffled with ``seed``.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import random
import re
import shutil
import statistics
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1  # bump when the example layout changes: old cache entries are then ignored

START_USER = "<start_of_turn>user\n"
END_USER = "<end_of_turn>\n<start_of_turn>model\n"
END_TURN = "<end_of_turn>"

DATASETS = ("pubmedqa", "style-transfer")
DECISIONS = ("yes", "no", "maybe")

# Official sources (pinned commits of the upstream repositories). Used when no local path is given.
PUBMEDQA_URLS = {
    "ori_pqal.json": "https://raw.githubusercontent.com/pubmedqa/pubmedqa/1f00b98d5cc626844bf8c4ca513b6e62c40071ec/data/ori_pqal.json",
    "test_ground_truth.json": "https://raw.githubusercontent.com/pubmedqa/pubmedqa/3e7616d288b52edaf38f5fd5c59821c7806bde86/data/test_ground_truth.json",
}
PARADETOX_URL = (
    "https://raw.githubusercontent.com/s-nlp/paradetox/5aeb62cc485bd9077299697dfafba5164ef5abfb/paradetox/paradetox.tsv"
)

PUBMEDQA_INSTRUCTION = (
    "Answer the biomedical research question using the abstract excerpts below. "
    "Start your reply with yes, no or maybe, then explain in one or two sentences.\n\n"
)
STYLE_INSTRUCTION = (
    "Rewrite the following message so that it is polite and free of insults or profanity, "
    "keeping its meaning.\n\nMessage: "
)


class GemmaDataError(ValueError):
    """A problem with the input data; the message names the file (and line) and how to fix it."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


# ------------------------------------------------------------------------------------------- small helpers


def atomic_write_text(dest: Path, text: str) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".kp-tmp.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_cache_dir() -> Path:
    from kinetic_prefect.config import cache_dir

    explicit = os.environ.get("GEMMA_LORA_CACHE_DIR")
    return Path(explicit).expanduser() if explicit else cache_dir() / "gemma-lora"


def chat(prefix_text: str, body: str, response: str | None = None) -> str:
    """The whole conversation in Gemma's chat format (for display and for users' own tools)."""
    text = START_USER + prefix_text + body + END_USER
    return text + (response + END_TURN if response is not None else "")


def _example(
    id_: str, instruction: str, body: str, response: str, target: str, references: list[str], input_view: str
) -> dict:
    return {
        "id": id_,
        "prefix": START_USER + instruction,
        "body": body,
        "suffix": END_USER,
        "response": response.strip() + END_TURN,
        "target": target,
        "references": references,
        "input": input_view,
    }


def _hash_fraction(text: str) -> float:
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


# ------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Source:
    """Where a dataset's files are: ``files`` maps a role (``ori_pqal.json``...) to a local path."""

    dataset: str  # pubmedqa | style-transfer | jsonl
    files: dict[str, str]
    fingerprint: str  # sha256 over the files' contents: the cache key of every data step

    def as_dict(self) -> dict:
        return {"dataset": self.dataset, "files": dict(self.files), "fingerprint": self.fingerprint}


def _download(url: str, dest: Path, timeout: float = 120) -> Path:
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".kp-tmp.")
    try:
        with os.fdopen(fd, "wb") as fh, urllib.request.urlopen(url, timeout=timeout) as response:
            shutil.copyfileobj(response, fh, 1 << 20)
        os.replace(tmp, dest)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise GemmaDataError(
                f"could not download {url}: {exc}. Download it yourself and pass the local path as data_path.", url
            ) from exc
        raise
    return dest


def resolve_source(dataset: str, data_path: str | None, cache_dir: str | Path) -> Source:
    """Find (or download) the files of ``dataset``; fail with the missing path named.

    ``dataset``: ``pubmedqa``, ``style-transfer``, or the path of a JSONL file of prompt/response pairs.
    ``data_path``: for pubmedqa a folder with ``ori_pqal.json`` and ``test_ground_truth.json`` (or the
    ``ori_pqal.json`` file itself, the ground truth beside it); for style-transfer ``paradetox.tsv`` or its
    folder. ``None`` downloads the official files into ``cache_dir``.
    """
    cache = Path(cache_dir)
    if dataset == "pubmedqa":
        if data_path is None:
            files = {
                name: _download(url, cache / "downloads" / "pubmedqa" / name) for name, url in PUBMEDQA_URLS.items()
            }
        else:
            root = Path(data_path).expanduser()
            if not root.exists():
                raise GemmaDataError(
                    f"data_path {str(root)!r} does not exist (expected a folder with ori_pqal.json "
                    "and test_ground_truth.json)",
                    str(root),
                )
            folder = root if root.is_dir() else root.parent
            files = {
                "ori_pqal.json": root if root.is_file() else folder / "ori_pqal.json",
                "test_ground_truth.json": folder / "test_ground_truth.json",
            }
            for name, path in files.items():
                if not path.is_file():
                    raise GemmaDataError(
                        f"PubMedQA file {name} not found at {path}: data_path must be a folder with "
                        "ori_pqal.json and test_ground_truth.json (github.com/pubmedqa/pubmedqa, "
                        "data/)",
                        str(path),
                    )
    elif dataset == "style-transfer":
        if data_path is None:
            files = {"paradetox.tsv": _download(PARADETOX_URL, cache / "downloads" / "paradetox" / "paradetox.tsv")}
        else:
            root = Path(data_path).expanduser()
            path = root / "paradetox.tsv" if root.is_dir() else root
            if not path.is_file():
                raise GemmaDataError(
                    f"ParaDetox file not found at {path}: data_path must be paradetox.tsv (columns "
                    "toxic, neutral1, neutral2, neutral3) or its folder",
                    str(path),
                )
            files = {"paradetox.tsv": path}
    else:
        path = Path(dataset).expanduser()
        if path.suffix.lower() not in (".jsonl", ".json") and not path.exists():
            raise GemmaDataError(
                f"dataset={dataset!r} is neither one of {', '.join(DATASETS)} nor an existing JSONL "
                "file of prompt/response pairs",
                dataset,
            )
        if not path.is_file():
            raise GemmaDataError(
                f"JSONL file {str(path)!r} does not exist (dataset= takes pubmedqa, style-transfer "
                'or the path of a .jsonl file with one {"prompt": ..., "response": ...} per line)',
                str(path),
            )
        dataset, files = "jsonl", {"pairs.jsonl": path}
    digest = hashlib.sha256(f"{dataset}:{FORMAT_VERSION}".encode())
    for name in sorted(files):
        digest.update(f"{name}:{sha256_file(Path(files[name]))}".encode())
    return Source(dataset, {k: str(Path(v).resolve()) for k, v in files.items()}, digest.hexdigest())


# ------------------------------------------------------------------------------------------- PubMedQA


def pubmedqa_example(pmid: str, item: dict) -> dict:
    labels = item.get("LABELS") or []
    contexts = item["CONTEXTS"]
    lines = []
    for i, text in enumerate(contexts):
        label = labels[i].strip().capitalize() if i < len(labels) and labels[i] else "Context"
        lines.append(f"{label}: {text.strip()}")
    decision = item["final_decision"].strip().lower()
    response = f"{decision.capitalize()}. {item['LONG_ANSWER'].strip()}"
    instruction = PUBMEDQA_INSTRUCTION + f"Question: {item['QUESTION'].strip()}\n\nAbstract:\n"
    return _example(
        pmid, instruction, "\n".join(lines), response, decision, [item["LONG_ANSWER"].strip()], item["QUESTION"].strip()
    )


def _load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise GemmaDataError(f"{path} is not valid JSON ({what}): {exc}", str(path)) from exc


def load_pubmedqa(files: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """(train, test): test = the official test split (test_ground_truth.json), train = the other items."""
    items_path, truth_path = Path(files["ori_pqal.json"]), Path(files["test_ground_truth.json"])
    items = _load_json(items_path, "PubMedQA ori_pqal.json: PMID -> item")
    truth = _load_json(truth_path, "PubMedQA test_ground_truth.json: PMID -> decision")
    if not isinstance(items, dict) or not items:
        raise GemmaDataError(f"{items_path}: expected a JSON object mapping PMIDs to items", str(items_path))
    if not isinstance(truth, dict) or not truth:
        raise GemmaDataError(f"{truth_path}: expected a JSON object mapping PMIDs to yes/no/maybe", str(truth_path))
    for pmid, item in items.items():
        missing = [k for k in ("QUESTION", "CONTEXTS", "final_decision", "LONG_ANSWER") if k not in item]
        if missing:
            raise GemmaDataError(f"{items_path}: item {pmid} lacks {', '.join(missing)}", str(items_path))
        if str(item["final_decision"]).lower() not in DECISIONS:
            raise GemmaDataError(
                f"{items_path}: item {pmid} has final_decision={item['final_decision']!r}, expected one of {DECISIONS}",
                str(items_path),
            )
    unknown = [p for p in truth if p not in items]
    if unknown:
        raise GemmaDataError(
            f"{truth_path}: {len(unknown)} test PMIDs are not in {items_path.name} (e.g. {unknown[0]}); "
            "use the matching ori_pqal.json",
            str(truth_path),
        )
    for pmid, decision in truth.items():
        if str(decision).lower() != str(items[pmid]["final_decision"]).lower():
            raise GemmaDataError(
                f"{truth_path}: PMID {pmid} is {decision!r} there but "
                f"{items[pmid]['final_decision']!r} in {items_path.name}",
                str(truth_path),
            )
    train = [pubmedqa_example(p, items[p]) for p in sorted(items) if p not in truth]
    test = [pubmedqa_example(p, items[p]) for p in sorted(truth)]
    return train, test


# ------------------------------------------------------------------------------------------- ParaDetox


def style_example(id_: str, toxic: str, neutrals: list[str]) -> dict:
    return _example(id_, STYLE_INSTRUCTION, toxic.strip(), neutrals[0], neutrals[0], neutrals, toxic.strip())


def load_paradetox(files: dict[str, str], held_out_fraction: float = 0.1) -> tuple[list[dict], list[dict]]:
    path = Path(files["paradetox.tsv"])
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh, delimiter="\t")  # quoted fields may span lines (the official file has a few)
        header = next(reader, None)
        if not header or header[0] != "toxic" or "neutral1" not in header:
            raise GemmaDataError(
                f"{path}: expected a TSV header 'toxic, neutral1, neutral2, neutral3', got {header}", str(path)
            )
        train, test = [], []
        for row in reader:
            line_no = reader.line_num
            if not row or not row[0].strip():
                continue
            neutrals = [" ".join(c.split()) for c in row[1:] if c and c.strip()]
            if not neutrals:
                raise GemmaDataError(
                    f"{path}:{line_no}: the toxic text has no polite rewrite (neutral1..3 empty)", str(path)
                )
            toxic = " ".join(row[0].split())
            example = style_example(f"paradetox-{line_no}", toxic, neutrals)
            (test if _hash_fraction(toxic) < held_out_fraction else train).append(example)
    if not train or not test:
        raise GemmaDataError(
            f"{path}: too few rows to hold out an evaluation part ({len(train) + len(test)} rows)", str(path)
        )
    return train, test


# ------------------------------------------------------------------------------------------- JSONL pairs


def load_jsonl_pairs(files: dict[str, str], held_out_fraction: float = 0.1) -> tuple[list[dict], list[dict]]:
    """``{"prompt": str, "response": str}`` per line (optional ``id``, ``references``: list of str)."""
    path = Path(files["pairs.jsonl"])
    fix = 'each line must be a JSON object with string fields "prompt" and "response"'
    train, test, seen = [], [], 0
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise GemmaDataError(f"{path}:{line_no}: not valid JSON ({exc.msg}); {fix}", str(path)) from None
            if not isinstance(row, dict):
                raise GemmaDataError(f"{path}:{line_no}: a {type(row).__name__}, not an object; {fix}", str(path))
            missing = [k for k in ("prompt", "response") if k not in row]
            if missing:
                raise GemmaDataError(
                    f"{path}:{line_no}: missing field {', '.join(repr(m) for m in missing)} (has {sorted(row)}); {fix}",
                    str(path),
                )
            for key in ("prompt", "response"):
                if not isinstance(row[key], str) or not row[key].strip():
                    raise GemmaDataError(
                        f"{path}:{line_no}: field {key!r} must be a non-empty string, got {row[key]!r:.60}; {fix}",
                        str(path),
                    )
            refs = row.get("references") or [row["response"]]
            if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
                raise GemmaDataError(f"{path}:{line_no}: 'references' must be a list of strings", str(path))
            seen += 1
            example = _example(
                str(row.get("id", f"line-{line_no}")),
                "",
                row["prompt"].strip(),
                row["response"],
                row["response"].strip(),
                refs,
                row["prompt"].strip(),
            )
            (test if _hash_fraction(row["prompt"].strip()) < held_out_fraction else train).append(example)
    if seen == 0:
        raise GemmaDataError(f"{path} has no examples; {fix}", str(path))
    if not train:
        train, test = test, []
    if not test and len(train) >= 2:  # tiny files: hold out the last one so evaluation has something
        test = [train.pop()]
    return train, test


# ------------------------------------------------------------------------------------------- prepare


def length_stats(values: Iterable[int]) -> dict:
    values = sorted(values)
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "min": values[0],
        "median": int(statistics.median(values)),
        "p95": values[min(len(values) - 1, int(0.95 * len(values)))],
        "max": values[-1],
    }


def char_stats(examples: list[dict]) -> dict:
    return {
        "prompt_chars": length_stats(len(e["prefix"]) + len(e["body"]) + len(e["suffix"]) for e in examples),
        "response_chars": length_stats(len(e["response"]) for e in examples),
    }


def prepare(
    source: Source,
    cache_dir: str | Path,
    seed: int = 0,
    max_examples: int | None = None,
    max_eval_examples: int | None = None,
) -> dict:
    """Write ``train.jsonl`` and ``eval.jsonl`` (chat-formatted examples) under a content-keyed folder."""
    if max_examples is not None and max_examples < 1:
        raise GemmaDataError(f"max_examples={max_examples}: use a positive number or None for all")
    key = hashlib.sha256(json.dumps([source.fingerprint, seed, max_examples, max_eval_examples]).encode()).hexdigest()
    out = Path(cache_dir) / "prepared" / key[:24]
    if (out / "stats.json").is_file():
        return json.loads((out / "stats.json").read_text())
    if source.dataset == "pubmedqa":
        train, held_out = load_pubmedqa(source.files)
    elif source.dataset == "style-transfer":
        train, held_out = load_paradetox(source.files)
    else:
        train, held_out = load_jsonl_pairs(source.files)
    available = {"train": len(train), "eval": len(held_out)}
    random.Random(seed).shuffle(train)
    if max_examples is not None:
        train = train[:max_examples]
    if max_eval_examples is not None:
        held_out = held_out[:max_eval_examples]  # a fixed order: the same items whatever the seed
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".kp-tmp."))
    try:
        for name, rows in (("train.jsonl", train), ("eval.jsonl", held_out)):
            (tmp / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        stats = {
            "path": str(out),
            "dataset": source.dataset,
            "fingerprint": source.fingerprint,
            "available": available,
            "sizes": {"train": len(train), "eval": len(held_out)},
            "train": char_stats(train),
            "eval": char_stats(held_out),
            "example": chat(
                train[0]["prefix"][len(START_USER) :], train[0]["body"], train[0]["response"][: -len(END_TURN)]
            )
            if train
            else "",
        }
        (tmp / "stats.json").write_text(json.dumps(stats, indent=1))
        try:
            os.replace(tmp, out)
        except OSError:  # another run wrote the same entry meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return json.loads((out / "stats.json").read_text())


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


# ------------------------------------------------------------------------------------------- evaluation


_DECISION_RE = re.compile(r"\b(yes|no|maybe)\b", re.IGNORECASE)


def parse_decision(text: str) -> str | None:
    """yes/no/maybe from a generation: its first word if that is one, else the first one anywhere."""
    words = re.findall(r"[a-zA-Z]+", text[:40])
    if words and words[0].lower() in DECISIONS:
        return words[0].lower()
    match = _DECISION_RE.search(text)
    return match.group(1).lower() if match else None
