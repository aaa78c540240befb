"""Pod side: the one program a job runs, ``python -m kinetic_prefect.runner``.

It imports only the stdlib, cloudpickle and the storage leaf (no Prefect: start-up time is
part of every call's latency). Each step has a name; whatever fails, the outcome record says
which step it was. The contract with the worker and the caller:

* inputs come from environment variables (``KINETIC_STORE``, ``KINETIC_RUN_PREFIX``,
  ``KINETIC_PAYLOAD_SHA256``, ``KINETIC_CODE_KEY``, ``KINETIC_CODE_SHA256``);
* ``<run prefix>/result.pkl`` holds the pickled return value or exception, then
  ``<run prefix>/outcome.json`` is written last: its presence means the outcome is complete;
* exit status 0 means an outcome was recorded (even for a failing function); anything else
  means the job crashed and the worker reports the run as Crashed.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import os
import pickle
import socket
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

EXIT_NO_OUTCOME = 3


class PhaseFailed(Exception):
    def __init__(self, phase: str, error: BaseException):
        super().__init__(phase)
        self.phase = phase
        self.error = error


class Phases:
    """Runs named steps and remembers which one failed."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}

    def run(self, name: str, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        except BaseException as exc:  # SystemExit/KeyboardInterrupt from user code are outcomes too
            raise PhaseFailed(name, exc) from exc
        finally:
            self.timings[name] = round(time.perf_counter() - start, 4)


def _env(name: str, required: bool = True) -> str | None:
    value = os.environ.get(name)
    if required and not value:
        raise RuntimeError(f"environment variable {name} is not set; this process must be started by a kinetic worker")
    return value


def _node_cache() -> Path:
    explicit = os.environ.get("KINETIC_NODE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "kinetic-prefect" / "node"


def _fetch(store, key: str) -> bytes:
    return store.get_bytes(key)


def _verify(data: bytes, expected: str, what: str) -> None:
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise ValueError(f"{what} sha256 mismatch: expected {expected}, got {actual}; refusing to unpickle it")


def _safe_extract(tar: tarfile.TarFile, dest: Path) -> None:
    """Extract regular files and directories only, never outside ``dest``.

    ``filter="data"`` does exactly this, but Pythons before 3.11.4 (Debian bookworm's 3.11.2,
    a common base image) do not have it.
    """
    members = []
    for member in tar.getmembers():
        path = Path(member.name)
        if path.is_absolute() or ".." in path.parts or not (member.isfile() or member.isdir()):
            raise ValueError(f"unsafe entry in the project archive: {member.name!r}")
        members.append(member)
    try:
        tar.extractall(dest, members=members, filter="data")
    except TypeError:
        tar.extractall(dest, members=members)


def _restore_code(store, key: str, sha: str | None) -> Path:
    """Extract the project archive once per node (content-addressed directory, renamed into place)."""
    target = _node_cache() / "code" / (sha or hashlib.sha256(key.encode()).hexdigest())
    if (target / ".kinetic-complete").exists():
        return target
    data = store.get_bytes(key)
    if sha:
        _verify(data, sha, "project archive")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".extract-"))
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        _safe_extract(tar, staging)
    (staging / ".kinetic-complete").write_text(sha or key)
    try:
        os.replace(staging, target)
    except OSError:  # another job on this node won the race; its copy is identical
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    return target


def _unpickle_call(payload: bytes):
    import cloudpickle

    envelope = pickle.loads(payload)
    if envelope.get("format") != 1:
        raise ValueError(f"unknown payload format {envelope.get('format')!r}; upgrade kinetic-prefect on the job side")
    fn = cloudpickle.loads(envelope["function"])
    arguments = {name: cloudpickle.loads(blob) for name, blob in envelope["arguments"].items()}
    bound = inspect.BoundArguments(inspect.signature(fn), arguments)
    return fn, bound.args, bound.kwargs


def _call(fn, args, kwargs):
    if inspect.iscoroutinefunction(fn):
        import asyncio

        return asyncio.run(fn(*args, **kwargs))
    return fn(*args, **kwargs)


def _pickle_value(value: Any) -> bytes:
    import cloudpickle

    return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def _pickle_exception(exc: BaseException) -> bytes | None:
    """The exception as (type, args, attributes), rebuilt by the caller without calling __init__.

    Plain pickling re-calls ``__init__`` with ``args``, which breaks the many exception classes
    whose constructor takes other parameters than their message. None when even that fails:
    the caller then raises a RemoteError with the type's name.
    """
    import cloudpickle

    state = {k: v for k, v in vars(exc).items() if k != "__notes__"}
    for candidate in ((type(exc), exc.args, state), (type(exc), exc.args, {})):
        try:
            blob = cloudpickle.dumps(("exception", *candidate), protocol=pickle.HIGHEST_PROTOCOL)
            cloudpickle.loads(blob)
            return blob
        except Exception:
            continue
    return None


def _upload_outputs(store, run_id: str, output_dir: Path) -> list[str]:
    files = [p for p in sorted(output_dir.rglob("*")) if p.is_file()]
    if not files:
        return []
    pairs = [(p.relative_to(output_dir).as_posix(), p) for p in files]
    store.put_tree(f"outputs/{run_id}", pairs)
    return [rel for rel, _ in pairs]


class CheckpointSync:
    """``KINETIC_CHECKPOINT_DIR``, kept in the store under a key of the *task run*, so a retry
    (a new job for the same task run) starts from what the killed one saved.

    On a local store the directory is the store's own folder: every write is durable at once.
    On GCS it is restored at start, then changed files are uploaded every
    ``KINETIC_CHECKPOINT_SYNC_SECONDS`` (default 30) and once more when the function ends.
    """

    def __init__(self, store, key: str):
        import threading

        self.store, self.key = store, key.rstrip("/")
        self.direct = store.local_path(self.key)
        self.dir = self.direct or Path(tempfile.mkdtemp(prefix="kinetic-checkpoint-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self._synced: dict[str, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def restore(self) -> int:
        if self.direct is not None:
            return sum(1 for p in self.dir.rglob("*") if p.is_file())
        count = self.store.get_tree(self.key, self.dir)
        self._synced = self._snapshot()
        return count

    def _snapshot(self) -> dict[str, tuple[int, int]]:
        snap = {}
        for path in self.dir.rglob("*"):
            if path.is_file() and not path.name.startswith(".kp-tmp"):
                st = path.stat()
                snap[path.relative_to(self.dir).as_posix()] = (st.st_size, st.st_mtime_ns)
        return snap

    def sync(self) -> int:
        if self.direct is not None:
            return 0
        with self._lock:
            current = self._snapshot()
            changed = [(rel, self.dir / rel) for rel, sig in current.items() if self._synced.get(rel) != sig]
            if changed:
                self.store.put_tree(self.key, changed)
            self._synced = current
            return len(changed)

    def start(self) -> None:
        if self.direct is not None:
            return
        import threading

        interval = float(os.environ.get("KINETIC_CHECKPOINT_SYNC_SECONDS", "30"))

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.sync()
                except Exception as exc:  # keep training; the final sync reports for real
                    print(f"kinetic runner: checkpoint sync failed: {exc!r}", file=sys.stderr, flush=True)

        self._thread = threading.Thread(target=loop, name="kinetic-checkpoint-sync", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sync()


def _localize_data(args, kwargs, store):
    from kinetic_prefect import data

    node_cache = _node_cache()
    resolve = lambda ref: data.localize(ref, store, node_cache)  # noqa: E731
    return data.transform(args, resolve, data.DataRef), data.transform(kwargs, resolve, data.DataRef)


def main() -> int:
    started = time.perf_counter()
    phases = Phases()
    outcome: dict[str, Any] = {"pid": os.getpid(), "hostname": socket.gethostname()}
    result_blob: bytes | None = None
    store = None
    prefix = None
    try:
        from kinetic_prefect.storage import open_store

        store_url = phases.run("reading the job environment", _env, "KINETIC_STORE")
        prefix = _env("KINETIC_RUN_PREFIX").rstrip("/")
        run_id = prefix.rsplit("/", 1)[-1]
        store = phases.run("opening the store", open_store, store_url)
        payload = phases.run("fetching the payload", _fetch, store, f"{prefix}/payload.pkl")
        phases.run("verifying the payload", _verify, payload, _env("KINETIC_PAYLOAD_SHA256"), "payload")
        code_key = os.environ.get("KINETIC_CODE_KEY")
        if code_key:
            code_dir = phases.run("restoring the project code", _restore_code, store, code_key,
                                  os.environ.get("KINETIC_CODE_SHA256"))
            os.chdir(code_dir)
            sys.path.insert(0, str(code_dir))
        output_dir = Path(os.environ.get("KINETIC_OUTPUT_DIR") or tempfile.mkdtemp(prefix="kinetic-outputs-"))
        output_dir.mkdir(parents=True, exist_ok=True)
        os.environ["KINETIC_OUTPUT_DIR"] = str(output_dir)
        fn, args, kwargs = phases.run("unpickling the call", _unpickle_call, payload)
        args, kwargs = phases.run("fetching the data", _localize_data, args, kwargs, store)
        checkpoints = None
        if os.environ.get("KINETIC_CHECKPOINT_KEY"):
            checkpoints = CheckpointSync(store, os.environ["KINETIC_CHECKPOINT_KEY"])
            outcome["checkpoint_files_restored"] = phases.run("restoring checkpoints", checkpoints.restore)
            os.environ["KINETIC_CHECKPOINT_DIR"] = str(checkpoints.dir)
            checkpoints.start()
        function_failure = None
        try:
            value = phases.run("running the function", _call, fn, args, kwargs)
        except PhaseFailed as failed:
            function_failure = failed
        # Checkpoints and outputs are saved after a failure too: that is when they matter most.
        if checkpoints is not None:
            try:
                phases.run("saving checkpoints", checkpoints.stop)
            except PhaseFailed as failed:
                if function_failure is None:
                    raise
                print(f"kinetic runner: also failed while saving checkpoints: {failed.error!r}", file=sys.stderr)
        try:
            outcome["outputs"] = phases.run("uploading outputs", _upload_outputs, store, run_id, output_dir)
        except PhaseFailed as failed:
            if function_failure is None:
                raise
            print(f"kinetic runner: also failed while uploading outputs: {failed.error!r}", file=sys.stderr)
        if function_failure is not None:
            raise function_failure
        result_blob = phases.run("pickling the result", _pickle_value, value)
        outcome["status"] = "completed"
    except PhaseFailed as failed:
        exc = failed.error
        outcome.update(
            status="failed",
            phase=failed.phase,
            error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
            message=str(exc),
            traceback="".join(traceback.format_exception(exc)),
            user_error=failed.phase == "running the function",
        )
        result_blob = _pickle_exception(exc)
        # Printed so the failure is in the job's log even if the outcome cannot be stored.
        print(f"kinetic runner: failed while {failed.phase}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    outcome["timings"] = phases.timings
    outcome["duration_s"] = round(time.perf_counter() - started, 4)
    if store is None or prefix is None:
        return EXIT_NO_OUTCOME
    try:
        if result_blob is not None:
            store.put_bytes(f"{prefix}/result.pkl", result_blob)
        store.put_bytes(f"{prefix}/outcome.json", json.dumps(outcome).encode())  # the marker: written last
    except Exception as exc:
        print(f"kinetic runner: failed while writing the outcome: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_NO_OUTCOME
    return 0


if __name__ == "__main__":
    sys.exit(main())
