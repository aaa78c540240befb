"""Count the Prefect API requests of one kinetic call and of a ``.map()``, by endpoint.

    uv run python bench/api_calls.py [--inputs 64] [--database sqlite|postgresql] [--keep-warm 60] [--out FILE]

In-process submission, so the caller and the worker's lifecycle run in this process and every request is counted
(the job itself talks to the API only if its caller dies). Counted at httpx's ``send``, below Prefect's client and
its retries: a retried request counts each time, as the server sees it. Log shipping (``POST /logs/``) is counted
apart, as it runs on its own schedule.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
os.environ.setdefault("KINETIC_UNSIGNED_OK", "1")

from bench.server import prefect_server  # noqa: E402

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


def _endpoint(request) -> str:
    path = request.url.path.split("/api", 1)[-1]
    return f"{request.method} {_UUID.sub('{id}', path)}"


def install_counter() -> None:
    import httpx

    def counting(original):
        def send(self, request, *args, **kwargs):
            with _lock:
                _counts[_endpoint(request)] += 1
            return original(self, request, *args, **kwargs)

        return send

    httpx.AsyncClient.send = counting(httpx.AsyncClient.send)
    httpx.Client.send = counting(httpx.Client.send)


def snapshot() -> collections.Counter[str]:
    with _lock:
        return collections.Counter(_counts)


def measure(label: str, run) -> dict:
    before = snapshot()
    started = time.perf_counter()
    run()
    wall = time.perf_counter() - started
    time.sleep(1.5)  # the last log batches
    delta = snapshot() - before
    logs = sum(n for e, n in delta.items() if e.startswith("POST /logs"))
    total = sum(delta.values()) - logs
    print(f"{label}: {total} API requests (+{logs} log batches) in {wall:.2f}s", flush=True)
    return {
        "requests": total,
        "log_batches": logs,
        "wall_s": round(wall, 3),
        "by_endpoint": dict(sorted(delta.items(), key=lambda kv: -kv[1])),
    }


def _dump_tasks_on_sigusr1() -> None:
    """``kill -USR1`` prints what every coroutine on Prefect's run-sync loop waits for (to see a stall)."""
    import asyncio
    import signal

    def dump(*_: object) -> None:
        from prefect._internal.concurrency.threads import get_run_sync_loop

        loop = get_run_sync_loop()._loop  # noqa: SLF001

        def print_all() -> None:
            for task in asyncio.all_tasks(loop):
                task.print_stack(limit=12, file=sys.stderr)

        loop.call_soon_threadsafe(print_all)

    signal.signal(signal.SIGUSR1, dump)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inputs", type=int, default=64)
    parser.add_argument("--database", choices=["sqlite", "postgresql"], default="sqlite")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep-warm", type=float, default=0, help="keep_warm_seconds of the calls (0: cold)")
    args = parser.parse_args()
    _dump_tasks_on_sigusr1()

    with prefect_server(database=args.database):
        install_counter()
        from prefect import flow

        from kinetic_prefect import kinetic_task

        @kinetic_task(name="noop", submission="in-process", job_variables={"keep_warm_seconds": args.keep_warm})
        def noop(i: int) -> int:
            return i

        @flow
        def one():
            return noop(0)

        @flow
        def fan_out():
            return noop.map(range(args.inputs)).result()

        one()  # warm: the pool, the project archive, the environment
        report = {
            "database": args.database,
            "one_call": measure("one call", one),
            f"map_{args.inputs}": measure(f"map over {args.inputs}", fan_out),
        }
        per_input = report[f"map_{args.inputs}"]["requests"] / args.inputs
        report["map_requests_per_input"] = round(per_input, 2)
        print(f"map: {per_input:.1f} requests per input", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
