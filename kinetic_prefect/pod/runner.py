"""Pod side: the one program a job runs, ``python -m kinetic_prefect.pod.runner``.

It imports only the stdlib, cloudpickle and the storage leaf (no Prefect: start-up time is
part of every call's latency). Each step has a name; whatever fails, the outcome record says
which step it was. The contract with the worker and the caller:

* inputs come from the ``contract.Env`` variables (store, run id, payload and code digests);
* ``RunLayout.result`` holds the pickled return value or exception, then ``RunLayout.outcome``
  (a ``contract.Outcome``) is written last: its presence means the outcome is complete;
* exit status ``EXIT_OUTCOME_RECORDED`` means an outcome was recorded (even for a failing
  function); anything else means the job crashed and the worker reports the run as Crashed;
* SIGTERM (a cancel, a deleted pod) unwinds the function like Ctrl-C would, so checkpoints and
  outputs are still saved before the process ends.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import inspect
import io
import json
import os
import pickle
import shutil
import signal
import socket
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from kinetic_prefect import contract, signing
from kinetic_prefect.contract import (
    COMPLETED,
    EXIT_HOST_FAILED,
    EXIT_NO_OUTCOME,
    EXIT_OUTCOME_RECORDED,
    FAILED,
    PHASE_FUNCTION,
    PHASE_PICKLE_RESULT,
    PHASE_WORKING_COPY,
    PHASE_WRITE_RESULT,
    STORE_FULL_ERROR,
    Env,
    Group,
    Outcome,
    RunLayout,
    WarmRunnerFiles,
    settings,
)
from kinetic_prefect.errors import ResultNotPicklable
from kinetic_prefect.pod import debugger, outputs, utilization, working_copy

if TYPE_CHECKING:
    from kinetic_prefect.storage import Store

T = TypeVar("T")
Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]  # the function, its positional and keyword arguments


class JobTerminated(BaseException):
    """Raised in the function's thread on SIGTERM: the job was cancelled or its pod deleted."""


class PhaseFailed(Exception):
    def __init__(self, phase: str, error: BaseException) -> None:
        super().__init__(phase)
        self.phase = phase
        self.error = error


class Phases:
    """Runs named steps and remembers which one failed."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}

    def run(self, name: str, fn: Callable[..., T], *args: Any) -> T:
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
    explicit = os.environ.get(Env.NODE_CACHE)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "kinetic-prefect" / "node"


def _fetch(store: Store, key: str) -> bytes:
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


def _restore_code(store: Store, key: str, sha: str | None) -> Path:
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


def _scratch_root() -> Path | None:
    """Where this job's temporary folders go: the launcher's job folder when it names one (removed with the job,
    even after a SIGKILL), else TMPDIR."""
    job_dir = os.environ.get(Env.JOB_DIR)
    if not job_dir:
        return None
    Path(job_dir).mkdir(parents=True, exist_ok=True)
    return Path(job_dir)


def _unpickle_call(payload: bytes) -> Call:
    import cloudpickle

    envelope = pickle.loads(payload)
    if envelope.get("format") != contract.PAYLOAD_FORMAT:
        raise ValueError(f"unknown payload format {envelope.get('format')!r}; upgrade kinetic-prefect on the job side")
    fn = cloudpickle.loads(envelope["function"])
    arguments = {name: cloudpickle.loads(blob) for name, blob in envelope["arguments"].items()}
    bound = inspect.BoundArguments(inspect.signature(fn), arguments)
    return fn, bound.args, bound.kwargs


def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    debugpy = debugger.attached_debugpy(fn)
    if debugpy is not None:  # debug=True and a debugger attached: stop here, before the function
        debugpy.breakpoint()  # press Step Into to enter your function
    if inspect.iscoroutinefunction(fn):
        import asyncio

        return asyncio.run(fn(*args, **kwargs))
    return fn(*args, **kwargs)


def _pickle_value(value: Any) -> bytes:
    import cloudpickle

    try:
        blob: bytes = cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        return blob
    except Exception as exc:
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        raise ResultNotPicklable(
            f"the function returned a {kind}, which cannot be pickled back to the caller ({exc}); "
            f"return plain data (e.g. list(...) instead of a generator) or write it to {Env.OUTPUT_DIR}"
        ) from exc


def _pickle_exception(exc: BaseException) -> bytes | None:
    """The exception as (type, args, attributes), rebuilt by the caller without calling __init__.

    Plain pickling re-calls ``__init__`` with ``args``, which breaks the many exception classes
    whose constructor takes other parameters than their message. None when even that fails:
    the caller then raises a RemoteError with the type's name.
    """
    import cloudpickle

    whole = _pickle_whole_exception(exc)
    if whole is not None:
        return whole
    state = {k: v for k, v in vars(exc).items() if k != "__notes__"}
    for candidate in ((type(exc), exc.args, state), (type(exc), exc.args, {})):
        try:
            blob: bytes = cloudpickle.dumps(("exception", *candidate), protocol=pickle.HIGHEST_PROTOCOL)
            cloudpickle.loads(blob)
            return blob
        except Exception:
            continue
    return None


def _pickle_whole_exception(exc: BaseException) -> bytes | None:
    """The exception pickled as itself, when that round trip gives it back: the built-in ones keep what their
    constructor set (``OSError.filename``, ``UnicodeDecodeError.start``, ``CalledProcessError.stderr``, the members
    of an ``ExceptionGroup``), which args alone do not carry. None when the class cannot be rebuilt that way."""
    import cloudpickle

    try:
        blob: bytes = cloudpickle.dumps(("exception-object", exc), protocol=pickle.HIGHEST_PROTOCOL)
        _tag, copy = cloudpickle.loads(blob)
        same = type(copy).__qualname__ == type(exc).__qualname__ and str(copy) == str(exc)
        return blob if same else None
    except Exception:
        return None


def _upload_outputs(
    store: Store, layout: RunLayout, output_dir: Path, host: int = 0, key: signing.KeyLike = None
) -> list[str]:
    """This host's outputs under ``RunLayout.host_outputs``; with a key, their signed manifest after them."""
    return outputs.upload_outputs(store, layout.host_outputs(host), output_dir, key)


def _join_group(group: Group) -> None:
    """Form the multi-host group before the function runs: ``jax.distributed`` needs every host to call
    ``initialize`` with the same coordinator before any computation.  Without JAX in the environment the
    variables are still there for other frameworks (KINETIC_NUM_HOSTS, KINETIC_HOST_INDEX, the coordinator)."""
    try:
        import jax
    except ImportError:
        return
    if not group.coordinator:
        raise RuntimeError(f"a group of {group.size} hosts needs {Env.COORDINATOR_ADDRESS}")
    if os.environ.get("JAX_PLATFORMS", "").split(",")[0] in ("", "cpu"):
        # CPU devices of several processes talk through gloo; the default has no cross-process collectives.
        # (jax's Config.update carries no annotations.)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # type: ignore[no-untyped-call]
    jax.distributed.initialize(coordinator_address=group.coordinator, num_processes=group.size, process_id=group.index)


class CheckpointSync:
    """``KINETIC_CHECKPOINT_DIR``, kept in the store under a key of the *task run*, so a retry
    (a new job for the same task run) starts from what the killed one saved.

    Unsigned, on a local store the directory is the store's own folder: every write is durable at once.
    Otherwise it is a private copy, restored at start, then changed files are uploaded every
    ``KINETIC_CHECKPOINT_SYNC_SECONDS`` (default 30) and once more when the function ends.

    Signed (the job holds a key): each sync also writes the folder's signed manifest (``files_manifest_key``: every
    file's size and sha256), and a restore takes only the files it lists, each checked before the function sees
    it; an unsigned or forged manifest, or a file that differs from it, fails the restore (nothing of it is
    loaded). A changed file is copied before its upload, so the manifest names exactly the bytes uploaded, and
    while it replaces a version the manifest lists, the manifest lists both: a job killed mid-sync leaves a
    folder its retry restores.
    """

    def __init__(self, store: Store, key: str, upload: bool = True, signing_key: signing.KeyLike = None) -> None:
        import threading

        self.store, self.key, self.upload = store, key.rstrip("/"), upload  # only a group's coordinator uploads
        self.signing_key = signing_key
        # The other hosts of a group work on a private copy, on a local store too: every host starts from the
        # shared checkpoint, only the coordinator's writes are kept, and no two processes write the same file.
        # Signed, every host does: what the function reads was checked, and what the store keeps is listed.
        self.direct = store.local_path(self.key) if upload and signing_key is None else None
        self.dir = self.direct or Path(tempfile.mkdtemp(prefix="kinetic-checkpoint-", dir=_scratch_root()))
        self.dir.mkdir(parents=True, exist_ok=True)
        self._synced: dict[str, tuple[int, int]] = {}
        self._stored: dict[str, outputs.Version] = {}  # signed: the version of each file the store holds
        self._listed: outputs.Manifest | None = None  # signed: the manifest last written or restored
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def restore(self) -> int:
        if self.direct is not None:
            return sum(1 for p in self.dir.rglob("*") if p.is_file())
        if self.signing_key is not None:
            count = self._restore_signed()
        else:
            count = self.store.get_tree(self.key, self.dir)
            for name in outputs.RESERVED_NAMES:  # left by a signed attempt: not the function's
                if (self.dir / name).is_file():
                    (self.dir / name).unlink()
                    count -= 1
        self._synced = self._snapshot()
        return count

    def _restore_signed(self) -> int:
        base = self.key + "/"
        held = {k[len(base) :] for k in self.store.list(self.key)}
        manifest = outputs.read_manifest(self.store, self.key, self.signing_key) if held else None
        held -= set(outputs.RESERVED_NAMES)
        listed = manifest or {}
        unlisted = sorted(held - set(listed))
        if unlisted:
            print(
                f"kinetic runner: not restoring {len(unlisted)} file(s) under {self.store.url_for(self.key)} that "
                f"its signed manifest does not list (not saved by a job of this task run), e.g. {unlisted[:3]}",
                file=sys.stderr,
                flush=True,
            )
        wanted = sorted(rel for rel in listed if rel in held)  # listed but absent: a save cut short, nothing to use

        def fetch(rel: str) -> outputs.Version:
            dest = self.dir.joinpath(*rel.split("/"))
            self.store.get_file(base + rel, dest)
            return outputs.check_file(dest, listed[rel], f"checkpoint {self.store.url_for(base + rel)}")

        try:
            with concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, min(32, len(wanted))), thread_name_prefix="kinetic-checkpoint"
            ) as pool:
                versions = list(pool.map(fetch, wanted))
        except signing.TamperedObject:
            shutil.rmtree(self.dir, ignore_errors=True)  # nothing of a refused checkpoint stays for the function
            raise
        self._stored = dict(zip(wanted, versions, strict=True))
        self._listed = manifest
        return len(wanted)

    def _snapshot(self) -> dict[str, tuple[int, int]]:
        snap = {}
        for path in self.dir.rglob("*"):
            if path.is_file() and not path.name.startswith(".kp-tmp"):
                rel = path.relative_to(self.dir).as_posix()
                if self.signing_key is not None and rel in outputs.RESERVED_NAMES:
                    continue  # the folder's own manifest's name: never uploaded over it
                st = path.stat()
                snap[rel] = (st.st_size, st.st_mtime_ns)
        return snap

    def sync(self) -> int:
        if self.direct is not None or not self.upload:
            return 0
        with self._lock:
            current = self._snapshot()
            changed = [(rel, self.dir / rel) for rel, sig in current.items() if self._synced.get(rel) != sig]
            if self.signing_key is not None:
                return self._sync_signed(current, changed)
            if changed:
                self.store.put_tree(self.key, changed)
            self._synced = current
            return len(changed)

    def _sync_signed(self, current: dict[str, tuple[int, int]], changed: list[tuple[str, Path]]) -> int:
        staging = Path(tempfile.mkdtemp(prefix="kinetic-checkpoint-stage-", dir=_scratch_root()))
        try:
            staged: dict[str, tuple[Path, outputs.Version]] = {}
            for i, (rel, path) in enumerate(changed):
                try:
                    staged[rel] = (staging / str(i), outputs.stage_file(path, staging / str(i)))
                except FileNotFoundError:  # gone since the snapshot (a temporary file): not saved
                    continue
            final: outputs.Manifest = {
                rel: [staged[rel][1] if rel in staged else self._stored[rel]]
                for rel in current
                if rel in staged or rel in self._stored
            }
            if not staged and final == (self._listed or {}):
                return 0  # nothing new (nothing ever saved: no manifest, no folder)
            replaced = {
                rel: [version, self._stored[rel]]
                for rel, (_path, version) in staged.items()
                if rel in self._stored and self._stored[rel] != version
            }
            if replaced:  # while the new versions upload, the store holds old or new: both are the job's
                outputs.write_manifest(self.store, self.key, {**final, **replaced}, self.signing_key)
            if staged:
                self.store.put_tree(self.key, [(rel, path) for rel, (path, _v) in staged.items()])
            self._stored.update({rel: version for rel, (_path, version) in staged.items()})
            outputs.write_manifest(self.store, self.key, final, self.signing_key)  # last: the save is complete
            self._listed = final
            self._synced = {rel: sig for rel, sig in current.items() if rel in final}
            return len(staged)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def start(self) -> None:
        if self.direct is not None or not self.upload:
            return
        import threading

        interval = settings.CHECKPOINT_SYNC_SECONDS.value()

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

    def remove_local_copy(self) -> None:
        """The temporary copy of a remote store's checkpoints; the store keeps them. A folder in a local store
        that the function left empty is removed: an empty checkpoint folder per call is only clutter."""
        if self.direct is None:
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        with contextlib.suppress(OSError):
            self.dir.rmdir()  # only when empty


def _localize_data(
    args: tuple[Any, ...], kwargs: dict[str, Any], store: Store, key: signing.KeyLike
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    from kinetic_prefect.pod import data

    node_cache = _node_cache()
    resolve = lambda ref: data.localize(ref, store, node_cache, key)  # noqa: E731
    return data.transform(args, resolve, data.DataRef), data.transform(kwargs, resolve, data.DataRef)


SigtermHandler = Callable[[int, FrameType | None], None]


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    """SIGTERM in a job (a cancel, a deleted pod): unwind the function like Ctrl-C would."""
    raise JobTerminated(f"the job received signal {signum} (cancelled, or its pod was deleted)")


# The SIGTERM handler main installs: on_sigterm, or what record_sigterm wraps it in. Under its private name because
# pod/slot_runner still reads and replaces it there.
_on_sigterm: SigtermHandler = on_sigterm


def install_sigterm_handler() -> None:
    """Install the SIGTERM handler main installs (again, where a call may have replaced it)."""
    signal.signal(signal.SIGTERM, _on_sigterm)


def record_sigterm() -> list[int]:
    """From now on, in this process and every call main runs in it, a SIGTERM is appended to the returned list
    before it unwinds the call as in a cold job: a warm runner whose call was stopped stops too."""
    global _on_sigterm
    stopped: list[int] = []
    unwind = _on_sigterm

    def on_sigterm_recorded(signum: int, frame: FrameType | None) -> None:
        stopped.append(signum)
        unwind(signum, frame)

    _on_sigterm = on_sigterm_recorded
    install_sigterm_handler()
    return stopped


def _cancel_own_run(reason: str) -> None:
    """Mark this job's flow run Cancelled through Prefect's REST API (stdlib only: no Prefect here)."""
    import urllib.request

    api, run = os.environ.get(Env.PREFECT_API_URL), os.environ.get(Env.FLOW_RUN_ID)
    if not api or not run:
        return
    body = json.dumps({"state": {"type": "CANCELLED", "name": "Cancelled", "message": reason}, "force": True})
    request = urllib.request.Request(
        f"{api.rstrip('/')}/flow_runs/{run}/set_state",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    if os.environ.get(Env.PREFECT_API_KEY):
        request.add_header("Authorization", f"Bearer {os.environ[Env.PREFECT_API_KEY]}")
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except Exception as exc:  # the run then stays for a sweep; the job still stops
        print(f"kinetic runner: could not cancel run {run}: {exc!r}", file=sys.stderr, flush=True)


def watch_owner(owner_pid: int) -> None:
    """In-process submission: the calling process is the only one that will collect the result.
    If it dies (kill -9, OOM), stop the job and cancel its run instead of running for nobody."""

    def owner_alive() -> bool:
        if os.getppid() != owner_pid:
            return False
        try:
            os.kill(owner_pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def watch() -> None:
        while owner_alive():
            time.sleep(0.5)
        _stop_for_gone_owner(f"The calling process (pid {owner_pid}) died; nobody can collect this job's result.")

    threading.Thread(target=watch, name="kinetic-owner-watch", daemon=True).start()


def _stop_for_gone_owner(reason: str) -> None:
    global _OWNER_DIED
    _OWNER_DIED = True
    print(f"kinetic runner: {reason} Stopping.", file=sys.stderr, flush=True)
    _cancel_own_run(reason)
    os.kill(os.getpid(), signal.SIGTERM)


def watch_heartbeat(silence_seconds: float) -> None:
    """In-process submission on another machine (kinetic-vertex, kinetic-gke): the calling process rewrites the
    run's heartbeat record in the store while it follows the job. A record unchanged for ``silence_seconds`` (or
    gone) means nobody will collect the result: stop, as ``watch_owner`` does, so the machine stops billing. Only
    reads that succeed count: a store that cannot be read proves nothing about the caller."""
    from kinetic_prefect.storage import ObjectNotFound, open_store

    store_url, run_id = _env(Env.STORE, required=False), _run_id()
    if not store_url or not run_id:
        return
    key = RunLayout(run_id).owner_heartbeat
    interval = max(0.2, min(5.0, silence_seconds / 12))

    def watch() -> None:
        store: Store | None = None
        last: bytes | None = None
        changed_at = time.monotonic()
        while True:
            time.sleep(interval)
            try:
                store = store or open_store(store_url)
                try:
                    seen = store.get_bytes(key)
                except ObjectNotFound:
                    seen = b""
            except Exception:
                changed_at = time.monotonic()
                continue
            if seen != last:
                last, changed_at = seen, time.monotonic()
            elif time.monotonic() - changed_at >= silence_seconds:
                break
        _stop_for_gone_owner(
            f"The calling process has not renewed its heartbeat ({key}) for {silence_seconds:.0f} s: it died or "
            "lost its connection, and nobody can collect this job's result."
        )

    threading.Thread(target=watch, name="kinetic-heartbeat-watch", daemon=True).start()


def _describe_failure(failed: PhaseFailed, outcome: Outcome) -> None:
    exc = failed.error
    outcome.status = FAILED
    outcome.phase = failed.phase
    outcome.error_type = f"{type(exc).__module__}.{type(exc).__qualname__}"
    outcome.message = str(exc)
    outcome.traceback = "".join(traceback.format_exception(exc))
    # The function's own exceptions, and a return value that cannot travel, are the user's to fix:
    # retrying the same code on new infrastructure would fail the same way.
    outcome.user_error = failed.phase in (PHASE_FUNCTION, PHASE_PICKLE_RESULT) and not isinstance(exc, JobTerminated)
    if isinstance(exc, SystemExit):
        code = exc.code
        outcome.exit_code = code if isinstance(code, int) else (0 if code is None else 1)


def _signing_key() -> signing.Keyring | None:
    key = signing.key_from_env()
    if key is None and os.environ.get(signing.REQUIRED_ENV):
        raise RuntimeError(
            f"the caller signed this job's payload but the job has no {signing.KEY_ENV}: give the "
            f"worker the key (environment variable {signing.KEY_ENV} or the Prefect Secret block "
            f"{signing.SECRET_BLOCK!r}); it hands it to the job"
        )
    return key


def _run_id() -> str:
    explicit = os.environ.get(Env.RUN_ID)
    if explicit:
        return explicit
    return (_env(Env.RUN_PREFIX) or "").rstrip("/").rsplit("/", 1)[-1]


class _Job:
    """One run of the runner, phase by phase: what the phases share, and what the last step removes from the node."""

    def __init__(self) -> None:
        self.phases = Phases()
        self.outcome = Outcome(status=FAILED, pid=os.getpid(), hostname=socket.gethostname())
        self.group = Group()
        self.store: Store | None = None
        self.layout: RunLayout | None = None
        self.output_dir: Path | None = None
        self.temporary_output_dir: Path | None = None
        self.work_dir: Path | None = None
        self.checkpoints: CheckpointSync | None = None
        self.signing_key: signing.Keyring | None = None  # the job's keys: its checkpoints and outputs are signed

    def run(self) -> bytes | None:
        """Every phase up to the pickled value; after a failed phase (named in the outcome), its pickled exception
        (None when even that cannot be pickled)."""
        try:
            fn, args, kwargs = self._prepare()
            value = self._run_function(fn, args, kwargs)
            result_blob = self.phases.run(PHASE_PICKLE_RESULT, _pickle_value, value)
            self.outcome.status = COMPLETED
            return result_blob
        except PhaseFailed as failed:
            _describe_failure(failed, self.outcome)
            exception_blob = _pickle_exception(failed.error)
            # Printed so the failure is in the job's log even if the outcome cannot be stored.
            print(
                f"kinetic runner: failed while {failed.phase}: {type(failed.error).__name__}: {failed.error}",
                file=sys.stderr,
                flush=True,
            )
            return exception_blob

    def _prepare(self) -> Call:
        """The phases before the function: the call fetched and checked, the project, the outputs folder, the data
        and the checkpoints in place, the group joined, and a debugger attached when one is asked for."""
        store, payload, signing_key = self._fetch_payload()
        self.signing_key = signing_key
        self._restore_project(store)
        self._make_output_dir()
        fn, args, kwargs = self.phases.run(contract.PHASE_UNPICKLE_CALL, _unpickle_call, payload)
        args, kwargs = self.phases.run(contract.PHASE_FETCH_DATA, _localize_data, args, kwargs, store, signing_key)
        self._restore_checkpoints(store, signing_key)
        group = self.group
        if group.size > 1:
            self.phases.run(contract.PHASE_JOIN_GROUP.format(size=group.size, index=group.index), _join_group, group)
        if debugger.wanted(group.index):
            self.phases.run(
                contract.PHASE_WAIT_DEBUGGER, debugger.wait_for_client, self.store, self.layout, self.work_dir, fn
            )
        return fn, args, kwargs

    def _fetch_payload(self) -> tuple[Store, bytes, signing.Keyring | None]:
        """Reading the environment, opening the store, fetching and verifying the payload: the store, the pickled
        call, and the key that signed it (its data is verified with it too)."""
        from kinetic_prefect.storage import open_store

        phases = self.phases
        self.group = group = phases.run(contract.PHASE_READ_ENV, Group.from_env)
        self.outcome.host_index, self.outcome.num_hosts = group.index, group.size
        store_url = phases.run(contract.PHASE_READ_ENV, _env, Env.STORE)
        self.layout = layout = RunLayout(_run_id())
        self.store = store = phases.run(contract.PHASE_OPEN_STORE, open_store, store_url)
        signing_key = phases.run(contract.PHASE_READ_ENV, _signing_key)
        payload = phases.run(contract.PHASE_FETCH_PAYLOAD, _fetch, store, layout.payload)
        phases.run(contract.PHASE_VERIFY_PAYLOAD, _verify, payload, _env(Env.PAYLOAD_SHA256), "payload")
        phases.run(contract.PHASE_VERIFY_PAYLOAD, signing.verify, store, layout.payload, payload, signing_key)
        return store, payload, signing_key

    def _restore_project(self, store: Store) -> None:
        """The project's code, when the call ships it: restored once per node, copied for this job, which runs in
        the copy with it first on sys.path."""
        code_key = os.environ.get(Env.CODE_KEY)
        if not code_key:
            return
        code_dir = self.phases.run(
            contract.PHASE_RESTORE_CODE, _restore_code, store, code_key, os.environ.get(Env.CODE_SHA256)
        )
        self.work_dir = work_dir = self.phases.run(
            PHASE_WORKING_COPY, working_copy.working_copy, code_dir, _scratch_root()
        )
        os.chdir(work_dir)
        sys.path.insert(0, str(work_dir))

    def _make_output_dir(self) -> None:
        """``KINETIC_OUTPUT_DIR``: the one the job names, else a temporary folder removed at the end."""
        if os.environ.get(Env.OUTPUT_DIR):
            output_dir = Path(os.environ[Env.OUTPUT_DIR])
        else:
            output_dir = self.temporary_output_dir = Path(
                tempfile.mkdtemp(prefix="kinetic-outputs-", dir=_scratch_root())
            )
        self.output_dir = output_dir
        output_dir.mkdir(parents=True, exist_ok=True)
        os.environ[Env.OUTPUT_DIR] = str(output_dir)

    def _restore_checkpoints(self, store: Store, signing_key: signing.Keyring | None) -> None:
        """``KINETIC_CHECKPOINT_DIR``, when the job names a checkpoint key: restored (checked against its signed
        manifest when the job is signed), then synced while it runs."""
        if not os.environ.get(Env.CHECKPOINT_KEY):
            return
        checkpoints = CheckpointSync(
            store, os.environ[Env.CHECKPOINT_KEY], upload=self.group.is_coordinator, signing_key=signing_key
        )
        self.checkpoints = checkpoints
        self.outcome.checkpoint_files_restored = self.phases.run(
            contract.PHASE_RESTORE_CHECKPOINTS, checkpoints.restore
        )
        os.environ[Env.CHECKPOINT_DIR] = str(checkpoints.dir)
        checkpoints.start()

    def _run_function(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The function, what it uses sampled beside it, then its checkpoints and outputs saved: after a failure
        too, which is when they matter most. The function's own failure is the one reported."""
        function_failure: PhaseFailed | None = None
        value: Any = None
        usage = utilization.start()  # what the function uses, sampled beside it (no Prefect in the job)
        try:
            value = self.phases.run(PHASE_FUNCTION, _call, fn, args, kwargs)
        except PhaseFailed as failed:
            function_failure = failed
        finally:
            if usage is not None:
                usage.stop()
        self._save_checkpoints(function_failure)
        self._save_outputs(function_failure)
        if function_failure is not None:
            raise function_failure
        return value

    def _save_checkpoints(self, function_failure: PhaseFailed | None) -> None:
        if self.checkpoints is None:
            return
        try:
            self.phases.run(contract.PHASE_SAVE_CHECKPOINTS, self.checkpoints.stop)
        except PhaseFailed as failed:
            if function_failure is None:
                raise
            print(f"kinetic runner: also failed while saving checkpoints: {failed.error!r}", file=sys.stderr)

    def _save_outputs(self, function_failure: PhaseFailed | None) -> None:
        try:
            self.outcome.outputs = self.phases.run(
                contract.PHASE_UPLOAD_OUTPUTS,
                _upload_outputs,
                self.store,
                self.layout,
                self.output_dir,
                self.group.index,
                self.signing_key,
            )
        except PhaseFailed as failed:
            if function_failure is None:
                raise
            print(f"kinetic runner: also failed while uploading outputs: {failed.error!r}", file=sys.stderr)

    def record(self, result_blob: bytes | None) -> int:
        """The value (or exception) and then the outcome written to the store; the exit status says whether the
        outcome was recorded."""
        store, layout, outcome = self.store, self.layout, self.outcome
        if store is None or layout is None:
            return EXIT_NO_OUTCOME
        if _OWNER_DIED:  # nobody will collect anything: leave nothing of the run in the store
            try:
                store.delete_prefix(layout.prefix + "/")
            except Exception as exc:  # `kinetic-prefect cleanup` finds what stays
                print(f"kinetic runner: could not remove {layout.prefix}: {exc!r}", file=sys.stderr, flush=True)
            return EXIT_NO_OUTCOME
        try:
            key = signing.key_from_env()
            if not self.group.is_coordinator:
                # Only the coordinator's value comes back; another host records how it ended, and its failure
                # fails the whole group (all or nothing: the task's retry starts a new group).
                signing.put(store, layout.host_outcome(self.group.index), outcome.to_json(), key)
                return EXIT_OUTCOME_RECORDED if outcome.completed else EXIT_HOST_FAILED
            if result_blob is not None:
                _write_result(store, layout, result_blob, outcome, key)
            signing.put(store, layout.outcome, outcome.to_json(), key)  # the marker: written last
        except Exception as exc:
            print(f"kinetic runner: failed while writing the outcome: {type(exc).__name__}: {exc}", file=sys.stderr)
            return EXIT_NO_OUTCOME
        return EXIT_OUTCOME_RECORDED

    def clean_up(self) -> None:
        """Nothing left behind on the node: the store has the outputs and checkpoints now."""
        if self.temporary_output_dir is not None:
            shutil.rmtree(self.temporary_output_dir, ignore_errors=True)
        if self.checkpoints is not None:
            self.checkpoints.remove_local_copy()
        if self.work_dir is not None:
            working_copy.release(self.work_dir)
        if _OWNER_DIED and os.environ.get(Env.JOB_DIR):  # no worker is left to remove the job's folder
            shutil.rmtree(os.environ[Env.JOB_DIR], ignore_errors=True)


def _write_result(store: Store, layout: RunLayout, result_blob: bytes, outcome: Outcome, key: signing.KeyLike) -> None:
    """The pickled value or exception; one the store has no room for fails the outcome instead, naming the store."""
    try:
        signing.put(store, layout.result, result_blob, key)
    except OSError as exc:
        if exc.errno not in _NO_ROOM:
            raise
        signing.delete(store, layout.result)  # a partial object frees its room for the outcome
        _store_full(outcome, store, layout.result, len(result_blob), exc)


def main() -> int:
    """Run the call the job's environment names; the exit status says whether its outcome was recorded."""
    global _GROUP_FAILED
    started = time.perf_counter()
    install_sigterm_handler()
    if os.environ.get(Env.OWNER_PID):
        watch_owner(int(os.environ[Env.OWNER_PID]))
    if os.environ.get(Env.OWNER_HEARTBEAT):
        watch_heartbeat(float(os.environ[Env.OWNER_HEARTBEAT]))
    job = _Job()
    try:
        result_blob = job.run()
        if job.group.size > 1 and not job.outcome.completed:
            _GROUP_FAILED = True
        job.outcome.timings = job.phases.timings
        job.outcome.duration_s = round(time.perf_counter() - started, 4)
        return job.record(result_blob)
    finally:
        job.clean_up()


_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


def _store_full(outcome: Outcome, store: Store, object_key: str, size: int, exc: OSError) -> None:
    """The outcome of a job whose result did not fit in the store: Failed (not Crashed), naming the store."""
    outcome.status, outcome.phase, outcome.error_type = FAILED, PHASE_WRITE_RESULT, STORE_FULL_ERROR
    outcome.user_error = False
    outcome.message = (
        f"{errno.errorcode.get(exc.errno or 0, exc.errno)} ({exc.strerror}) while writing the result "
        f"({size / 2**20:.1f} MiB) to {store.url_for(object_key)}: the store {store.url} is full. Free "
        f"space there, or return less and write large results to {Env.OUTPUT_DIR}"
    )
    outcome.traceback = "".join(traceback.format_exception(exc))
    print(f"kinetic runner: {outcome.message}", file=sys.stderr, flush=True)


# How long a runner that has recorded its outcome waits for threads the function left running (not daemons)
# before it leaves without them: the interpreter would otherwise wait for them forever, and the job would
# hang, its value recorded but never collected, until a timeout cancelled it.
STRAY_THREAD_GRACE_SECONDS = 10.0


def _record_exit(code: int) -> None:
    """The exit record in the job's folder (kinetic-local): its time is when this host's work ended, so a job
    is billed to its own end, not to when a worker (blocked by an API outage, say) first saw it gone."""
    job_dir = os.environ.get(Env.JOB_DIR)
    if not job_dir or _OWNER_DIED:
        return
    name = WarmRunnerFiles.exit_status_name(int(os.environ.get(Env.HOST_INDEX) or 0))
    with contextlib.suppress(OSError):  # metering then falls back to when the worker saw the process gone
        Path(job_dir, name).write_text(str(code))


def _leave_without_stray_threads(code: int, grace: float = STRAY_THREAD_GRACE_SECONDS) -> None:
    """Arm a hard exit for when threads the function started (not daemons) keep the interpreter from ending."""
    stray = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if not stray:
        return

    def leave() -> None:
        time.sleep(grace)
        print(
            f"kinetic runner: the function left {len(stray)} thread(s) running ({', '.join(stray[:5])}); "
            f"the outcome is recorded, so the job ends without them after {grace:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(code)

    threading.Thread(target=leave, name="kinetic-stray-thread-exit", daemon=True).start()


def exit_process(code: int) -> None:
    """A host of a group whose function failed leaves at once: JAX's exit handler (``jax.distributed.shutdown``)
    waits at a barrier for every host, and the others may be blocked in a collective waiting for this one, so
    a normal exit would hang until the coordination service times out (minutes). The worker then stops the
    rest of the group (all or nothing). A host that completed exits normally: the barrier is where all meet,
    and exit handlers (a metrics logger's flush) run; threads the function left behind are not waited for."""
    _record_exit(code)
    failed = code != EXIT_OUTCOME_RECORDED or _GROUP_FAILED
    if failed and int(os.environ.get(Env.NUM_HOSTS) or 1) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _leave_without_stray_threads(code)
    sys.exit(code)


_OWNER_DIED = False  # set by the owner watch: the calling process is gone, nobody collects the result
_GROUP_FAILED = False  # set by main() when this host's function (or a later step) failed in a group


if __name__ == "__main__":
    exit_process(main())
