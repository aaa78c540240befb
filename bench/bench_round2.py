"""Fan-out, chatty jobs and signing, side by side in one run on one dedicated Prefect server.

    uv run --extra dev python bench/bench_round2.py --repeats 5

- ``.map()`` over 64 no-op inputs against one no-op call (goal: ≤ 4×);
- a job printing 100,000 lines against the same body printing nothing (goal: ≤ 1.1×);
- a warm no-op call with a signing key against one without, interleaved (goal: ≤ 10 ms added).
Medians of ``--repeats`` runs; results in ``bench/results/round2.json``.
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
os.environ.setdefault("KINETIC_UNSIGNED_OK", "1")

from bench.server import prefect_server  # noqa: E402


def signing_overhead_ms(repeats: int = 300) -> dict:
    """What signing adds to one call's store traffic, measured directly (the end-to-end pair above is
    dominated by machine noise): the caller writes a signed payload and reads a signed outcome and
    result, the job reads the payload and writes result and outcome, each with its .sig."""
    import tempfile

    from kinetic_prefect import signing
    from kinetic_prefect.storage import open_store

    store = open_store(tempfile.mkdtemp(prefix="kinetic-sign-bench-"))
    payload, result, outcome = b"p" * 4096, b"r" * 1024, b"{}" * 200

    def one_call(key):
        signing.put(store, "runs/x/payload.pkl", payload, key)
        signing.get(store, "runs/x/payload.pkl", key)
        signing.put(store, "runs/x/result.pkl", result, key)
        signing.put(store, "runs/x/outcome.json", outcome, key)
        signing.get(store, "runs/x/outcome.json", key)
        signing.get(store, "runs/x/result.pkl", key)

    samples = {"unsigned": [], "signed": []}
    for _ in range(repeats):
        for mode, key in (("unsigned", None), ("signed", b"bench-key")):
            start = time.perf_counter()
            one_call(key)
            samples[mode].append(time.perf_counter() - start)
    unsigned, signed = statistics.median(samples["unsigned"]), statistics.median(samples["signed"])
    return {
        "store_traffic_unsigned_ms": unsigned * 1000,
        "store_traffic_signed_ms": signed * 1000,
        "signing_added_per_call_ms": (signed - unsigned) * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fan-out", type=int, default=64)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "round2.json"))
    args = parser.parse_args()

    with prefect_server():
        from prefect import flow

        from kinetic_prefect import kinetic_task

        @kinetic_task(name="noop")
        def noop(x: int = 0) -> int:
            return x

        @kinetic_task(name="chatty")
        def chatty(lines: int) -> int:
            for i in range(lines):
                print(f"line {i} of a chatty job")
            return lines

        @flow
        def one_call() -> None:
            noop(0)

        @flow
        def fan_out(n: int) -> None:
            assert noop.map(range(n)).result() == list(range(n))

        @flow
        def printing(lines: int) -> None:
            chatty(lines)

        def timed(fn, *a) -> float:
            start = time.perf_counter()
            fn(*a)
            return time.perf_counter() - start

        one_call()  # warm-up: pool creation, imports
        single, mapped, quiet, loud, unsigned, signed = [], [], [], [], [], []
        for _ in range(args.repeats):  # interleaved: every pair sees the same machine load
            single.append(timed(one_call))
            quiet.append(timed(printing, 0))
            loud.append(timed(printing, args.lines))
            mapped.append(timed(fan_out, args.fan_out))
            # the map's 64 runs' logs and events keep the server busy for a few seconds after it: let them
            # settle, or the next measurement pays for them (a quiet job right after it took 3.1 s, not 1.1 s)
            time.sleep(10)
            os.environ.pop("KINETIC_SIGNING_KEY", None)
            unsigned.append(timed(one_call))
            os.environ["KINETIC_SIGNING_KEY"] = "bench-key"
            signed.append(timed(one_call))
            os.environ.pop("KINETIC_SIGNING_KEY", None)

    med = statistics.median
    result = {
        "repeats": args.repeats,
        "fan_out_inputs": args.fan_out,
        "one_call_median_s": med(single),
        "map_median_s": med(mapped),
        "map_over_one_call": med(mapped) / med(single),
        "lines": args.lines,
        "quiet_job_median_s": med(quiet),
        "chatty_job_median_s": med(loud),
        "chatty_over_quiet": med(loud) / med(quiet),
        "unsigned_call_median_s": med(unsigned),
        "signed_call_median_s": med(signed),
        "signing_added_ms": (med(signed) - med(unsigned)) * 1000,
        **signing_overhead_ms(),
        "samples_s": {
            "one_call": single,
            "map": mapped,
            "quiet": quiet,
            "chatty": loud,
            "unsigned": unsigned,
            "signed": signed,
        },
        "load_average": os.getloadavg(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "samples_s"}, indent=2))


if __name__ == "__main__":
    main()
