"""EuroSAT ViT benchmarks.

    uv run --extra ml python bench/bench_eurosat.py full [--zip PATH] [--budget-min 62]   # (a) -> bench/results/eurosat.json
    uv run --extra ml python bench/bench_eurosat.py overhead [--epochs 2] [--train-limit 2048]  # (b) -> eurosat_overhead.json
    uv run --extra ml python bench/bench_eurosat.py measure [--zip PATH]                  # ms/step of a few configs

(a) trains the chosen recipe on the dev zip (split 80/10/10, stratified, seed 0) as a plain process, evaluates
on the held-out test split and records split sizes, epochs, wall time, test accuracy and macro F1.
(b) runs the same short training twice on the same data and epochs: once through ``@kinetic_task`` (a job
launched by the kinetic-local worker under an ephemeral Prefect server) and once as a plain Python
subprocess calling the same function, and reports the overhead side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "flows"))
os.environ.setdefault("KERAS_BACKEND", "jax")

RESULTS = ROOT / "bench" / "results"
DEV_ZIP = ROOT.parent / "shared" / "data" / "eurosat" / "EuroSAT_RGB_dev.zip"
DEV_SHA256 = "sha256:049d4bd3437d8f22293af23353f3e3a2b7336c95d8be3c34f46e4b12346b2e97"
SAMPLE_ZIP = ROOT.parent / "shared" / "data" / "eurosat" / "EuroSAT_RGB_sample.zip"

# The recipe (see flows/eurosat/model.py PRESETS["small"] and the measure subcommand).
RECIPE_MODEL = "small"
RECIPE_TRAIN = dict(
    epochs=40,
    batch_size=128,
    learning_rate=1e-3,
    min_learning_rate=1e-5,
    weight_decay=0.05,
    warmup_epochs=2,
    label_smoothing=0.1,
    augment=True,
    zoom=0.2,
    shift=0.1,
    color_jitter=0.1,
    mix_prob=0.0,
    early_stopping_patience=10,
    plateau_patience=4,
    tta=True,
    seed=0,
)


# Today's recipe as it was before the hybrid (the `small` preset, 8-way TTA scoring), and the new one.
TODAY_MODEL = {"preset": "small"}
TODAY_TRAIN = dict(
    batch_size=128,
    learning_rate=1e-3,
    min_learning_rate=1e-5,
    weight_decay=0.05,
    warmup_fraction=0.05,
    label_smoothing=0.1,
    augment=True,
    zoom=0.2,
    shift=0.1,
    color_jitter=0.1,
    mix_prob=0.0,
    plateau_patience=4,
    tta=True,
    seed=0,
)
NEW_MODEL = {"preset": "hybrid"}
# the cosine alone sets the rate: a ReduceLROnPlateau on top of it (today's recipe) had halved it 5 times in a
# 60-minute run (eurosat_compare_alone.json: 96.90 %; without it, eurosat_compare_trial_noplateau.json: 97.60 %)
NEW_TRAIN = dict(TODAY_TRAIN, learning_rate=2e-3, plateau_patience=0)


def _write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def _machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_avg_at_start": os.getloadavg(),
    }


def prepare_data(zip_path: Path, checksum: str | None, cache_dir: Path, seed: int = 0):
    from eurosat import dataset as ds

    t = time.perf_counter()
    fetched = ds.fetch(str(zip_path), checksum, cache_dir)
    decoded = ds.prepare(fetched, cache_dir)
    split_file, sizes = ds.save_split(decoded, 0.1, 0.1, seed, cache_dir)
    return decoded, split_file, sizes, time.perf_counter() - t


def cmd_full(args) -> None:
    from eurosat.model import PRESETS
    from eurosat.train import train_and_evaluate

    out = RESULTS / "eurosat.json"
    started = time.time()
    base = {
        "benchmark": "eurosat_vit_full",
        "status": "running",
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "data": str(args.zip),
        "machine": _machine(),
        "log": str(RESULTS / "eurosat_run.log"),
    }
    _write_json(out, base)
    decoded, split_file, sizes, prep_s = prepare_data(Path(args.zip), args.checksum, Path(args.cache_dir))
    print(f"data ready in {prep_s:.1f}s: {decoded.num_images} images, split {sizes}", flush=True)
    model_cfg = PRESETS[args.model].as_dict()
    train_cfg = dict(RECIPE_TRAIN, epochs=args.epochs, time_budget_s=args.budget_min * 60)
    work = Path(tempfile.mkdtemp(prefix="eurosat-full-"))
    result = train_and_evaluate(
        decoded.path,
        split_file,
        model_cfg,
        train_cfg,
        output_dir=args.output_dir or work / "out",
        checkpoint_dir=work / "checkpoints",
    )
    m = result["metrics"]
    summary = {
        **base,
        "status": "done",
        "wall_seconds": round(time.time() - started, 1),
        "data_prep_seconds": round(prep_s, 1),
        "split_sizes": result["split_sizes"],
        "epochs_run": result["epochs_run"],
        "epochs_cap": args.epochs,
        "best_epoch": result["best_epoch"],
        "stopped_by_time_budget": result["stopped_by_time_budget"],
        "time_budget_s": train_cfg["time_budget_s"],
        "train_seconds": result["train_seconds"],
        "eval_seconds": result["eval_seconds"],
        "ms_per_step": result["ms_per_step"],
        "steps_per_epoch": result["steps_per_epoch"],
        "batch_size": train_cfg["batch_size"],
        "parameters": result["parameters"],
        "test_accuracy": m["accuracy"],
        "macro_f1": m["macro_f1"],
        "weighted_f1": m["weighted_f1"],
        "per_class": m["per_class"],
        "confusion_matrix": m["confusion_matrix"],
        "class_names": m["class_names"],
        "model": {"preset": args.model, **result["model_config"]},
        "train": result["train_config"],
        "history": result["history"],
        "epoch_seconds": result["epoch_seconds"],
        "outputs": result["output_dir"],
    }
    _write_json(out, summary)
    print(
        json.dumps(
            {
                k: summary[k]
                for k in ("split_sizes", "epochs_run", "wall_seconds", "test_accuracy", "macro_f1", "ms_per_step")
            }
        ),
        flush=True,
    )


def _curve_at(curve: list[dict], seconds: float) -> dict | None:
    """The last curve point at or before ``seconds`` of training clock (what the run had by then)."""
    before = [p for p in curve if p["train_clock_s"] <= seconds]
    return before[-1] if before else None


def _first_reaching(curve: list[dict], accuracy: float) -> dict | None:
    return next((p for p in curve if p["test_accuracy"] >= accuracy), None)


def plot_time_to_accuracy(runs: dict, path: Path) -> None:
    from eurosat.metrics import _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, run in runs.items():
        curve = run.get("curve") or []
        if curve:
            ax.plot(
                [p["train_clock_s"] / 60 for p in curve],
                [100 * p["test_accuracy"] for p in curve],
                marker="o",
                ms=3,
                label=label,
            )
    for y, style in ((90, ":"), (97, "--")):
        ax.axhline(y, color="grey", ls=style, lw=1)
    for x in (15, 60):
        ax.axvline(x, color="grey", ls=":", lw=1)
    ax.set_ylim(40, 100)
    ax.set_xlabel("training time, minutes (2 shared CPU cores)")
    ax.set_ylabel("test accuracy, % (single view, after each epoch)")
    ax.set_title("EuroSAT: time to accuracy on the held-out test split")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    _save(fig, path)


def cmd_compare(args) -> None:
    """Time-to-accuracy of the new recipe and today's, one after the other in one process, on the dev split.

    Each run logs test accuracy / macro F1 (single view) after every epoch against its training clock (the
    clock pauses while the curve point is computed). The new recipe trains for ``--budget-min`` minutes;
    today's recipe is run with the same budget's schedule but stopped after ``--baseline-min`` minutes
    (its 60-minute end point is in eurosat_run1/run2.json) unless ``--baseline-min`` equals the budget.
    """
    from eurosat.train import train_and_evaluate

    out = RESULTS / f"{args.out}.json"
    summary = {
        "benchmark": "eurosat_time_to_accuracy",
        "status": "running",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "data": "EuroSAT_RGB_dev.zip (../shared/data/eurosat)",
        "machine": _machine(),
        "budget_min": args.budget_min,
        "baseline_min": args.baseline_min,
        "runs": {},
    }
    decoded, split_file, sizes, _ = prepare_data(Path(args.zip), args.checksum, Path(args.cache_dir))
    summary["split_sizes"] = sizes
    plan = {
        "new": (args.new_model or NEW_MODEL, dict(NEW_TRAIN, **(args.new_train or {})), args.budget_min),
        "today": (TODAY_MODEL, dict(TODAY_TRAIN), args.baseline_min),
    }
    for name in args.order.split(","):
        model, train, stop_min = plan[name]
        train.update(time_budget_s=args.budget_min * 60, epochs=200, early_stopping_patience=1000)
        if stop_min < args.budget_min:
            train["stop_after_s"] = stop_min * 60
        work = Path(tempfile.mkdtemp(prefix=f"eurosat-compare-{name}-"))
        t = time.time()
        print(f"== {name}: model {model}, train {train}", flush=True)
        result = train_and_evaluate(
            decoded.path,
            split_file,
            model,
            train,
            output_dir=work / "out",
            checkpoint_dir=work / "ckpt",
            test_curve=True,
        )
        state = json.loads((work / "ckpt" / "state.json").read_text())
        curve = state.get("curve", [])
        m = result["metrics"]
        run = {
            "model": result["model_config"],
            "model_request": model,
            "train": result["train_config"],
            "parameters": result["parameters"],
            "wall_seconds": round(time.time() - t, 1),
            "train_seconds": result["train_seconds"],
            "epochs_run": result["epochs_run"],
            "ms_per_step": result["ms_per_step"],
            "steps_per_epoch": result["steps_per_epoch"],
            "final": {
                "scoring": m["scoring"],
                "accuracy": m["accuracy"],
                "macro_f1": m["macro_f1"],
                "weighted_f1": m["weighted_f1"],
                "single_view": m["single_view"],
                "scoring_ms_per_image": m["scoring_ms_per_image"],
                "per_class": m["per_class"],
                "confusion_matrix": m["confusion_matrix"],
            },
            "at_15_min": _curve_at(curve, 15 * 60),
            "at_60_min": _curve_at(curve, 60 * 60),
            "first_90": _first_reaching(curve, 0.90),
            "first_97": _first_reaching(curve, 0.97),
            "curve": curve,
            "history": result["history"],
            "epoch_seconds": result["epoch_seconds"],
            "load_avg_after": os.getloadavg(),
        }
        summary["runs"][name] = run
        _write_json(out, summary)
        plot_time_to_accuracy(summary["runs"], RESULTS / f"{args.out.replace('compare', 'time_to_accuracy')}.png")
        print(
            json.dumps({k: run[k] for k in ("final", "at_15_min", "at_60_min", "first_90", "first_97")}, default=str)[
                :2000
            ],
            flush=True,
        )
    summary["status"] = "done"
    summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _write_json(out, summary)


FIRST_COMMAND = [
    "uv",
    "run",
    "--extra",
    "ml",
    "python",
    "flows/eurosat_vit.py",
    "run",
    "--source",
    "../shared/data/eurosat/EuroSAT_RGB_dev.zip",
    "--time-budget-minutes",
    "1.5",
    "--model-size",
    "hybrid-mini",
    "--batch-size",
    "64",
    "--augment",
    "dihedral",
]


def cmd_first(args) -> None:
    """The README's first command, timed from the shell's point of view (uv, Prefect's temporary server,
    fetch/decode/split, the kinetic job, evaluation, publishing), cold: a fresh kinetic cache (so decoding and
    the data upload are paid) and a fresh Prefect home. Appends one run to eurosat_first_command.json."""
    import re

    out = RESULTS / "eurosat_first_command.json"
    record = json.loads(out.read_text()) if out.exists() else {"command": " ".join(FIRST_COMMAND), "runs": []}
    record["command"] = " ".join(FIRST_COMMAND)
    work = Path(tempfile.mkdtemp(prefix="eurosat-first-"))
    env = {
        **os.environ,
        "KINETIC_CACHE_DIR": str(work / "kinetic-cache"),
        "PREFECT_HOME": str(work / "prefect-home"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    for key in ("PREFECT_API_URL", "KINETIC_STORE", "EUROSAT_CACHE_DIR"):
        env.pop(key, None)
    load_before = os.getloadavg()
    t = time.perf_counter()
    proc = subprocess.run(
        FIRST_COMMAND + ["--output-dir", str(work / "out")], cwd=ROOT, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - t
    text = proc.stdout + proc.stderr
    (work / "log.txt").write_text(text)
    if proc.returncode != 0:
        raise RuntimeError(f"the first command failed ({proc.returncode}):\n{text[-3000:]}")
    start = text.index('{\n "accuracy"')
    summary = json.loads(text[start : text.index("\n}", start) + 2])
    epochs = re.findall(r"epoch (\d+)/\d+ .*?val_acc=([0-9.]+) .*?\(([0-9]+) ms/step\)", text)
    run = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(FIRST_COMMAND),
        "wall_seconds": round(wall, 1),
        "test_accuracy": summary["accuracy"],
        "macro_f1": summary["macro_f1"],
        "epochs_run": summary["epochs_run"],
        "split_sizes": summary["split_sizes"],
        "ms_per_step_by_epoch": [int(e[2]) for e in epochs],
        "printed_where_to_look": all(k in text for k in ("model:", "plots:", "metrics:", "prefect server start")),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
    }
    record["runs"].append(run)
    _write_json(out, record)
    print(json.dumps(run), flush=True)


def cmd_predict_check(args) -> None:
    """`predict` on the dev split's test images, written back as the original JPEG files, against the accuracy
    the flow published for that model (its metrics.json): both with the model's own scoring and single view."""
    import zipfile

    import eurosat_vit
    from eurosat import dataset as ds

    decoded, split_file, sizes, _ = prepare_data(Path(args.zip), args.checksum, Path(args.cache_dir))
    _images, labels, meta = ds.load_decoded(decoded.path)
    folder = Path(tempfile.mkdtemp(prefix="eurosat-predict-check-"))
    truth = {}
    with zipfile.ZipFile(args.zip) as zf:
        for i in ds.load_split(split_file)["test"]:
            member = meta["files"][i]
            (folder / member.split("/")[-1]).write_bytes(zf.read(member))
            truth[member.split("/")[-1]] = int(labels[i])
    published = json.loads((Path(args.model).parent / "metrics.json").read_text())["metrics"]
    names = list(ds.CLASS_NAMES)
    result = {
        "images": len(truth),
        "published": {
            "scoring": published.get("scoring"),
            "accuracy": published["accuracy"],
            "single_view": published.get("single_view"),
        },
        "predict": {},
    }
    for label, tta in (("model's scoring (default)", None), ("--no-tta", False)):
        t = time.perf_counter()
        rows = eurosat_vit.predict(args.model, folder, tta=tta)
        seconds = time.perf_counter() - t
        accuracy = round(sum(names.index(r["class"]) == truth[r["file"]] for r in rows) / len(rows), 4)
        result["predict"][label] = {
            "accuracy": accuracy,
            "seconds_including_decode": round(seconds, 1),
            "ms_per_image": round(1000 * seconds / len(rows), 2),
        }
    result["load_avg"] = [round(x, 2) for x in os.getloadavg()]
    _write_json(RESULTS / f"{args.out}.json", result)
    print(json.dumps(result), flush=True)


def cmd_measure(args) -> None:
    """ms/step of candidate configurations on real (sample) batches through the real input pipeline."""

    from eurosat import dataset as ds
    from eurosat.model import ViTConfig
    from eurosat.train import TrainConfig, build_compiled_model, make_batches

    decoded, split_file, sizes, _ = prepare_data(Path(args.zip), None, Path(args.cache_dir))
    images, labels, _ = ds.load_decoded(decoded.path)
    candidates = {
        "seed  p8 d64x4 (no stem)": (ViTConfig(patch_size=8, dim=64, depth=4, heads=4, dropout=0.1), 32),
        "seed  p8 d64x4 (no stem) b128": (ViTConfig(patch_size=8, dim=64, depth=4, heads=4, dropout=0.0), 128),
        "p4 d64x4 (256 tokens) b128": (ViTConfig(patch_size=4, dim=64, depth=4, heads=4, dropout=0.0), 128),
        "stem32-64 p2 d64x4 b128": (
            ViTConfig(patch_size=2, dim=64, depth=4, heads=4, stem_channels=(32, 64), dropout=0.0),
            128,
        ),
        "stem32-64 p2 d96x4 b128 (small: the recipe)": (
            ViTConfig(patch_size=2, dim=96, depth=4, heads=4, stem_channels=(32, 64), dropout=0.0),
            128,
        ),
        "stem32-64 p2 d96x6 b128 (medium)": (
            ViTConfig(patch_size=2, dim=96, depth=6, heads=4, stem_channels=(32, 64), dropout=0.0),
            128,
        ),
    }
    rows = []
    for name, (mcfg, bs) in candidates.items():
        cfg = TrainConfig(batch_size=bs, epochs=1)
        model = build_compiled_model(mcfg, cfg, (128, 128, 128), (64, 64, 64))
        batches = make_batches(images, labels, cfg, 10)
        steps = min(args.steps, len(batches))
        x, y = batches[0]
        model.train_on_batch(x, y)  # compile
        t = time.perf_counter()
        for i in range(1, steps + 1):
            x, y = batches[i % len(batches)]
            model.train_on_batch(x, y)
        dt = (time.perf_counter() - t) / steps
        row = {
            "config": name,
            "batch_size": bs,
            "ms_per_step": round(1000 * dt, 1),
            "ms_per_image": round(1000 * dt / bs, 2),
            "parameters": int(model.count_params()),
            "tokens": mcfg.tokens,
            "est_epoch_s_dev_train_18360": round(18360 * dt / bs, 1),
            "load_avg": round(os.getloadavg()[0], 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    _write_json(RESULTS / "eurosat_configs.json", {"machine": _machine(), "steps": args.steps, "rows": rows})


_PLAIN_SCRIPT = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from eurosat.train import train_and_evaluate
args = json.loads(sys.argv[2])
result = train_and_evaluate(**args)
print("RESULT " + json.dumps({k: result[k] for k in ("train_seconds", "eval_seconds", "total_seconds", "epochs_run",
                                                     "ms_per_step", "split_sizes")} | {"accuracy": result["metrics"]["accuracy"]}))
"""


def _plain_run(call: dict, work: Path) -> dict:
    """The training function called by a plain Python script (a fresh interpreter, like the job)."""
    args = dict(call, output_dir=str(work / "out"), checkpoint_dir=str(work / "ckpt"))
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _PLAIN_SCRIPT, str(ROOT / "flows"), json.dumps(args)],
        capture_output=True,
        text=True,
        env={**os.environ, "KERAS_BACKEND": "jax"},
    )
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"plain run failed:\n{proc.stderr[-3000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return {"wall_seconds": round(wall, 2), **json.loads(line[len("RESULT ") :])}


def _kinetic_run(call: dict, label: str) -> dict:
    """The same call through @kinetic_task: a job launched by the kinetic-local worker, inside a flow."""
    import eurosat_vit
    from prefect import flow

    from kinetic_prefect import Data

    @flow(name=f"eurosat-overhead-{label}")
    def overhead_flow() -> dict:
        t = time.perf_counter()
        result = eurosat_vit.train.with_options(retries=0)(
            Data(call["dataset_dir"]),
            Data(call["split_file"]),
            call["model_config"],
            call["train_config"],
            train_limit=call["train_limit"],
        )
        wall = time.perf_counter() - t
        return {
            "wall_seconds": round(wall, 2),
            **{
                k: result[k]
                for k in ("train_seconds", "eval_seconds", "total_seconds", "epochs_run", "ms_per_step", "split_sizes")
            },
            "accuracy": result["metrics"]["accuracy"],
        }

    t = time.perf_counter()
    out = overhead_flow()
    out["flow_wall_seconds"] = round(time.perf_counter() - t, 2)
    return out


def cmd_overhead(args) -> None:
    """(b) the same short training through @kinetic_task and as a plain script, alternating, side by side."""
    from eurosat.model import PRESETS

    work = Path(tempfile.mkdtemp(prefix="eurosat-overhead-"))
    # A private Prefect home and kinetic cache: an ephemeral Prefect server and a cold artifact store.
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect-home"))
    os.environ.setdefault("KINETIC_CACHE_DIR", str(work / "kinetic-cache"))
    os.environ.pop("KINETIC_STORE", None)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    decoded, split_file, sizes, _ = prepare_data(Path(args.zip), args.checksum, Path(args.cache_dir))
    train_cfg = dict(RECIPE_TRAIN, epochs=args.epochs, tta=False, early_stopping_patience=100)
    call = {
        "dataset_dir": decoded.path,
        "split_file": split_file,
        "model_config": PRESETS[args.model].as_dict(),
        "train_config": train_cfg,
        "train_limit": args.train_limit,
    }
    runs = []
    for rep in range(args.repeats):
        for mode in ("kinetic", "plain"):
            print(f"repeat {rep + 1}/{args.repeats}: {mode} ...", flush=True)
            r = _plain_run(call, work / f"plain-{rep}") if mode == "plain" else _kinetic_run(call, f"r{rep}")
            r.update(mode=mode, repeat=rep + 1, load_avg=round(os.getloadavg()[0], 2))
            print(json.dumps(r), flush=True)
            runs.append(r)

    def mean(mode, key, skip_first=False):
        vals = [r[key] for r in runs if r["mode"] == mode and not (skip_first and r["repeat"] == 1)]
        return round(sum(vals) / len(vals), 2) if vals else None

    kin, plain = mean("kinetic", "wall_seconds"), mean("plain", "wall_seconds")
    summary = {
        "benchmark": "eurosat_vit_kinetic_overhead",
        "machine": _machine(),
        "data": str(args.zip),
        "model": args.model,
        "epochs": args.epochs,
        "train_images": args.train_limit,
        "split_sizes_used": runs[0]["split_sizes"] | {"train": args.train_limit},
        "runs": runs,
        "side_by_side": {
            "plain_script_wall_s": plain,
            "kinetic_task_wall_s": kin,
            "overhead_s": round(kin - plain, 2),
            "overhead_pct": round(100 * (kin - plain) / plain, 1),
            "kinetic_warm_wall_s": mean("kinetic", "wall_seconds", skip_first=True),
            "train_seconds_plain": mean("plain", "train_seconds"),
            "train_seconds_kinetic": mean("kinetic", "train_seconds"),
        },
        "notes": "wall = from the call to the value: plain = a fresh `python -c` interpreter calling train_and_evaluate "
        "(imports, compile, train, evaluate, save); kinetic = the @kinetic_task call inside a flow (payload, "
        "data hashing/upload to the store - cold on repeat 1, content-addressed afterwards - job launch by the "
        "kinetic-local worker, the same function, outputs upload, result). The ephemeral Prefect server's "
        "start-up is outside both (flow_wall_seconds includes it).",
    }
    _write_json(RESULTS / "eurosat_overhead.json", summary)
    print(json.dumps(summary["side_by_side"], indent=1), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    full = sub.add_parser("full")
    full.add_argument("--zip", default=str(DEV_ZIP))
    full.add_argument("--checksum", default=DEV_SHA256)
    full.add_argument("--model", default=RECIPE_MODEL)
    full.add_argument("--epochs", type=int, default=RECIPE_TRAIN["epochs"])
    full.add_argument("--budget-min", type=float, default=62.0, help="training time budget (cosine is fitted to it)")
    full.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "eurosat-bench-cache"))
    full.add_argument("--output-dir", default=None)
    measure = sub.add_parser("measure")
    measure.add_argument("--zip", default=str(SAMPLE_ZIP))
    measure.add_argument("--steps", type=int, default=6)
    measure.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "eurosat-bench-cache"))
    over = sub.add_parser("overhead")
    over.add_argument("--zip", default=str(DEV_ZIP))
    over.add_argument("--checksum", default=DEV_SHA256)
    over.add_argument("--model", default=RECIPE_MODEL)
    over.add_argument("--epochs", type=int, default=2)
    over.add_argument("--train-limit", type=int, default=2048)
    over.add_argument("--repeats", type=int, default=2)
    over.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "eurosat-bench-cache"))
    comp = sub.add_parser("compare")
    comp.add_argument("--zip", default=str(DEV_ZIP))
    comp.add_argument("--checksum", default=DEV_SHA256)
    comp.add_argument("--budget-min", type=float, default=60.0)
    comp.add_argument("--baseline-min", type=float, default=15.0)
    comp.add_argument("--order", default="new,today")
    comp.add_argument(
        "--new-model",
        type=json.loads,
        default=None,
        help='JSON model options for the new recipe (a trial), e.g. \'{"preset": "hybrid", "depth": 6}\'',
    )
    comp.add_argument(
        "--new-train",
        type=json.loads,
        default=None,
        help="JSON training options over the new recipe's (a trial), e.g. '{\"plateau_patience\": 1000}'",
    )
    comp.add_argument(
        "--out", default="eurosat_compare", help="results name under bench/results (png: *_time_to_accuracy*)"
    )
    comp.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "eurosat-bench-cache"))
    sub.add_parser("first")
    pc = sub.add_parser("predict-check")
    pc.add_argument("model", help="a .keras saved by the flow or `compare` (metrics.json beside it)")
    pc.add_argument("--zip", default=str(DEV_ZIP))
    pc.add_argument("--checksum", default=DEV_SHA256)
    pc.add_argument("--out", default="eurosat_predict_check")
    pc.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "eurosat-bench-cache"))
    args = parser.parse_args()
    {
        "first": cmd_first,
        "predict-check": cmd_predict_check,
        "full": cmd_full,
        "measure": cmd_measure,
        "overhead": cmd_overhead,
        "compare": cmd_compare,
    }[args.cmd](args)


if __name__ == "__main__":
    main()
