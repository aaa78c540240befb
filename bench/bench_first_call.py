"""What a user waits for before anything useful happens: the commands, a first call in a fresh script, a worker's
start. Every row is a fresh process, timed from outside, its pair run in turn (A B A B ...) so both see the same
machine load; medians and pair-by-pair ratios.

    uv run --all-extras python bench/bench_first_call.py --runs 5
    uv run --all-extras python bench/bench_first_call.py --runs 5 --checkout ../old-main   # another commit's code

``--checkout`` runs the same rows against another checkout's package (PYTHONPATH), for old and new side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.server import prefect_server  # noqa: E402

CALL_SCRIPT = textwrap.dedent("""
    import sys, time
    started = time.perf_counter()
    from prefect import flow, task
    from kinetic_prefect import kinetic_task

    def body(x):
        return x + 1

    step = task(body) if sys.argv[1] == "plain" else kinetic_task(body, accelerator="cpu", ship_project=False)

    @flow
    def pipeline():
        before = time.perf_counter()
        value = step(1)
        return value, time.perf_counter() - before

    value, call_seconds = pipeline()
    assert value == 2, value
    print(f"CALL {call_seconds:.4f} TOTAL {time.perf_counter() - started:.4f}")
""")


def _timed(argv: list[str], env: dict[str, str], timeout: float = 600) -> tuple[float, str]:
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=tempfile.gettempdir())
    seconds = time.perf_counter() - started
    return seconds, proc.stdout + proc.stderr


def _pairs(a: list[str], b: list[str] | None, runs: int, env: dict[str, str]) -> dict[str, object]:
    """A (and B) ``runs`` times in turn after one warm-up each; medians and the median of A/B pair by pair."""
    _timed(a, env)
    if b:
        _timed(b, env)
    a_s, b_s = [], []
    for _ in range(runs):
        a_s.append(_timed(a, env)[0])
        if b:
            b_s.append(_timed(b, env)[0])
    row: dict[str, object] = {"a_median_s": round(statistics.median(a_s), 3), "a_s": [round(s, 3) for s in a_s]}
    if b:
        row |= {
            "b_median_s": round(statistics.median(b_s), 3),
            "ratio_median": round(statistics.median(x / y for x, y in zip(a_s, b_s, strict=True)), 2),
        }
    return row


def _call_rows(runs: int, env: dict[str, str], script: Path) -> dict[str, object]:
    """One call in a fresh script, kinetic against a plain Prefect @task: the call alone and the script end to end."""
    figures: dict[str, list[float]] = {"kinetic_call": [], "plain_call": [], "kinetic_total": [], "plain_total": []}
    for index in range(runs + 1):  # the first pair warms the OS caches and the kinetic-local pool
        for kind in ("kinetic", "plain"):
            seconds, output = _timed([sys.executable, str(script), kind], env)
            line = next((x for x in output.splitlines() if x.startswith("CALL ")), None)
            if line is None:
                raise RuntimeError(f"the {kind} script failed:\n{output[-3000:]}")
            if index:
                figures[f"{kind}_call"].append(float(line.split()[1]))
                figures[f"{kind}_total"].append(seconds)
    ratios = [k / p for k, p in zip(figures["kinetic_total"], figures["plain_total"], strict=True)]
    return {name: round(statistics.median(values), 3) for name, values in figures.items()} | {
        "end_to_end_ratio_median": round(statistics.median(ratios), 2)
    }


def _worker_online_seconds(worker_type: str, env: dict[str, str]) -> float:
    """``prefect worker start --type TYPE`` from its launch to the API showing it online."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    pool = f"bench-{worker_type}-{os.urandom(3).hex()}"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type=worker_type))
        started = time.time()
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--type", worker_type, "--pool", pool],
            env={**env, "PREFECT_WORKER_HEARTBEAT_SECONDS": "1", "PREFECT_WORKER_QUERY_SECONDS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while not any(w.status.value == "ONLINE" for w in client.read_workers_for_work_pool(pool)):
                if proc.poll() is not None or time.time() - started > 300:
                    raise RuntimeError(f"the {worker_type} worker never came online")
                time.sleep(0.1)
            return time.time() - started
        finally:
            proc.kill()
            proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--checkout", help="another checkout whose kinetic_prefect is measured (PYTHONPATH)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "first_call.json"))
    args = parser.parse_args()

    python = sys.executable
    cli = [python, "-m", "kinetic_prefect.cli"]
    env = dict(os.environ)
    if args.checkout:
        env["PYTHONPATH"] = str(Path(args.checkout).resolve())
    no_credentials = {**env, "HOME": tempfile.mkdtemp(prefix="bench-home-")}
    no_credentials.pop("GOOGLE_APPLICATION_CREDENTIALS", None)
    rows: dict[str, object] = {
        "import kinetic_prefect.workers vs import prefect": _pairs(
            [python, "-c", "import kinetic_prefect.workers"], [python, "-c", "import prefect"], args.runs, env
        ),
        "kinetic-prefect --help": _pairs([*cli, "--help"], None, args.runs, env),
        "cost --estimate tpu-v6e-8 --minutes 30": _pairs(
            [*cli, "cost", "--estimate", "tpu-v6e-8", "--minutes", "30"], None, args.runs, env
        ),
        "up --platform vertex --dry-run, no credentials": _pairs(
            [*cli, "up", "--platform", "vertex", "--project", "my-proj-123", "--dry-run"],
            None,
            args.runs,
            no_credentials,
        ),
        "up --platform gke --dry-run, no credentials": _pairs(
            [*cli, "up", "--project", "my-proj-123", "--zone", "us-central1-a", "--dry-run"],
            None,
            args.runs,
            no_credentials,
        ),
    }
    script = Path(tempfile.mkdtemp(prefix="bench-first-call-")) / "first_call.py"
    script.write_text(CALL_SCRIPT)
    embedded = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    embedded["PREFECT_HOME"] = tempfile.mkdtemp(prefix="bench-prefect-home-")
    embedded["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "300"  # Prefect's 20 s fails on a loaded machine
    rows["first call, embedded server"] = _call_rows(args.runs, embedded, script)
    with prefect_server():
        started_env = {**os.environ, **({"PYTHONPATH": env["PYTHONPATH"]} if args.checkout else {})}
        rows["first call, started server"] = _call_rows(args.runs, started_env, script)
        if not args.checkout:  # the entry point is this checkout's
            local, process = [], []
            for _ in range(args.runs):
                local.append(_worker_online_seconds("kinetic-local", started_env))
                process.append(_worker_online_seconds("process", started_env))
            rows["worker start to online: kinetic-local vs process"] = {
                "a_median_s": round(statistics.median(local), 3),
                "b_median_s": round(statistics.median(process), 3),
                "ratio_median": round(statistics.median(a / b for a, b in zip(local, process, strict=True)), 2),
            }
    result = {"runs": args.runs, "checkout": "other" if args.checkout else "this", "cores": os.cpu_count()} | rows
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
