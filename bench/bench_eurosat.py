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
RECIPE_TRAIN = dict(epochs=40, batch_size=128, learning_rate=1e-3, min_learning_rate=1e-5, weight_decay=0.05,
                    warmup_epochs=2, label_smoothing=0.1, augment=True, zoom=0.2, shift=0.1, color_jitter=0.1,
                    mix_prob=0.0, early_stopping_patience=10, plateau_patience=4, tta=True, seed=0)


def _write_json(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def _machine() -> dict:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_avg_at_start": os.getloadavg()}


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
    base = {"benchmark": "eurosat_vit_full", "status": "running", "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "data": str(args.zip), "machine": _machine(),
            "log": str(RESULTS / "eurosat_run.log")}
    _write_json(out, base)
    decoded, split_file, sizes, prep_s = prepare_data(Path(args.zip), args.checksum, Path(args.cache_dir))
    print(f"data ready in {prep_s:.1f}s: {decoded.num_images} images, split {sizes}", flush=True)
    model_cfg = PRESETS[args.model].as_dict()
    train_cfg = dict(RECIPE_TRAIN, epochs=args.epochs, time_budget_s=args.budget_min * 60)
    work = Path(tempfile.mkdtemp(prefix="eurosat-full-"))
    result = train_and_evaluate(decoded.path, split_file, model_cfg, train_cfg, output_dir=args.output_dir or work / "out",
                                checkpoint_dir=work / "checkpoints")
    m = result["metrics"]
    summary = {
        **base, "status": "done",
        "wall_seconds": round(time.time() - started, 1),
        "data_prep_seconds": round(prep_s, 1),
        "split_sizes": result["split_sizes"],
        "epochs_run": result["epochs_run"], "epochs_cap": args.epochs, "best_epoch": result["best_epoch"],
        "stopped_by_time_budget": result["stopped_by_time_budget"], "time_budget_s": train_cfg["time_budget_s"],
        "train_seconds": result["train_seconds"], "eval_seconds": result["eval_seconds"],
        "ms_per_step": result["ms_per_step"], "steps_per_epoch": result["steps_per_epoch"],
        "batch_size": train_cfg["batch_size"], "parameters": result["parameters"],
        "test_accuracy": m["accuracy"], "macro_f1": m["macro_f1"], "weighted_f1": m["weighted_f1"],
        "per_class": m["per_class"], "confusion_matrix": m["confusion_matrix"], "class_names": m["class_names"],
        "model": {"preset": args.model, **result["model_config"]}, "train": result["train_config"],
        "history": result["history"], "epoch_seconds": result["epoch_seconds"],
        "outputs": result["output_dir"],
    }
    _write_json(out, summary)
    print(json.dumps({k: summary[k] for k in ("split_sizes", "epochs_run", "wall_seconds", "test_accuracy",
                                              "macro_f1", "ms_per_step")}), flush=True)


def cmd_measure(args) -> None:
    """ms/step of candidate configurations on real (sample) batches through the real input pipeline."""
    import keras
    import numpy as np

    from eurosat import dataset as ds
    from eurosat.model import ViTConfig
    from eurosat.train import TrainConfig, build_compiled_model, make_batches

    decoded, split_file, sizes, _ = prepare_data(Path(args.zip), None, Path(args.cache_dir))
    images, labels, _ = ds.load_decoded(decoded.path)
    candidates = {
        "seed  p8 d64x4 (no stem)": (ViTConfig(patch_size=8, dim=64, depth=4, heads=4, dropout=0.1), 32),
        "seed  p8 d64x4 (no stem) b128": (ViTConfig(patch_size=8, dim=64, depth=4, heads=4, dropout=0.0), 128),
        "p4 d64x4 (256 tokens) b128": (ViTConfig(patch_size=4, dim=64, depth=4, heads=4, dropout=0.0), 128),
        "stem32-64 p2 d64x4 b128": (ViTConfig(patch_size=2, dim=64, depth=4, heads=4, stem_channels=(32, 64),
                                              dropout=0.0), 128),
        "stem32-64 p2 d96x4 b128 (small: the recipe)": (ViTConfig(patch_size=2, dim=96, depth=4, heads=4,
                                                                  stem_channels=(32, 64), dropout=0.0), 128),
        "stem32-64 p2 d96x6 b128 (medium)": (ViTConfig(patch_size=2, dim=96, depth=6, heads=4,
                                                       stem_channels=(32, 64), dropout=0.0), 128),
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
        row = {"config": name, "batch_size": bs, "ms_per_step": round(1000 * dt, 1),
               "ms_per_image": round(1000 * dt / bs, 2), "parameters": int(model.count_params()),
               "tokens": mcfg.tokens, "est_epoch_s_dev_train_18360": round(18360 * dt / bs, 1),
               "load_avg": round(os.getloadavg()[0], 2)}
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
    proc = subprocess.run([sys.executable, "-c", _PLAIN_SCRIPT, str(ROOT / "flows"), json.dumps(args)],
                          capture_output=True, text=True, env={**os.environ, "KERAS_BACKEND": "jax"})
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"plain run failed:\n{proc.stderr[-3000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return {"wall_seconds": round(wall, 2), **json.loads(line[len("RESULT "):])}


def _kinetic_run(call: dict, label: str) -> dict:
    """The same call through @kinetic_task: a job launched by the kinetic-local worker, inside a flow."""
    from prefect import flow

    import eurosat_vit
    from kinetic_prefect import Data

    @flow(name=f"eurosat-overhead-{label}")
    def overhead_flow() -> dict:
        t = time.perf_counter()
        result = eurosat_vit.train.with_options(retries=0)(
            Data(call["dataset_dir"]), Data(call["split_file"]), call["model_config"], call["train_config"],
            train_limit=call["train_limit"])
        wall = time.perf_counter() - t
        return {"wall_seconds": round(wall, 2), **{k: result[k] for k in (
            "train_seconds", "eval_seconds", "total_seconds", "epochs_run", "ms_per_step", "split_sizes")},
            "accuracy": result["metrics"]["accuracy"]}

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
    call = {"dataset_dir": decoded.path, "split_file": split_file, "model_config": PRESETS[args.model].as_dict(),
            "train_config": train_cfg, "train_limit": args.train_limit}
    runs = []
    for rep in range(args.repeats):
        for mode in ("kinetic", "plain"):
            print(f"repeat {rep + 1}/{args.repeats}: {mode} ...", flush=True)
            if mode == "plain":
                r = _plain_run(call, work / f"plain-{rep}")
            else:
                r = _kinetic_run(call, f"r{rep}")
            r.update(mode=mode, repeat=rep + 1, load_avg=round(os.getloadavg()[0], 2))
            print(json.dumps(r), flush=True)
            runs.append(r)

    def mean(mode, key, skip_first=False):
        vals = [r[key] for r in runs if r["mode"] == mode and not (skip_first and r["repeat"] == 1)]
        return round(sum(vals) / len(vals), 2) if vals else None

    kin, plain = mean("kinetic", "wall_seconds"), mean("plain", "wall_seconds")
    summary = {
        "benchmark": "eurosat_vit_kinetic_overhead", "machine": _machine(),
        "data": str(args.zip), "model": args.model, "epochs": args.epochs, "train_images": args.train_limit,
        "split_sizes_used": runs[0]["split_sizes"] | {"train": args.train_limit},
        "runs": runs,
        "side_by_side": {
            "plain_script_wall_s": plain, "kinetic_task_wall_s": kin,
            "overhead_s": round(kin - plain, 2), "overhead_pct": round(100 * (kin - plain) / plain, 1),
            "kinetic_warm_wall_s": mean("kinetic", "wall_seconds", skip_first=True),
            "train_seconds_plain": mean("plain", "train_seconds"), "train_seconds_kinetic": mean("kinetic", "train_seconds"),
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
    args = parser.parse_args()
    {"full": cmd_full, "measure": cmd_measure, "overhead": cmd_overhead}[args.cmd](args)


if __name__ == "__main__":
    main()
