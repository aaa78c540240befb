"""Sweeps at scale (issue 20): a ``.map()`` against one call and against a loop, scaling, and 16 slots of sleeps.

    uv run python bench/bench_sweeps.py [--databases sqlite postgresql] [--repeats 3] [--modes warm cold]

For each database (a dedicated Prefect server on SQLite, then on a throw-away PostgreSQL cluster) and each mode,
in-process submission:

- ``default``: a newcomer's pool, nothing set (a fan-out rides in the default number of slots);
- ``warm``: warm runners (keep_warm_seconds=60), the default number of slots;
- ``cold``: the path before slots: a process and a job run per call (KINETIC_SWEEP_SLOTS=0);

and in each mode:

- pairs, interleaved in each repeat: one no-op call, ``.map()`` over 64 no-op inputs, 64 sequential calls
  (goals: map ≤ 4× one call, ≥ 4× faster than the loop);
- scaling: ``.map()`` over 16 / 64 / 256 inputs; added wall time per input against one call (goal ≤ 5 %), and
  nothing lost: every value returned, every job run final;
- ``.map()`` over 16 five-second sleeps with 16 slots against one such call (goal ≤ 1.5×).

Medians of ``--repeats``; results in ``bench/results/sweeps.json`` (no machine paths).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
os.environ.setdefault("KINETIC_UNSIGNED_OK", "1")
os.environ["KINETIC_IN_PROCESS_CONCURRENCY"] = "16"  # 16 slots (the sleep benchmark), the same for every case

from bench.server import prefect_server  # noqa: E402

MODES = {  # the task's job variables, the slot count (None: the default)
    "default": ({}, None),
    "warm": ({"keep_warm_seconds": 60}, None),
    "cold": ({"keep_warm_seconds": 0}, "0"),
}


def use_slots(count: str | None) -> None:
    if count is None:
        os.environ.pop("KINETIC_SWEEP_SLOTS", None)
    else:
        os.environ["KINETIC_SWEEP_SLOTS"] = count


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


failures: list[str] = []


def attempt(label: str, fn) -> float | None:
    """``timed(fn)``, or None with the failure recorded (on SQLite under load a fan-out's writes can exhaust
    their retries with 503 "database is locked": that is a result, not a reason to lose the others)."""
    try:
        return timed(fn)
    except Exception as exc:  # noqa: BLE001 - recorded in the results
        failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
        print("FAILED", failures[-1], flush=True)
        return None


def median(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def job_runs_final(name: str) -> tuple[int, int]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    runs: list = []
    with get_client(sync_client=True) as client:
        while True:  # the API returns at most 200 runs a page
            page = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[name])), limit=200, offset=len(runs)
            )
            runs += page
            if len(page) < 200:
                break
    return len(runs), sum(1 for r in runs if r.state is not None and r.state.is_final())


def run_mode(mode: str, repeats: int, sizes: list[int]) -> dict:
    from prefect import flow

    from kinetic_prefect import kinetic_task

    tag = uuid.uuid4().hex[:6]
    variables, slots = MODES[mode]
    use_slots(slots)

    @kinetic_task(name=f"noop-{mode}-{tag}", submission="in-process", job_variables=variables)
    def noop(i: int) -> int:
        return i

    @kinetic_task(name=f"sleep-{mode}-{tag}", submission="in-process", job_variables=variables)
    def sleep5(i: int) -> int:
        import time as _time

        _time.sleep(5)
        return i

    @flow
    def one():
        return noop(0)

    @flow
    def fan_out(n: int):
        return noop.map(range(n)).result()

    @flow
    def loop(n: int):
        return [noop(i) for i in range(n)]

    @flow
    def one_sleep():
        return sleep5(0)

    @flow
    def sleeps(n: int):
        return sleep5.map(range(n)).result()

    one()  # warm-up: the pool, the project archive, the server's caches
    samples: dict[str, list[float | None]] = {"one_call": [], "map_64": [], "sequential_64": []}
    for _ in range(repeats):
        samples["one_call"].append(attempt(f"{mode} one call", one))
        samples["map_64"].append(attempt(f"{mode} map 64", lambda: fan_out(64)))
        samples["sequential_64"].append(attempt(f"{mode} sequential 64", lambda: loop(64)))
        print(mode, {k: v[-1] and round(v[-1], 2) for k, v in samples.items()}, flush=True)
    medians = {k: median(v) for k, v in samples.items()}
    from kinetic_prefect.caller import slots as sweep_slots

    report: dict = {
        "slots_per_sweep": sweep_slots.slot_count(),
        "samples_s": {k: [x and round(x, 3) for x in v] for k, v in samples.items()},
        "median_s": {k: v and round(v, 3) for k, v in medians.items()},
        "map_64_over_one_call": ratio(medians["map_64"], medians["one_call"]),
        "sequential_64_over_map_64": ratio(medians["sequential_64"], medians["map_64"]),
    }

    if not sizes:  # the pairs alone (the cold mode's figures are the before)
        return report
    scaling = {}
    for n in sizes:
        values: list[int] = []
        wall = attempt(f"{mode} scaling {n}", lambda values=values, n=n: values.extend(fan_out(n)))
        scaling[n] = {"wall_s": wall and round(wall, 3), "values_ok": values == list(range(n))}
        print(mode, "scaling", n, scaling[n], flush=True)
    made, final = job_runs_final(noop.name)
    low, high = min(sizes), max(sizes)
    if scaling[high]["wall_s"] is not None and scaling[low]["wall_s"] is not None:
        per_input = (scaling[high]["wall_s"] - scaling[low]["wall_s"]) / (high - low)
        report["added_per_input_s"] = round(per_input, 4)
        report["added_per_input_over_one_call"] = ratio(per_input, medians["one_call"])
    report["scaling"] = {str(n): v for n, v in scaling.items()}
    report["job_runs_made"], report["job_runs_final"] = made, final

    one_sleep_s = attempt(f"{mode} one sleep", one_sleep)
    use_slots(slots or "16")
    sixteen_s = attempt(f"{mode} 16 sleeps", lambda: sleeps(16))
    use_slots(slots)
    report["sleep_5s"] = {
        "one_call_s": one_sleep_s and round(one_sleep_s, 3),
        "map_16_s": sixteen_s and round(sixteen_s, 3),
        "ratio": ratio(sixteen_s, one_sleep_s),
    }
    print(mode, "sleeps", report["sleep_5s"], flush=True)
    if mode == "warm":
        from kinetic_prefect import config
        from kinetic_prefect.workers.local import warm

        report["runner_processes_started"] = warm.runners_for(config.cache_dir() / "warm").started
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--databases", nargs="+", default=["postgresql", "sqlite"])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=["default", "warm", "cold"])
    parser.add_argument(
        "--cold-pairs-only",
        action="store_true",
        help="cold mode: the interleaved pairs only, no scaling or sleeps (they take long cold)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sweeps.json")
    args = parser.parse_args()
    if len(args.databases) > 1:  # one process per server: Prefect's client keeps the first server's address
        merged: dict = {"command": "uv run python bench/bench_sweeps.py " + " ".join(sys.argv[1:])}
        for database in args.databases:
            part = args.out.with_name(f"{args.out.stem}.{database}.partial.json")
            argv = ["--databases", database, "--modes", *args.modes, "--repeats", str(args.repeats)]
            argv += ["--sizes", *map(str, args.sizes)] + (["--cold-pairs-only"] if args.cold_pairs_only else [])
            subprocess.run([sys.executable, __file__, *argv, "--out", str(part)], check=False)
            if part.exists():
                found = json.loads(part.read_text())
                found.pop("command", None)
                merged.update({k: v for k, v in found.items() if k != "failures"})
                merged.setdefault("failures", []).extend(found.get("failures", []))
                part.unlink()
            args.out.write_text(json.dumps(merged, indent=2) + "\n")
        print(json.dumps(merged, indent=2))
        return
    results: dict = {
        "command": "uv run python bench/bench_sweeps.py " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
    }
    for database in args.databases:
        with prefect_server(database=database):
            for mode in args.modes:
                sizes = [] if mode == "cold" and args.cold_pairs_only else args.sizes
                results[f"{database}/{mode}"] = run_mode(mode, args.repeats, sizes)
                results["failures"] = failures
                args.out.write_text(json.dumps(results, indent=2) + "\n")
    results["load_average_at_end"] = os.getloadavg()[0]
    results["failures"] = failures
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
