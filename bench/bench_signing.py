"""What signing with scoped keys costs a call (issue 45: a call with a key set is no slower than before by > 5 %).

    uv run python bench/bench_signing.py --baseline REF [--calls 12] [--repeats 3]

One Prefect server (SQLite, as the embedded default); for each repeat, two fresh processes run side by side in
turn: the package at REF (a git worktree of it, put first on PYTHONPATH) and this tree. Each process runs one
warm-up call, then ``--calls`` sequential no-op calls of one ``@kinetic_task`` with ``KINETIC_SIGNING_KEY`` set,
in-process on a kinetic-local pool, and prints the median seconds per call. The medians of the repeats and their
ratio go to ``bench/results/signing.json`` (no machine paths).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

CHILD = """
import os, statistics, sys, time, uuid
from prefect import flow
from kinetic_prefect import kinetic_task

@kinetic_task(name="sign-bench-" + uuid.uuid4().hex[:6])
def noop(i: int) -> int:
    return i

@flow
def one(i: int) -> int:
    return noop(i)

@flow
def many(n: int) -> list:
    times = []
    for i in range(n):
        started = time.perf_counter()
        assert noop(i) == i
        times.append(time.perf_counter() - started)
    return times

one(0)
print("MEDIAN", statistics.median(many(int(sys.argv[1]))))
"""


def _run(code_root: Path, calls: int, env: dict[str, str]) -> float:
    child_env = {**env, "PYTHONPATH": str(code_root)}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(calls)], env=child_env, capture_output=True, text=True, timeout=900
    )
    for line in out.stdout.splitlines():
        if line.startswith("MEDIAN "):
            return float(line.split()[1])
    raise RuntimeError(f"benchmark child failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", required=True, help="the git ref to compare with (e.g. the main before)")
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from server import prefect_server

    worktree = Path(tempfile.mkdtemp(prefix="kinetic-bench-baseline-"))
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(worktree), args.baseline], check=True)
    results: dict[str, list[float]] = {"baseline": [], "this tree": []}
    try:
        with prefect_server():
            env = {**os.environ, "KINETIC_SIGNING_KEY": "bench-key-0123456789abcdef", "KINETIC_SWEEP_SLOTS": "0"}
            for repeat in range(args.repeats):
                for label, root in (("baseline", worktree), ("this tree", ROOT)):
                    results[label].append(_run(root, args.calls, env))
                    print(f"repeat {repeat + 1}: {label} {results[label][-1]:.3f} s per call", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(worktree)], check=False)
    medians = {label: statistics.median(values) for label, values in results.items()}
    ratio = medians["this tree"] / medians["baseline"]
    print(
        f"median per call: baseline {medians['baseline']:.3f} s, this tree {medians['this tree']:.3f} s, "
        f"ratio {ratio:.3f}"
    )
    out = ROOT / "bench" / "results" / "signing.json"
    out.write_text(
        json.dumps(
            {"baseline": args.baseline, "calls": args.calls, "repeats": results, "medians": medians, "ratio": ratio},
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
