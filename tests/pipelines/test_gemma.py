"""The Gemma 3 LoRA flow (flows/gemma_lora.py) on the shared PubMedQA and ParaDetox data.

The model is a tiny Gemma 3 built from the real keras-hub classes (tests/support/tiny_gemma.py: 2 layers, hidden 64, a
SentencePiece tokenizer trained on the fly) and saved as a local preset once per session, so the flow runs the
same ``Gemma3CausalLM.from_preset(folder)`` path as ``gemma3_instruct_1b`` — through a real Prefect server and
real kinetic-local jobs. These check the pipeline (held-out split, loss masking, LoRA save/merge, resume after a
kill, caching, artifacts, credentials, bad inputs), not model quality.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from job_runs import jobs_of, task_runs_of

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
DATA = SHARED / "data"

pytestmark = pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"{SHARED} is absent (PubMedQA/ParaDetox ship with the CI machine only)"
)

sys.path.insert(0, str(ROOT / "flows"))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("KERAS_BACKEND", "jax")

from gemma import data as gd  # noqa: E402
from gemma import metrics as gm  # noqa: E402
from gemma import presets, tokens  # noqa: E402

FAKE_KAGGLE = {"KAGGLE_USERNAME": "kp-test-user", "KAGGLE_KEY": "kp-test-key-7f3a9c"}
SMALL = dict(lora_rank=4, batch_size=8, learning_rate=5e-3, max_new_tokens=8, eval_batch_size=8, num_samples=4)


def _flow():
    import gemma_lora

    return gemma_lora


def _task_runs(flow_run_id):
    return task_runs_of(flow_run_id)


def _task_states(flow_run_id) -> dict[str, str]:
    return {r.name.rsplit("-", 1)[0]: r.state.name for r in _task_runs(flow_run_id)}


def _child_flow_runs(task_run_id):
    return jobs_of(task_run_id)


def _job_logs(flow_run_id, wanted: str, timeout: float = 15) -> list[str]:
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.time() + timeout
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=200)
            # The worker forwards a job's output in batches: one Prefect log record may hold several lines.
            lines = [line for log in logs for line in log.message.splitlines()]
            if any(wanted in line for line in lines) or time.time() > deadline:
                return lines
            time.sleep(0.5)


def _artifacts(flow_run_id):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )


def _run_flow(**params):
    state = _flow().gemma_lora(return_state=True, **params)
    return state.state_details.flow_run_id, state


@pytest.fixture(scope="session")
def tiny_preset(tmp_path_factory) -> Path:
    """The tiny Gemma 3 preset, built once per session."""
    from tiny_gemma import build_tiny_preset

    return build_tiny_preset(tmp_path_factory.mktemp("tiny-gemma3") / "preset", DATA)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gemma-cache")


# --------------------------------------------------------------------------------------------- data (no model)


def test_pubmedqa_trains_only_outside_the_official_test_split():
    source = gd.resolve_source("pubmedqa", str(DATA / "pubmedqa"), "/nonexistent-cache")
    train, test = gd.load_pubmedqa(source.files)
    truth = json.loads((DATA / "pubmedqa" / "test_ground_truth.json").read_text())
    assert len(train) == 500 and len(test) == 500
    assert {e["id"] for e in test} == set(truth)
    assert not {e["id"] for e in train} & set(truth)
    assert all(e["target"] == truth[e["id"]] for e in test)
    example = train[0]
    assert example["prefix"].startswith("<start_of_turn>user\n") and "Question: " in example["prefix"]
    assert example["suffix"] == "<end_of_turn>\n<start_of_turn>model\n"
    assert example["response"].endswith("<end_of_turn>")
    assert example["response"].lower().startswith(example["target"])  # decision first, then the long answer
    text = gd.chat(example["prefix"][len(gd.START_USER) :], example["body"], example["response"][: -len(gd.END_TURN)])
    assert text.count("<start_of_turn>") == 2 and text.count("<end_of_turn>") == 2


def test_paradetox_and_jsonl_pairs_are_chat_formatted(tmp_path):
    train, test = gd.load_paradetox({"paradetox.tsv": str(DATA / "paradetox" / "paradetox.tsv")})
    assert len(train) + len(test) > 11000 and 0.07 < len(test) / (len(train) + len(test)) < 0.13
    assert not {e["id"] for e in train} & {e["id"] for e in test}
    assert all(1 <= len(e["references"]) <= 3 for e in test)
    assert train[0]["prefix"].startswith("<start_of_turn>user\nRewrite") and train[0]["response"].endswith(
        "<end_of_turn>"
    )
    again = gd.load_paradetox({"paradetox.tsv": str(DATA / "paradetox" / "paradetox.tsv")})[1]
    assert [e["id"] for e in again] == [e["id"] for e in test], "the held-out part is fixed"

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": f"Say {i} politely", "response": f"Please, {i}."}) + "\n" for i in range(30))
    )
    source = gd.resolve_source(str(pairs), None, tmp_path / "cache")
    assert source.dataset == "jsonl"
    prepared = gd.prepare(source, tmp_path / "cache", seed=1, max_examples=10)
    assert prepared["sizes"]["train"] == 10 and prepared["sizes"]["eval"] >= 1
    rows = gd.read_jsonl(Path(prepared["path"]) / "train.jsonl")
    assert all(r["prefix"] == "<start_of_turn>user\n" and r["body"].startswith("Say ") for r in rows)
    assert gd.prepare(source, tmp_path / "cache", seed=1, max_examples=10) == prepared  # cached on disk by content
    pairs.write_text(pairs.read_text().replace("Say 3", "Tell 3"))
    assert gd.resolve_source(str(pairs), None, tmp_path / "cache").fingerprint != source.fingerprint


@pytest.mark.parametrize(
    "content, expected",
    [
        (
            '{"prompt": "hi", "response": "hello"}\n{"prompt": "bye"}\n',
            r"pairs\.jsonl:2: missing field 'response' .*each line must be a JSON object with string fields",
        ),
        ('{"prompt": "hi", "response": "hello"}\n{"prompt": "x", "response": "y"\n', r"pairs\.jsonl:2: not valid JSON"),
        ('{"prompt": "hi", "response": 3}\n', r"pairs\.jsonl:1: field 'response' must be a non-empty string"),
        ('["hi", "hello"]\n', r"pairs\.jsonl:1: a list, not an object"),
        ("\n\n", r"pairs\.jsonl has no examples"),
    ],
)
def test_jsonl_errors_name_the_line_and_the_fix(tmp_path, content, expected):
    path = tmp_path / "pairs.jsonl"
    path.write_text(content)
    source = gd.resolve_source(str(path), None, tmp_path)
    with pytest.raises(gd.GemmaDataError, match=expected):
        gd.prepare(source, tmp_path / "cache")


def test_missing_data_files_are_named(tmp_path):
    with pytest.raises(gd.GemmaDataError, match=r"test_ground_truth\.json not found"):
        (tmp_path / "ori_pqal.json").write_text("{}")
        gd.resolve_source("pubmedqa", str(tmp_path), tmp_path)
    with pytest.raises(gd.GemmaDataError, match=r"neither one of pubmedqa, style-transfer nor an existing JSONL"):
        gd.resolve_source("pubmed", None, tmp_path)
    with pytest.raises(gd.GemmaDataError, match=r"JSONL file .*nope\.jsonl' does not exist"):
        gd.resolve_source(str(tmp_path / "nope.jsonl"), None, tmp_path)


def test_packing_truncates_the_body_and_masks_all_but_the_answer():
    def tokenize(texts):  # one token per character, ids from 10
        return [[10 + (ord(c) % 50) for c in t] for t in texts]

    examples = [
        {"id": "a", "prefix": "P" * 5, "body": "B" * 30, "suffix": "S" * 3, "response": "R" * 6},
        {"id": "b", "prefix": "P" * 5, "body": "B" * 2, "suffix": "S" * 3, "response": "R" * 6},
    ]
    seg = tokens.segment(examples, tokenize)
    packed = tokens.pack(seg, 24, bos_id=2, pad_id=0)
    assert packed.token_ids.shape == (2, 24)
    assert packed.lengths.tolist() == [24, 1 + 5 + 2 + 3 + 6]
    # example a: bos + prefix + 9 body tokens (24 - 1 - 5 - 3 - 6) + suffix + response, loss on the 6 answer tokens
    assert packed.response_mask[0].sum() == 6 and packed.response_mask[0, -6:].all()
    assert packed.response_mask[1, 11:17].all() and packed.response_mask[1].sum() == 6
    assert not packed.padding_mask[1, 17:].any() and (packed.token_ids[1, 17:] == 0).all()
    assert packed.stats["body_truncated"] == 1 and packed.stats["tokens_dropped"] == 21
    prompts = tokens.pack(seg, 24, bos_id=2, pad_id=0, generate_tokens=8, what="evaluation")
    assert prompts.lengths.tolist() == [16, 11] and not prompts.response_mask.any()
    with pytest.raises(
        tokens.SequenceLengthError,
        match=r"sequence_length=8 is too small for the prompt .*"
        r"example 'a' needs 9 tokens.*Use sequence_length >= 64",
    ):
        tokens.pack(seg, 8, bos_id=2, pad_id=0)
    with pytest.raises(tokens.SequenceLengthError, match=r"max_new_tokens=20 to generate"):
        tokens.pack(seg, 24, bos_id=2, pad_id=0, generate_tokens=20, what="evaluation")


def test_decisions_and_chrf():
    assert gd.parse_decision("Yes. The results show ...") == "yes"
    assert gd.parse_decision("MAYBE, it depends") == "maybe"
    assert gd.parse_decision("The answer is no: no effect was seen") == "no"
    assert gd.parse_decision("unclear") is None
    generations = [{"target": "yes", "before": "no", "after": "Yes."}, {"target": "no", "before": "??", "after": "No"}]
    acc = gm.decision_accuracy(generations, "after")
    assert acc["accuracy"] == 1.0 and gm.decision_accuracy(generations, "before")["unparsed"] == 1
    style = [
        {"references": ["thank you", "thanks"], "before": "you idiot", "after": "thank you"},
        {"references": ["please stop"], "before": "stop it", "after": "please stop"},
    ]
    scores = gm.evaluate("style-transfer", style)
    assert scores["metric"] == "chrF" and scores["after"] == 100.0 and scores["before"] < 60


def test_unknown_and_bad_presets_name_the_fix(tmp_path, monkeypatch):
    with pytest.raises(
        presets.PresetError, match=r"unknown preset 'gemma3_instruct_1bb'. Did you mean gemma3_instruct_1b"
    ):
        presets.resolve("gemma3_instruct_1bb")
    with pytest.raises(presets.PresetError, match=r"preset folder .*missing.* does not exist"):
        presets.resolve(str(tmp_path / "missing"))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(
        presets.PresetError,
        match=r"not a keras-hub preset: tokenizer\.json, "
        r"assets/tokenizer/vocabulary\.spm missing",
    ):
        presets.resolve(str(tmp_path / "half"))
    assert presets.resolve("gs://bucket/gemma").value == "gs://bucket/gemma/"
    for name in presets.KAGGLE_ENV:
        monkeypatch.delenv(name, raising=False)
    ref = presets.resolve("gemma3_instruct_1b")
    assert ref.kind == "kaggle"
    with pytest.raises(presets.PresetError, match=r"KAGGLE_USERNAME and KAGGLE_KEY are not set.*export"):
        presets.check_credentials(ref)
    monkeypatch.setenv("KAGGLE_USERNAME", "someone")
    monkeypatch.setenv("KAGGLE_KEY", "k")
    assert presets.check_credentials(ref) == ["KAGGLE_USERNAME", "KAGGLE_KEY"]


# --------------------------------------------------------------------------------------------- the flow


@pytest.fixture(scope="module")
def pubmedqa_run(prefect_server, tiny_preset, cache_dir, tmp_path_factory):
    """PubMedQA, tiny model, 1 epoch, through kinetic-local."""
    out = tmp_path_factory.mktemp("gemma-out")
    params = dict(
        dataset="pubmedqa",
        data_path=str(DATA / "pubmedqa"),
        preset=str(tiny_preset),
        epochs=1,
        sequence_length=192,
        max_examples=24,
        max_eval_examples=8,
        cache_dir=str(cache_dir),
        output_dir=str(out),
        download_merged_preset=True,
        **SMALL,
    )
    flow_run_id, state = _run_flow(**params)
    return flow_run_id, state.result(), out, params


@pytest.mark.slow
def test_pubmedqa_flow_trains_evaluates_and_publishes(pubmedqa_run):
    flow_run_id, result, out, _ = pubmedqa_run
    truth = json.loads((DATA / "pubmedqa" / "test_ground_truth.json").read_text())
    assert result["metric"] == "accuracy" and 0.0 <= result["after"] <= 1.0 and 0.0 <= result["before"] <= 1.0
    assert result["sizes"] == {"train": 24, "eval": 8} and result["epochs_run"] == 1
    assert result["dtype"] == "float32"  # CPU
    assert 0 < result["trainable_params"] < result["total_params"] / 10
    train_stats = result["token_stats"]["train"]
    assert train_stats["examples"] == 24 and train_stats["sequence_length"] == 192
    assert train_stats["body_truncated"] > 0, "PubMedQA abstracts do not fit 192 tokens: truncation is reported"
    assert result["caller_lengths"]["checked"] and result["caller_lengths"]["train"] == train_stats
    assert {s["id"] for s in result["samples"]} <= set(truth), "samples come from the official test split"
    for name in (
        "gemma_lora.lora.h5",
        "generations.jsonl",
        "train_summary.json",
        "merged_preset/config.json",
        "merged_preset/model.weights.h5",
        "merged_preset/assets/tokenizer/vocabulary.spm",
    ):
        assert (out / name).is_file(), f"{name} missing from the outputs"
    generations = [json.loads(line) for line in (out / "generations.jsonl").read_text().splitlines()]
    assert len(generations) == 8 and all(g["id"] in truth and g["target"] == truth[g["id"]] for g in generations)

    artifacts = {a.key: a for a in _artifacts(flow_run_id) if a.key}
    assert {"gemma-sample-generations", "gemma-report"} <= set(artifacts), set(artifacts)
    table = artifacts["gemma-sample-generations"].data
    table = json.loads(table) if isinstance(table, str) else table
    assert len(table) == 4 and {"before fine-tuning", "after fine-tuning", "decision after"} <= set(table[0])
    report = artifacts["gemma-report"].data
    assert "Token lengths and truncation" in report and f"{result['trainable_params']:,}" in report

    [train_run] = [r for r in _task_runs(flow_run_id) if r.name.startswith("gemma-train")]
    [job] = _child_flow_runs(train_run.id)
    lines = _job_logs(job.id, "epoch 1/1 loss=")
    assert any(line.startswith("epoch 1/1 step 3/3 loss=") for line in lines), lines[-15:]
    assert any(line.startswith("epoch 1/1 loss=") for line in lines), lines[-15:]
    assert any("training: 24 examples, sequence_length 192" in line for line in lines)


@pytest.mark.slow
def test_lora_weights_and_the_merged_preset_round_trip(pubmedqa_run, tiny_preset):
    """base + LoRA weights (save_lora_weights) == merged preset (save_to_preset) != base."""
    import keras_hub

    _, _, out, _ = pubmedqa_run
    base = keras_hub.models.Gemma3CausalLM.from_preset(str(tiny_preset))
    inputs = {
        "token_ids": np.array([[2, 10, 20, 30, 40, 50, 60, 70]], dtype="int32"),
        "padding_mask": np.ones((1, 8), dtype=bool),
    }
    base_logits = np.asarray(base(inputs))
    base.backbone.load_lora_weights(str(out / "gemma_lora.lora.h5"))
    lora_logits = np.asarray(base(inputs))
    merged = keras_hub.models.Gemma3CausalLM.from_preset(str(out / "merged_preset"))
    merged_logits = np.asarray(merged(inputs))
    assert not np.allclose(base_logits, lora_logits, atol=1e-6), "training changed the LoRA weights"
    np.testing.assert_allclose(merged_logits, lora_logits, atol=1e-4, rtol=1e-4)
    assert merged.preprocessor.sequence_length == 192


@pytest.mark.slow
def test_a_second_run_is_all_cache_hits(pubmedqa_run):
    _, first, _, params = pubmedqa_run
    flow_run_id, state = _run_flow(**params)
    result = state.result()
    states = _task_states(flow_run_id)
    for name in ("gemma-prepare-data", "gemma-check-lengths", "gemma-train"):
        assert states[name] == "Cached", states
    [train_run] = [r for r in _task_runs(flow_run_id) if r.name.startswith("gemma-train")]
    assert _child_flow_runs(train_run.id) == [], "a cache hit launches no job"
    assert result["after"] == first["after"] and result["samples"] == first["samples"]


@pytest.fixture(scope="module")
def style_run(prefect_server, tiny_preset, cache_dir, tmp_path_factory):
    """Style transfer, 2 epochs; the first job SIGKILLs itself after epoch 1 and the retry resumes. Fake Kaggle
    credentials are forwarded with env= to check they reach the job and are stored nowhere."""
    out = tmp_path_factory.mktemp("gemma-style-out")
    saved = {k: os.environ.get(k) for k in FAKE_KAGGLE}
    os.environ.update(FAKE_KAGGLE)
    try:
        flow_run_id, state = _run_flow(
            dataset="style-transfer",
            data_path=str(DATA / "paradetox" / "paradetox.tsv"),
            preset=str(tiny_preset),
            epochs=2,
            sequence_length=96,
            max_examples=16,
            max_eval_examples=8,
            kill_after_epoch=1,
            retries=1,
            dtype="mixed_bfloat16",  # the GPU/TPU precision path, exercised on CPU
            forward_env=list(FAKE_KAGGLE),
            cache_dir=str(cache_dir),
            output_dir=str(out),
            download_merged_preset=True,
            **SMALL,
        )
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return flow_run_id, state.result(), out


@pytest.mark.slow
def test_style_transfer_resumes_after_a_kill_and_reports_chrf(style_run):
    flow_run_id, result, out = style_run
    assert result["metric"] == "chrF" and 0.0 <= result["after"] <= 100.0 and 0.0 <= result["before"] <= 100.0
    assert result["resumed_from_epoch"] == 1, "the retry must start from the checkpoint of epoch 1"
    assert result["epochs_run"] == 2 and len(result["history"]["loss"]) == 2
    [train_run] = [r for r in _task_runs(flow_run_id) if r.name.startswith("gemma-train")]
    assert train_run.run_count == 2 and train_run.state.is_completed()
    jobs = _child_flow_runs(train_run.id)
    assert len(jobs) == 2 and not jobs[0].state.is_completed() and jobs[1].state.is_completed()
    lines = _job_logs(jobs[1].id, "resumed from the checkpoint")
    assert any("resumed from the checkpoint of epoch 1/2" in line for line in lines), lines[-10:]
    assert (out / "gemma_lora.lora.h5").is_file()
    assert all(s["reference"] and s["after fine-tuning"] is not None for s in result["samples"])
    assert result["dtype"] == "mixed_bfloat16"
    import keras_hub

    merged = keras_hub.models.Gemma3CausalLM.from_preset(str(out / "merged_preset"))  # float32 variables
    assert merged.backbone.dtype_policy.name == "float32"


@pytest.mark.slow
def test_forwarded_credentials_reach_the_job_and_are_stored_nowhere(style_run, store_dir):
    from prefect import get_client

    flow_run_id, result, _ = style_run
    assert result["env_seen"] == sorted(FAKE_KAGGLE)
    [train_run] = [r for r in _task_runs(flow_run_id) if r.name.startswith("gemma-train")]
    with get_client(sync_client=True) as client:
        parent = client.read_flow_run(flow_run_id)
        for job in _child_flow_runs(train_run.id):
            dumped = json.dumps(client.read_flow_run(job.id).model_dump(mode="json"))
            assert FAKE_KAGGLE["KAGGLE_KEY"] not in dumped, "the key is in the job's flow run (job variables)"
    assert FAKE_KAGGLE["KAGGLE_KEY"] not in json.dumps(parent.model_dump(mode="json"))
    leaked = [
        p
        for p in Path(store_dir).rglob("*")
        if p.is_file() and p.stat().st_size < 50_000_000 and FAKE_KAGGLE["KAGGLE_KEY"].encode() in p.read_bytes()
    ]
    assert not leaked, f"the key was written into the store: {leaked}"


# --------------------------------------------------------------------------------------------- bad inputs, early


def test_too_small_sequence_length_fails_before_the_job(tiny_preset, cache_dir, tmp_path):
    flow_run_id, state = _run_flow(
        dataset="pubmedqa",
        data_path=str(DATA / "pubmedqa"),
        preset=str(tiny_preset),
        sequence_length=32,
        max_examples=8,
        max_eval_examples=4,
        cache_dir=str(cache_dir),
        output_dir=str(tmp_path),
        **SMALL,
    )
    assert state.is_failed()
    with pytest.raises(
        tokens.SequenceLengthError,
        match=r"sequence_length=32 is too small for the prompt \(training\): "
        r"example '\d+' needs \d+ tokens.*Use sequence_length >= \d+",
    ):
        state.result()
    states = _task_states(flow_run_id)
    assert states.get("gemma-check-lengths") == "Failed" and "gemma-train" not in states, states


def test_jsonl_with_a_missing_field_fails_before_the_job(tiny_preset, cache_dir, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "answer": "d"}\n')
    flow_run_id, state = _run_flow(
        dataset=str(path), preset=str(tiny_preset), cache_dir=str(cache_dir), output_dir=str(tmp_path / "o"), **SMALL
    )
    with pytest.raises(
        gd.GemmaDataError, match=r"pairs\.jsonl:2: missing field 'response' \(has \['answer', 'prompt'\]\)"
    ):
        state.result()
    states = _task_states(flow_run_id)
    assert states.get("gemma-prepare-data") == "Failed" and "gemma-train" not in states, states


def test_unknown_preset_and_missing_kaggle_credentials_fail_before_any_task(cache_dir, tmp_path, monkeypatch):
    flow_run_id, state = _run_flow(
        dataset="pubmedqa",
        data_path=str(DATA / "pubmedqa"),
        preset="gemma3_1bb",
        cache_dir=str(cache_dir),
        output_dir=str(tmp_path),
    )
    with pytest.raises(presets.PresetError, match=r"unknown preset 'gemma3_1bb'. Did you mean gemma3_1b"):
        state.result()
    assert _task_runs(flow_run_id) == []
    for name in presets.KAGGLE_ENV:
        monkeypatch.delenv(name, raising=False)
    flow_run_id, state = _run_flow(
        dataset="pubmedqa",
        data_path=str(DATA / "pubmedqa"),
        preset="gemma3_instruct_1b",
        cache_dir=str(cache_dir),
        output_dir=str(tmp_path),
    )
    with pytest.raises(presets.PresetError, match=r"downloaded from Kaggle by the job.*KAGGLE_USERNAME and KAGGLE_KEY"):
        state.result()
    assert _task_runs(flow_run_id) == []
