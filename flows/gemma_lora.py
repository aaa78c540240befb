"""Gemma 3 LoRA fine-tuning as a Prefect flow: PubMedQA medical Q&A, or rude -> polite style transfer.

    uv run --extra llm python flows/gemma_lora.py --dataset pubmedqa --accelerator l4  # Kaggle credentials needed
    uv run --extra llm python flows/gemma_lora.py --dataset style-transfer --preset ./my_preset --epochs 2
    uv run --extra llm python flows/gemma_lora.py --dataset pairs.jsonl --sequence-length 256

Steps (each a Prefect task; see flows/gemma/README.md):

1. ``gemma-locate-data``  -- the dataset's files (``data_path``, or the official downloads), fingerprinted by
   content (sha256).
2. ``gemma-prepare-data`` -- chat-formatted examples (``<start_of_turn>user ... <start_of_turn>model ...``),
   PubMedQA's official 500-item test split held out; cached by file content and settings.
3. ``gemma-check-lengths`` -- the preset's tokenizer on the caller (when it can be loaded here): token length
   statistics and truncation, and a clear error if ``sequence_length`` cannot hold a prompt, before any job.
4. ``gemma-train`` -- a ``@kinetic_task`` job on ``accelerator``: ``Gemma3CausalLM.from_preset``, LoRA,
   loss on the response tokens only, a checkpoint per epoch in ``KINETIC_CHECKPOINT_DIR`` (a retry resumes),
   greedy generations on the held-out prompts before and after; LoRA weights and the merged preset go to
   ``KINETIC_OUTPUT_DIR``. Cached on its inputs (data and preset fingerprints): ``retrain=True`` forces a run.
5. ``gemma-evaluate`` -- decision accuracy (PubMedQA) or chrF (sacrebleu) before and after, on the caller.
6. ``gemma-publish`` -- artifacts (sample generations before/after, a report) and the outputs copied locally.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `gemma` imports the same way in tests and scripts
os.environ.setdefault("KERAS_BACKEND", "jax")

from gemma import data as gd  # noqa: E402
from gemma import presets  # noqa: E402
from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.cache_policies import INPUTS, TASK_SOURCE  # noqa: E402

from kinetic_prefect import Data, JobOutputs, kinetic_task  # noqa: E402

CACHE_POLICY = INPUTS + TASK_SOURCE


def _cache_dir(cache_dir: str | None) -> str:
    return str(Path(cache_dir).expanduser().resolve() if cache_dir else gd.default_cache_dir())


@task(name="gemma-locate-data")
def locate_data(dataset: str, data_path: str | None, cache_dir: str) -> dict:
    source = gd.resolve_source(dataset, data_path, cache_dir)
    get_run_logger().info(
        f"{source.dataset}: {', '.join(f'{k} = {v}' for k, v in source.files.items())} "
        f"(content sha256 {source.fingerprint[:12]})"
    )
    return source.as_dict()


@task(name="gemma-prepare-data", cache_policy=CACHE_POLICY, persist_result=True)
def prepare_data(
    source: dict, cache_dir: str, seed: int, max_examples: int | None, max_eval_examples: int | None
) -> dict:
    """Cached on the files' content (``source["fingerprint"]``) and the settings."""
    prepared = gd.prepare(gd.Source(**source), cache_dir, seed, max_examples, max_eval_examples)
    sizes, train = prepared["sizes"], prepared["train"]
    get_run_logger().info(
        f"{sizes['train']} training / {sizes['eval']} held-out examples (of {prepared['available']['train']} / "
        f"{prepared['available']['eval']}) in {prepared['path']}; prompt characters median "
        f"{train['prompt_chars'].get('median')} / max {train['prompt_chars'].get('max')}, answer characters median "
        f"{train['response_chars'].get('median')} / max {train['response_chars'].get('max')}"
    )
    return prepared


def _caller_tokenizer(ref: presets.PresetRef):
    """The preset's tokenizer on the caller, or (None, why not)."""
    if ref.kind == "gcs" or ref.kind == "hf":
        return None, f"{ref.kind} preset: the tokenizer is loaded (and the lengths checked) in the job"
    try:
        import keras_hub
    except Exception as exc:  # the llm extra is not installed on the caller
        return None, f"keras-hub is not importable here ({exc}); the lengths are checked in the job"
    try:
        return keras_hub.models.Gemma3Tokenizer.from_preset(ref.value), None
    except Exception as exc:  # e.g. Kaggle unreachable from the caller
        return (
            None,
            f"could not load the tokenizer of {ref.value!r} here ({type(exc).__name__}: {exc}); "
            "the lengths are checked in the job",
        )


@task(name="gemma-check-lengths", cache_policy=CACHE_POLICY, persist_result=True)
def check_lengths(prepared: dict, preset_ref: dict, sequence_length: int, max_new_tokens: int) -> dict:
    """Token statistics with the preset's own tokenizer; raises SequenceLengthError before any job."""
    from gemma import tokens

    logger = get_run_logger()
    tokenizer, why_not = _caller_tokenizer(presets.PresetRef(**preset_ref))
    if tokenizer is None:
        logger.warning(why_not)
        return {"checked": False, "reason": why_not}
    tokenize = tokens.make_tokenize(tokenizer)
    bos, pad = int(tokenizer.start_token_id), int(tokenizer.pad_token_id)
    root = Path(prepared["path"])
    train = tokens.pack(
        tokens.segment(gd.read_jsonl(root / "train.jsonl"), tokenize), sequence_length, bos, pad, what="training"
    )
    held_out = tokens.pack(
        tokens.segment(gd.read_jsonl(root / "eval.jsonl"), tokenize),
        sequence_length,
        bos,
        pad,
        generate_tokens=max_new_tokens,
        what="evaluation",
    )
    for stats in (train.stats, held_out.stats):
        logger.info(tokens.describe(stats))
    return {"checked": True, "train": train.stats, "eval": held_out.stats}


def _flows_dir() -> Path:
    """Where ``gemma`` lives: the job runs in the restored project (cwd), a plain call next to this file."""
    for candidate in (Path.cwd() / "flows", Path(__file__).resolve().parent):
        if (candidate / "gemma" / "__init__.py").exists():
            return candidate
    raise RuntimeError(f"cannot find the gemma package (cwd {Path.cwd()})")


@kinetic_task(
    name="gemma-train",
    accelerator="cpu",
    retries=1,
    retry_delay_seconds=0,
    cache_policy=CACHE_POLICY,
    persist_result=True,
)
def train(
    data_dir: Path,
    preset: str | Path,
    config: dict,
    fingerprints: dict,
    kill_after_epoch: int | None = None,
    report_env: list[str] | None = None,
) -> dict:
    """The job. ``fingerprints`` (data and preset content) only key the cache; ``report_env`` names variables
    whose presence (never their values) the job reports back."""
    flows_dir = str(_flows_dir())
    if flows_dir not in sys.path:
        sys.path.insert(0, flows_dir)
    os.environ.setdefault("KERAS_BACKEND", "jax")
    from gemma.train import run

    result = run(Path(data_dir), preset, config, kill_after_epoch=kill_after_epoch)
    result["outputs"] = JobOutputs.current()
    result["env_seen"] = sorted(name for name in (report_env or []) if os.environ.get(name))
    return result


@task(name="gemma-evaluate")
def evaluate(dataset: str, trained: dict) -> dict:
    from gemma.metrics import evaluate as score

    metrics = score(dataset, trained["generations"])
    before = "n/a" if metrics["before"] is None else metrics["before"]
    get_run_logger().info(
        f"{metrics['metric']} on {metrics['count']} held-out examples: before fine-tuning "
        f"{before}, after {metrics['after']}"
    )
    return metrics


def _job_outputs(trained: dict) -> JobOutputs:
    outputs: JobOutputs = trained["outputs"]
    if outputs.local_dir is not None:  # the body ran as a plain call: its files are where it wrote them
        return JobOutputs(store="", run_id="", local_dir=trained["output_dir"])
    return outputs


def _download_outputs(trained: dict, output_dir: Path, include_merged: bool) -> list[str]:
    output_dir.mkdir(parents=True, exist_ok=True)
    outputs = _job_outputs(trained)
    wanted = [f for f in trained["files"] if include_merged or not f.startswith("merged_preset/")]
    return [str(outputs.download(name, output_dir)) for name in wanted]


def _store_url(trained: dict, name: str) -> str:
    return _job_outputs(trained).url(name)


def _short(text: str | None, limit: int = 300) -> str:
    if text is None:
        return ""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@task(name="gemma-publish")
def publish(
    dataset: str,
    trained: dict,
    metrics: dict,
    prepared: dict,
    lengths: dict,
    output_dir: str,
    num_samples: int,
    download_merged_preset: bool,
) -> dict:
    """Artifacts on the flow run (sample generations before/after, a report); outputs copied to output_dir."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    files = _download_outputs(trained, Path(output_dir), download_merged_preset)
    samples = _sample_rows(dataset, trained["generations"][:num_samples])
    create_table_artifact(
        key="gemma-sample-generations",
        table=samples,
        description=f"Gemma LoRA ({dataset}): held-out prompts, generations before and after fine-tuning (greedy)",
    )
    markdown = _report_markdown(dataset, trained, metrics, prepared, files)
    create_markdown_artifact(key="gemma-report", markdown=markdown, description=f"Gemma LoRA report ({dataset})")
    return {
        "files": files,
        "samples": samples,
        "merged_preset": _store_url(trained, "merged_preset"),
        "lora_weights": _store_url(trained, "gemma_lora.lora.h5"),
    }


def _sample_rows(dataset: str, generations: list[dict]) -> list[dict]:
    """The sample table's rows: prompt, reference, generations before/after (and PubMedQA's decisions)."""
    from gemma.data import parse_decision

    samples = []
    for g in generations:
        row = {
            "id": g["id"],
            "input": _short(g["input"]),
            "reference": _short(g["target"] if dataset == "pubmedqa" else g["references"][0]),
            "before fine-tuning": _short(g["before"]),
            "after fine-tuning": _short(g["after"]),
        }
        if dataset == "pubmedqa":
            row["decision before"] = parse_decision(g["before"] or "") or "?"
            row["decision after"] = parse_decision(g["after"] or "") or "?"
        samples.append(row)
    return samples


def _token_stat_row(name: str, s: dict) -> str:
    full = s["full_tokens"]
    return (
        f"| {name} | {s['examples']} | {full.get('median', '-')} / {full.get('p95', '-')} / "
        f"{full.get('max', '-')} | {s['body_truncated']} | {s['response_truncated']} | {s['tokens_dropped']} |"
    )


def _report_markdown(dataset: str, trained: dict, metrics: dict, prepared: dict, files: list[str]) -> str:
    """The gemma-report artifact: the metric before/after, the settings, token lengths, the curve, the outputs."""
    stats = trained["token_stats"]
    history = trained["history"]
    curve = "\n".join(
        f"| {i + 1} | {history['loss'][i]:.4f} | {history['accuracy'][i]:.4f} |" for i in range(len(history["loss"]))
    )
    cfg = trained["config"]
    return f"""# Gemma LoRA: {dataset}

| | before fine-tuning | after |
| --- | ---: | ---: |
| {metrics["metric"]} ({metrics["count"]} held-out examples) | {metrics["before"]} | **{metrics["after"]}** |

| setting | value |
| --- | --- |
| preset | `{trained["preset"]}` |
| LoRA rank | {cfg["lora_rank"]} |
| trainable / total parameters | {trained["trainable_params"]:,} / {trained["total_params"]:,} |
| sequence length, batch, epochs, learning rate | {cfg["sequence_length"]}, {cfg["batch_size"]}, {cfg["epochs"]}, {cfg["learning_rate"]} |
| dtype | {trained["dtype"]} |
| training examples (held out) | {prepared["sizes"]["train"]} ({prepared["sizes"]["eval"]}) |
| resumed from epoch | {trained["resumed_from_epoch"]} |
| training time | {trained["train_seconds"]:.1f} s ({trained["ms_per_step"]} ms/step) |

## Token lengths and truncation (`<bos>` + prompt + answer)

| part | examples | full length median / p95 / max | bodies cut | answers cut | tokens dropped |
| --- | ---: | --- | ---: | ---: | ---: |
{_token_stat_row("training", stats["train"])}
{_token_stat_row("evaluation prompts", stats["eval"])}

## Learning curve (loss on answer tokens)

| epoch | loss | token accuracy |
| ---: | ---: | ---: |
{curve}

## Outputs

- LoRA weights: `{_store_url(trained, "gemma_lora.lora.h5")}`
- merged preset (`Gemma3CausalLM.from_preset(...)`): `{_store_url(trained, "merged_preset")}`
""" + "\n".join(f"- `{f}`" for f in files)


def _validate(
    lora_rank: int,
    sequence_length: int,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    max_new_tokens: int,
    max_examples: int | None,
) -> None:
    checks = [
        (lora_rank >= 1, f"lora_rank={lora_rank}: use a positive rank (4-16 is typical)"),
        (sequence_length >= 16, f"sequence_length={sequence_length}: use at least 16 (512 suits PubMedQA)"),
        (epochs >= 1, f"epochs={epochs}: use 1 or more"),
        (batch_size >= 1, f"batch_size={batch_size}: use 1 or more"),
        (learning_rate > 0, f"learning_rate={learning_rate}: use a positive value (1e-4 is typical for LoRA)"),
        (
            1 <= max_new_tokens < sequence_length,
            f"max_new_tokens={max_new_tokens}: use 1..sequence_length-1 ({sequence_length - 1})",
        ),
        (max_examples is None or max_examples >= 1, f"max_examples={max_examples}: use a positive number or None"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


@flow(name="gemma-lora", log_prints=True)
def gemma_lora(
    dataset: str = "pubmedqa",
    data_path: str | None = None,
    preset: str = presets.DEFAULT_PRESET,
    lora_rank: int = 4,
    sequence_length: int = 512,
    epochs: int = 1,
    batch_size: int = 4,
    learning_rate: float = 1e-4,
    accelerator: str = "cpu",
    max_examples: int | None = None,
    max_eval_examples: int | None = None,
    seed: int = 0,
    max_new_tokens: int = 64,
    eval_batch_size: int = 16,
    eval_before: bool = True,
    num_samples: int = 8,
    dtype: str = "auto",
    retries: int = 1,
    retrain: bool = False,
    forward_env: list[str] | None = None,
    requirements: list[str] | None = None,
    output_dir: str | None = None,
    cache_dir: str | None = None,
    download_merged_preset: bool = False,
    kill_after_epoch: int | None = None,
) -> dict:
    """LoRA fine-tuning of a Gemma 3 preset on ``dataset``; returns metrics before/after and the output files.

    ``dataset``: ``pubmedqa``, ``style-transfer`` (ParaDetox rude -> polite) or a JSONL file of
    ``{"prompt", "response"}`` pairs. ``data_path``: the PubMedQA folder / ``paradetox.tsv`` (default: the
    official downloads). ``preset``: a keras-hub Gemma 3 preset name (from Kaggle: needs ``KAGGLE_USERNAME``
    and ``KAGGLE_KEY``, forwarded to the job at run time), a local preset folder, or ``gs://bucket/folder/``.
    ``max_examples`` caps the training examples, ``max_eval_examples`` the held-out ones generated for.
    ``forward_env``: more caller variables for the job (names or globs, e.g. ``["WANDB_*"]``).
    ``kill_after_epoch`` is a test hook: the first job SIGKILLs itself after checkpointing that epoch.
    """
    from prefect.context import get_run_context

    _validate(lora_rank, sequence_length, epochs, batch_size, learning_rate, max_new_tokens, max_examples)
    ref = presets.resolve(preset)  # unknown names, bad folders: fail here, before any task
    env = presets.check_credentials(ref) + list(forward_env or [])

    prepared = _locate_and_prepare(dataset, data_path, _cache_dir(cache_dir), seed, max_examples, max_eval_examples)
    lengths = check_lengths(prepared, ref.as_dict(), sequence_length, max_new_tokens)

    config = dict(
        lora_rank=lora_rank,
        sequence_length=sequence_length,
        epochs=epochs,
        batch_size=batch_size,
        learning_rate=learning_rate,
        max_new_tokens=max_new_tokens,
        eval_batch_size=eval_batch_size,
        eval_before=eval_before,
        num_samples=num_samples,
        seed=seed,
        dtype=dtype,
        preset_name=preset,
    )
    preset_arg = Data(ref.value) if ref.kind in ("local", "gcs") else ref.value
    trainer = train.with_options(**_train_options(accelerator, retries, env, requirements, retrain))
    report_env = [name for name in env if not any(ch in name for ch in "*?[")]
    trained = trainer(
        Data(prepared["path"]),
        preset_arg,
        config,
        {"data": prepared["fingerprint"], "prepared": prepared["path"], "preset": ref.fingerprint},
        kill_after_epoch=kill_after_epoch,
        report_env=report_env,
    )
    metrics = evaluate(prepared["dataset"], trained)
    run_name = get_run_context().flow_run.name
    out = Path(output_dir or Path.cwd() / "gemma-outputs" / run_name).resolve()
    published = publish(
        prepared["dataset"], trained, metrics, prepared, lengths, str(out), num_samples, download_merged_preset
    )
    return _flow_result(metrics, prepared, lengths, trained, published, out)


def _locate_and_prepare(
    dataset: str,
    data_path: str | None,
    cache: str,
    seed: int,
    max_examples: int | None,
    max_eval_examples: int | None,
) -> dict:
    """The locate and prepare tasks; a cached preparation whose files are gone is prepared again, and no
    training examples at all fails here."""
    source = locate_data(dataset, data_path, cache)
    prepared = prepare_data(source, cache, seed, max_examples, max_eval_examples)
    if not (Path(prepared["path"]) / "train.jsonl").exists():  # the cache entry outlived its files
        prepared = prepare_data.with_options(refresh_cache=True)(source, cache, seed, max_examples, max_eval_examples)
    if prepared["sizes"]["train"] == 0:
        raise gd.GemmaDataError(f"{dataset}: no training examples after preparation ({prepared['available']})")
    return prepared


def _train_options(
    accelerator: str, retries: int, env: list[str], requirements: list[str] | None, retrain: bool
) -> dict:
    """``with_options`` of the train task: ``retrain`` refreshes its cache entry."""
    options: dict = dict(accelerator=accelerator, retries=retries, env=env)
    if requirements:
        options["requirements"] = requirements
    if retrain:
        options["refresh_cache"] = True
    return options


def _flow_result(metrics: dict, prepared: dict, lengths: dict, trained: dict, published: dict, out: Path) -> dict:
    return {
        "metric": metrics["metric"],
        "before": metrics["before"],
        "after": metrics["after"],
        "metrics": metrics,
        "sizes": prepared["sizes"],
        "token_stats": trained["token_stats"],
        "caller_lengths": lengths,
        "history": trained["history"],
        "epochs_run": trained["epochs_run"],
        "resumed_from_epoch": trained["resumed_from_epoch"],
        "ms_per_step": trained["ms_per_step"],
        "trainable_params": trained["trainable_params"],
        "total_params": trained["total_params"],
        "dtype": trained["dtype"],
        "files": published["files"],
        "output_dir": str(out),
        "merged_preset": published["merged_preset"],
        "lora_weights": published["lora_weights"],
        "samples": published["samples"],
        "env_seen": trained["env_seen"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Gemma 3 LoRA fine-tuning (PubMedQA, style transfer, JSONL pairs)")
    parser.add_argument("--dataset", default="pubmedqa", help="pubmedqa | style-transfer | PATH.jsonl")
    parser.add_argument("--data-path", default=None, help="PubMedQA folder or paradetox.tsv (default: download)")
    parser.add_argument("--preset", default=presets.DEFAULT_PRESET, help="preset name, local folder or gs://")
    parser.add_argument("--lora-rank", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--max-examples", type=int, default=None)
    parser.add_argument("--max-eval-examples", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--retrain", action="store_true", help="train even if a cached result exists")
    parser.add_argument("--download-merged-preset", action="store_true")
    args = parser.parse_args(argv)
    result = gemma_lora(
        dataset=args.dataset,
        data_path=args.data_path,
        preset=args.preset,
        lora_rank=args.lora_rank,
        sequence_length=args.sequence_length,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        accelerator=args.accelerator,
        max_examples=args.max_examples,
        max_eval_examples=args.max_eval_examples,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        output_dir=args.output_dir,
        retrain=args.retrain,
        download_merged_preset=args.download_merged_preset,
    )
    print(
        json.dumps(
            {
                k: result[k]
                for k in (
                    "metric",
                    "before",
                    "after",
                    "sizes",
                    "epochs_run",
                    "ms_per_step",
                    "trainable_params",
                    "total_params",
                    "merged_preset",
                    "output_dir",
                )
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
