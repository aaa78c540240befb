"""How large a ``.map()`` the embedded SQLite server carries (issue 33): no-op kinetic calls, every value and job run
checked, with the Prefect API requests of the calling process counted by endpoint.

    uv run python bench/bench_sweep_scale.py --sizes 64 256 1000 [--submission in-process worker]
        [--trees before=../old-checkout after=.] [--repeats 1] [--stop-inputs 1000] [--out FILE]

Each (tree, submission, size) runs in a process of its own with a fresh ``prefect server start`` on SQLite (as the
test session's), so a size's database holds only its own runs and a failure cannot spoil the next size. ``--trees``
runs the same measurements against other checkouts of the package (``NAME=PATH``, imported through PYTHONPATH),
interleaved in each repeat: side by side on one machine in one run. ``worker``: a polling kinetic-local worker
on a pool whose concurrency limit is ``--worker-slots`` (a worker claims every Scheduled run it sees otherwise).
``--stop-inputs N``: a script maps N sleeping calls, gets Ctrl-C once its slots run, and the time until every
started job's process is gone and until the script has ended is recorded.

Requests are counted at httpx's ``send`` (bench/api_calls.py): the calling process only, and every retry.
Results in ``bench/results/sweep_scale.json`` (no machine paths).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
IN_PROCESS_SLOTS = 16


def child(size: int, submission: str, worker_slots: int) -> dict:
    """One map in this process, on a fresh server (the tree to measure is first on sys.path)."""
    from bench.api_calls import install_counter, snapshot
    from bench.server import prefect_server

    result: dict = {"size": size, "submission": submission}
    with prefect_server(database="sqlite") as home:
        install_counter()
        from prefect import flow, get_client

        from kinetic_prefect import kinetic_task

        pool, worker = None, None  # in-process: the default pool, made by the first call
        if submission == "worker":
            pool, worker = _start_worker(worker_slots, home)

        warm = {"keep_warm_seconds": float(os.environ.get("BENCH_KEEP_WARM", "0"))}

        @kinetic_task(
            name=f"noop-{os.getpid()}", work_pool=pool, submission=submission, ship_project=False, job_variables=warm
        )
        def noop(i: int) -> int:
            return i

        @flow
        def fan_out(n: int) -> list[int]:
            return noop.map(range(n)).result()

        try:
            fan_out(1)  # warm-up: the pool, the project archive, the signing key
            before = snapshot()
            started = time.perf_counter()
            try:
                values = fan_out(size)
                result["values_ok"] = values == list(range(size))
            except Exception as exc:  # noqa: BLE001 - the failure is the figure
                result["values_ok"] = False
                result["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            result["wall_s"] = round(time.perf_counter() - started, 2)
            counts = snapshot() - before
            made, final = _job_runs(get_client, noop.name)
            result.update(job_runs_made=made, job_runs_final=final)
            logs = sum(n for e, n in counts.items() if e.startswith("POST /logs"))
            result["requests"] = sum(counts.values()) - logs
            result["requests_per_input"] = round(result["requests"] / size, 2)
            result["csrf_token_requests"] = counts["GET /csrf-token"]  # one per Prefect client the process starts
            result["by_endpoint"] = dict(counts.most_common(12))
        finally:
            if worker is not None:
                worker.terminate()
                worker.wait(30)
    return result


def _start_worker(slots: int, home: Path) -> tuple[str, subprocess.Popen]:
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.base import BaseWorker

    import kinetic_prefect.workers  # noqa: F401 - registers the worker types

    pool = f"scale-worker-{os.getpid()}"
    template = BaseWorker.get_worker_class_from_type("kinetic-local").get_default_base_job_template()
    with get_client(sync_client=True) as client:
        client.create_work_pool(
            WorkPoolCreate(name=pool, type="kinetic-local", base_job_template=template, concurrency_limit=slots)
        )
    env = {**os.environ, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_HEARTBEAT_SECONDS": "5"}
    with open(home / "worker.log", "wb") as log:  # the child writes through its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--type", "kinetic-local", "--pool", pool],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    with get_client(sync_client=True) as client:
        deadline = time.time() + 240
        while not any(w.status.value == "ONLINE" for w in client.read_workers_for_work_pool(pool)):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("the worker did not come online: " + (home / "worker.log").read_text()[-2000:])
            time.sleep(0.5)
    return pool, proc


def _job_runs(get_client, name: str) -> tuple[int, int]:
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    runs: list = []
    with get_client(sync_client=True) as client:
        while True:  # at most 200 a page
            page = client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[name])), limit=200, offset=len(runs)
            )
            runs += page
            if len(page) < 200:
                break
    return len(runs), sum(1 for r in runs if r.state is not None and r.state.is_final())


STOP_SCRIPT = textwrap.dedent("""
    import pathlib, sys
    from prefect import flow
    from kinetic_prefect import kinetic_task

    N, PID_DIR = int(sys.argv[1]), sys.argv[2]

    @kinetic_task(name="stop-scale", submission="in-process", ship_project=False)
    def sleepy(i: int) -> int:
        import os, pathlib, time
        pathlib.Path(PID_DIR, f"{i}.pid").write_text(str(os.getpid()))
        time.sleep(120)
        return i

    @flow
    def sweep():
        return sleepy.map(range(N)).result()

    sweep()
""")


def stop_child(size: int) -> dict:
    """Ctrl-C of a script mapping ``size`` sleeping calls, once its in-process slots all run."""
    from bench.server import prefect_server

    with prefect_server(database="sqlite"):
        folder = Path(tempfile.mkdtemp(prefix="kinetic-stop-"))
        (folder / "sweep.py").write_text(STOP_SCRIPT)
        pids = folder / "pids"
        pids.mkdir()
        proc = subprocess.Popen(
            [sys.executable, str(folder / "sweep.py"), str(size), str(pids)],
            cwd=folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # the signal goes to the script alone, as a terminal's to its foreground job
        )
        deadline = time.time() + 900
        while len(list(pids.glob("*.pid"))) < IN_PROCESS_SLOTS:
            if proc.poll() is not None or time.time() > deadline:
                return {"size": size, "error": f"the slots never all ran (exit {proc.poll()})"}
            time.sleep(0.5)
        time.sleep(2)
        started = [int(p.read_text()) for p in pids.glob("*.pid") if p.read_text().strip()]
        signalled = time.time()
        proc.send_signal(signal.SIGINT)
        jobs_gone_s = None
        while time.time() - signalled < 300:
            if jobs_gone_s is None and not any(_alive(pid) for pid in started):
                jobs_gone_s = round(time.time() - signalled, 2)
            if jobs_gone_s is not None and proc.poll() is not None:
                break
            time.sleep(0.1)
        script_ended_s = round(time.time() - signalled, 2) if proc.poll() is not None else None
        if proc.poll() is None:
            proc.kill()
        return {
            "size": size,
            "jobs_running_at_signal": len(started),
            "jobs_gone_s": jobs_gone_s,
            "script_ended_s": script_ended_s,
        }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def run_child(tree: Path, argv: list[str]) -> dict:
    """This script again, importing the package from ``tree``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(HERE)])}
    env.update(KINETIC_UNSIGNED_OK="1", KINETIC_IN_PROCESS_CONCURRENCY=str(IN_PROCESS_SLOTS))
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        part = Path(out.name)
    proc = subprocess.run([sys.executable, __file__, *argv, "--part", str(part)], env=env, cwd=tree, check=False)
    try:
        return json.loads(part.read_text()) if part.stat().st_size else {"error": f"exit {proc.returncode}"}
    finally:
        part.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="*", default=[64, 256, 1000])
    parser.add_argument("--submission", nargs="+", default=["in-process"], choices=["in-process", "worker"])
    parser.add_argument("--trees", nargs="+", default=["current=."], help="NAME=PATH of a checkout to measure")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--worker-slots", type=int, default=IN_PROCESS_SLOTS)
    parser.add_argument("--stop-inputs", type=int, default=0)
    parser.add_argument("--keep-warm", type=float, default=0, help="keep_warm_seconds of the calls (0: cold)")
    parser.add_argument("--out", type=Path, default=HERE / "bench" / "results" / "sweep_scale.json")
    parser.add_argument("--child", nargs=2, metavar=("SIZE", "SUBMISSION"), help=argparse.SUPPRESS)
    parser.add_argument("--stop-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--part", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child or args.stop_child:
        tree_path = os.environ["PYTHONPATH"]
        import bench.api_calls  # noqa: F401 - it puts this checkout first on both paths: the tree goes first again

        os.environ["PYTHONPATH"] = tree_path
        sys.path[:0] = tree_path.split(os.pathsep)
        found = (
            stop_child(args.stop_child)
            if args.stop_child
            else child(int(args.child[0]), args.child[1], args.worker_slots)
        )
        args.part.write_text(json.dumps(found))
        return

    trees = dict(entry.split("=", 1) for entry in args.trees)
    os.environ["BENCH_KEEP_WARM"] = str(args.keep_warm)  # the children read it
    report: dict = {
        "command": "uv run python bench/bench_sweep_scale.py " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "in_process_slots": IN_PROCESS_SLOTS,
        "runs": [],
    }
    for repeat in range(args.repeats):
        for submission in args.submission:
            for size in args.sizes:
                for name, path in trees.items():  # interleaved: the trees see the same machine
                    found = run_child(
                        Path(path).resolve(),
                        ["--child", str(size), submission, "--worker-slots", str(args.worker_slots)],
                    )
                    found.update(tree=name, repeat=repeat)
                    report["runs"].append(found)
                    print(json.dumps({k: v for k, v in found.items() if k != "by_endpoint"}), flush=True)
                    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.stop_inputs:
        for name, path in trees.items():
            found = run_child(Path(path).resolve(), ["--stop-child", str(args.stop_inputs)])
            found.update(tree=name, stop=True)
            report["runs"].append(found)
            print(json.dumps(found), flush=True)
    report["medians"] = _medians(report["runs"])
    report["load_average_at_end"] = round(os.getloadavg()[0], 2)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["medians"], indent=2))


def _medians(runs: list[dict]) -> dict:
    groups: dict[str, list[dict]] = {}
    for run in runs:
        if not run.get("stop"):
            groups.setdefault(f"{run.get('tree')}/{run.get('submission')}/{run.get('size')}", []).append(run)
    medians = {}
    for key, group in groups.items():
        walls = [r["wall_s"] for r in group if r.get("values_ok")]
        medians[key] = {
            "all_ok": sum(1 for r in group if r.get("values_ok") and r.get("job_runs_final") == r.get("job_runs_made")),
            "of": len(group),
            "wall_s": statistics.median(walls) if walls else None,
            "requests_per_input": statistics.median(r["requests_per_input"] for r in group if "requests_per_input" in r)
            if any("requests_per_input" in r for r in group)
            else None,
        }
    return medians


if __name__ == "__main__":
    main()
