"""EuroSAT on a group of hosts against one host (issue 13): the same flow, global batch and epochs on the dev zip,
once with hosts=1 (one job process) and once with hosts=2 (two job processes on this machine, data-parallel, one
jax.distributed group with gloo CPU collectives). Records test accuracy and wall times side by side.

    uv run --extra ml python bench/bench_eurosat_hosts.py [--epochs 5] [--batch-size 64] [--model-size hybrid-mini]
        -> bench/results/eurosat_hosts.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "flows"))
os.environ.setdefault("KERAS_BACKEND", "jax")
_home = Path(tempfile.mkdtemp(prefix="kinetic-bench-hosts-"))
os.environ.update(
    PREFECT_HOME=str(_home / "prefect-home"),
    KINETIC_CACHE_DIR=str(_home / "kinetic-cache"),
    PREFECT_SERVER_ANALYTICS_ENABLED="false",
)
os.environ.pop("PREFECT_API_URL", None)

DEV_ZIP = ROOT.parent / "shared" / "data" / "eurosat" / "EuroSAT_RGB_dev.zip"
RESULT = ROOT / "bench" / "results" / "eurosat_hosts.json"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--model-size", default="hybrid-mini")
    parser.add_argument("--order", default="1,2")
    args = parser.parse_args()
    import eurosat_vit

    settings = dict(
        source=str(DEV_ZIP),
        epochs=args.epochs,
        batch_size=args.batch_size,
        model_size=args.model_size,
        augment="dihedral",
        tta=False,
        seed=0,
        retries=0,
        early_stopping_patience=100,
        cache_dir=str(_home / "eurosat-cache"),
    )
    # decode + split once, outside the timed runs (both runs then read the same cached arrays)
    eurosat_vit.eurosat_vit(
        **{**settings, "epochs": 1, "train_limit": 128, "model_size": "tiny", "output_dir": str(_home / "warm")}
    )
    runs = {}
    for hosts in (int(h) for h in args.order.split(",")):
        load_before = os.getloadavg()
        started = time.perf_counter()
        result = eurosat_vit.eurosat_vit(**settings, hosts=hosts, output_dir=str(_home / f"out-{hosts}"))
        wall = time.perf_counter() - started
        runs[str(hosts)] = {
            "hosts": hosts,
            "test_accuracy": result["accuracy"],
            "macro_f1": result["macro_f1"],
            "epochs_run": result["epochs_run"],
            "flow_wall_s": round(wall, 1),
            "train_s": result["train_seconds"],
            "ms_per_step": result["ms_per_step"],
            "final_loss": result["history"]["loss"][-1],
            "val_accuracy": result["history"]["val_accuracy"],
            "load_avg_before": load_before,
            "load_avg_after": os.getloadavg(),
        }
        print(json.dumps(runs[str(hosts)]), flush=True)
        RESULT.write_text(json.dumps({"runs": runs}, indent=1))
    one, two = runs["1"], runs["2"]
    summary = {
        "what": "EuroSAT flow on the dev zip (split 18,364 / 2,293 / 2,293, seed 0), the same global batch and "
        "epochs, hosts=1 (one job process) vs hosts=2 (two job processes on this 2-core machine, "
        "data-parallel, jax.distributed with gloo CPU collectives); single-view test accuracy",
        "settings": {k: v for k, v in settings.items() if k not in ("source", "cache_dir")}
        | {"source": "../shared/data/eurosat/EuroSAT_RGB_dev.zip"},
        "accuracy_difference_points": round(100 * (two["test_accuracy"] - one["test_accuracy"]), 2),
        "train_time_ratio_2_over_1": round(two["train_s"] / one["train_s"], 2),
        "flow_wall_ratio_2_over_1": round(two["flow_wall_s"] / one["flow_wall_s"], 2),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "runs": runs,
    }
    RESULT.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
