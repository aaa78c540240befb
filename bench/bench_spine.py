"""Round-trip latency of a no-op remote call: kinetic-local against Prefect's own
``bind_flow_to_infrastructure`` path, side by side in one run, plus a cached call.

    uv run --extra dev python bench/bench_spine.py --calls 10

Both paths use the same dedicated Prefect server on this machine. Prefect's path gets its
cheapest configuration: a ProcessWorker, a local-copy bundle step and ``launcher=[python]``
(which skips ``uv pip freeze`` and ``uv run``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])

from bench.server import prefect_server  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "spine.json"))
    args = parser.parse_args()

    with prefect_server() as home:
        import warnings

        from prefect import flow, get_client
        from prefect.cache_policies import INPUTS
        from prefect.client.schemas.actions import WorkPoolCreate
        from prefect.client.schemas.objects import WorkPoolStorageConfiguration
        from prefect.flows import bind_flow_to_infrastructure
        from prefect.workers.process import ProcessWorker

        from kinetic_prefect import kinetic_task

        warnings.simplefilter("ignore", FutureWarning)  # Prefect's "ad-hoc submission is experimental"

        @kinetic_task(name="noop")
        def noop() -> None:
            return None

        @kinetic_task(name="noop-cached", cache_policy=INPUTS, persist_result=True)
        def noop_cached(x: int) -> int:
            return x

        @flow(name="native-noop", persist_result=True)  # same machine: local results are readable
        def native_noop() -> None:
            return None

        bundle_dir = home / "bundles"
        python = [sys.executable]
        with get_client(sync_client=True) as client:
            client.create_work_pool(
                WorkPoolCreate(
                    name="bench-process",
                    type="process",
                    base_job_template=ProcessWorker.get_default_base_job_template(),
                    storage_configuration=WorkPoolStorageConfiguration(
                        bundle_upload_step={
                            "bench.prefect_native.upload": {"launcher": python, "directory": str(bundle_dir)}
                        },
                        bundle_execution_step={
                            "bench.prefect_native.execute": {"launcher": python, "directory": str(bundle_dir)}
                        },
                    ),
                )
            )
        native = bind_flow_to_infrastructure(native_noop, "bench-process", ProcessWorker, launcher=python)

        def timed(fn, *a) -> float:
            start = time.perf_counter()
            fn(*a)
            return time.perf_counter() - start

        cold = {"kinetic": timed(noop), "native": timed(native)}
        kinetic, prefect_native = [], []
        for _ in range(args.calls):  # interleaved, so both paths see the same machine load
            kinetic.append(timed(noop))
            prefect_native.append(timed(native))
        noop_cached(1)
        cached = [timed(noop_cached, 1) for _ in range(args.calls)]

    result = {
        "calls": args.calls,
        "cold_s": cold,
        "kinetic_warm_median_s": statistics.median(kinetic),
        "prefect_native_warm_median_s": statistics.median(prefect_native),
        "ratio_native_over_kinetic": statistics.median(prefect_native) / statistics.median(kinetic),
        "cached_median_ms": statistics.median(cached) * 1000,
        "kinetic_s": kinetic,
        "prefect_native_s": prefect_native,
        "cached_s": cached,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_s") or "median" in k}, indent=2))


if __name__ == "__main__":
    main()
