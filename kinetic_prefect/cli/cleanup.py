"""``kinetic-prefect cleanup``: what a crash can still leave behind, listed (dry run) or removed (``--yes``).

Every way a call ends removes its own leftovers (see docs/failures-store.md); what remains is what a process
killed at the wrong moment could not remove:

* ``runs/<id>/payload.pkl`` of a run that wrote no result (a job still writing after its caller gave up
  waiting leaves what it wrote);
* ``runs/<id>/result.pkl`` (with its payload and signatures) only with ``--uncollected-older-than``: a result
  waits to be collected, by a detached job's ``kinetic.attach(id).result()`` or ``jobs result ID`` hours later,
  so it is never removed under the ordinary age; a polling caller killed with ``kill -9`` leaves one too;
* empty ``runs/<id>/`` and ``checkpoints/<task run>/`` folders;
* ``sweeps/<id>/`` records of sweeps that are over: no slot run of theirs is unfinished and they are ``closed``
  or untouched for ``--older-than`` (a caller killed before its sweep closed); a live sweep is kept whole, and
  so are its inputs' payloads and checkpoints (a queued input has no job run of its own to protect them);
* ``jobs/<run>/`` folders of ``kinetic-local`` jobs whose processes are gone and that no worker will reattach to;
* Prefect Secret blocks ``kinetic-env-<run id>`` (a call's forwarded ``env=`` secrets) of runs that are over
  or gone: the worker deletes the block it reads and the caller the block no worker read, so one remains only where
  the caller was killed before its run was taken (or its run was deleted);
* ``kinetic-outputs-*``, ``kinetic-checkpoint-*`` and ``kinetic-work-*`` folders in TMPDIR (jobs of versions
  that kept them there, or jobs started without a job folder) and half-unpacked ``.extract-*`` folders in the
  node cache.

Only what is older than ``--older-than`` minutes counts, and nothing that belongs to a kinetic run Prefect still
has as not final (its store objects, checkpoints and job folder are in use). Local stores only; on a gs:// store
use a bucket lifecycle rule for ``runs/``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import typer

from kinetic_prefect import config
from kinetic_prefect.cli.console import ClickException
from kinetic_prefect.contract import Env, RunLayout, SweepKeys
from kinetic_prefect.contract.layout import ENV_BLOCK_PREFIX
from kinetic_prefect.signing import SUFFIX

TMP_PREFIXES = ("kinetic-outputs-", "kinetic-checkpoint-", "kinetic-work-")


@dataclass(frozen=True)
class Leftover:
    path: Path
    size: int
    why: str


@dataclass(frozen=True)
class BlockLeftover:
    """A Prefect Secret block left by a run that is over: listed and removed with the store's leftovers."""

    name: str
    block_id: str
    why: str
    size: int = 0

    @property
    def path(self) -> str:
        return f"Secret block {self.name}"


def env_block_leftovers(run_ids: set[str], cutoff: float) -> list[BlockLeftover]:
    """The forwarded-env blocks (``kinetic-env-<run id>``) last written before ``cutoff`` whose run Prefect does not
    have as unfinished: the run is over (done, refused, cancelled) or gone, so no worker will read them, and their
    secrets stay readable to every API user until deleted. A block younger than ``cutoff`` may belong to a call
    that has saved it and is creating its run."""
    from prefect import get_client

    found: list[BlockLeftover] = []
    with get_client(sync_client=True) as client:
        offset = 0
        while True:
            page = client.read_block_documents_by_type("secret", offset=offset, limit=200, include_secrets=False)
            for doc in page:
                name = doc.name or ""
                written = doc.updated or doc.created
                if not name.startswith(ENV_BLOCK_PREFIX) or name.removeprefix(ENV_BLOCK_PREFIX) in run_ids:
                    continue
                if written is None or written.timestamp() < cutoff:
                    found.append(BlockLeftover(name, str(doc.id), "a run's forwarded env= secrets; the run is over"))
            if len(page) < 200:
                return found
            offset += 200


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _newest_mtime(path: Path) -> float:
    times = [path.stat().st_mtime]
    if path.is_dir():
        times += [p.stat().st_mtime for p in path.rglob("*")]
    return max(times)


class Active(NamedTuple):
    """What the kinetic job runs Prefect has as not final use."""

    run_ids: set[str]  # their store run ids
    checkpoints: set[str]  # their checkpoint keys
    flow_runs: set[str]  # their flow run ids
    sweeps: frozenset[str] | set[str] = frozenset()  # the sweep ids of the unfinished slot runs


def active_runs() -> Active:
    """(store run ids, checkpoint keys, flow run ids, sweep ids) of the kinetic job runs Prefect has as not
    final."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType

    unfinished = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING, StateType.PAUSED]
    run_ids: set[str] = set()
    checkpoints: set[str] = set()
    flow_runs: set[str] = set()
    sweeps: set[str] = set()
    with get_client(sync_client=True) as client:
        offset = 0
        while True:
            page = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    tags=FlowRunFilterTags(all_=["kinetic"]),
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=unfinished)),
                ),
                limit=200,
                offset=offset,
            )
            for run in page:
                env = (run.job_variables or {}).get("env") or {}
                flow_runs.add(str(run.id))
                if env.get(Env.RUN_ID):
                    run_ids.add(env[Env.RUN_ID])
                if env.get(Env.CHECKPOINT_KEY):
                    checkpoints.add(env[Env.CHECKPOINT_KEY])
                if env.get(Env.SWEEP_ID):
                    sweeps.add(env[Env.SWEEP_ID])
            if len(page) < 200:
                return Active(run_ids, checkpoints, flow_runs, sweeps)
            offset += 200


def _final_or_unknown(flow_run_id: str, active: set[str]) -> bool:
    return flow_run_id not in active


def _job_processes_gone(record: dict) -> bool:
    from kinetic_prefect.workers.local.launcher import LocalJobLauncher, process_start_ticks

    hosts = LocalJobLauncher.hosts_of(record) if record.get("pid") or record.get("hosts") else []
    return all(process_start_ticks(int(h["pid"])) != h.get("start_ticks") for h in hosts if h.get("pid"))


def find(
    store_root: Path,
    older_than_s: float,
    tmp_dir: Path | None = None,
    cache_dir: Path | None = None,
    active: Active | tuple[set[str], ...] | None = None,
    uncollected_older_than_s: float | None = None,
) -> list[Leftover]:
    """What ``cleanup`` would remove, oldest rule first. A run's result (and the payload beside it) waits to be
    collected: it is listed only when ``uncollected_older_than_s`` is given and it is that old."""
    run_ids, checkpoint_keys, flow_runs, live_slots = Active(*active) if active is not None else active_runs()
    now = time.time()
    cutoff = now - older_than_s
    sweeps = _sweeps(store_root, live_slots, cutoff)
    run_ids = run_ids | sweeps.input_runs  # a live sweep's inputs: queued, running or waiting to be collected
    checkpoint_keys = checkpoint_keys | sweeps.input_checkpoints
    return [
        *_run_leftovers(store_root, run_ids, now, cutoff, uncollected_older_than_s),
        *_checkpoint_leftovers(store_root, checkpoint_keys, cutoff),
        *sweeps.over,
        *_local_job_leftovers((cache_dir or config.cache_dir()) / "jobs", flow_runs, cutoff),
        *_tmp_leftovers(tmp_dir or Path(tempfile.gettempdir()), cutoff),
        *_half_unpacked_archives(cutoff),
    ]


def _run_leftovers(
    store_root: Path, run_ids: set[str], now: float, cutoff: float, uncollected_older_than_s: float | None
) -> list[Leftover]:
    """Under ``runs/``, for runs no longer active: payloads whose job wrote no result, results nobody collected
    (only with ``uncollected_older_than_s``), empty run folders."""
    found: list[Leftover] = []
    runs = store_root / "runs"
    if not runs.is_dir():
        return found
    for run_dir in sorted(p for p in runs.iterdir() if p.is_dir()):
        if run_dir.name in run_ids:
            continue
        layout = RunLayout(run_dir.name)
        objects = [store_root / key for obj in (layout.payload, layout.result) for key in (obj, obj + SUFFIX)]
        result = store_root / layout.result
        if result.is_file():
            if uncollected_older_than_s is None or result.stat().st_mtime >= now - uncollected_older_than_s:
                continue  # a value waiting for its collector
            why = "a result nobody collected (older than --uncollected-older-than)"
        else:
            why = "a payload whose job wrote no result"
        for path in (p for p in objects if p.is_file() and p.stat().st_mtime < cutoff):
            found.append(Leftover(path, path.stat().st_size, why))
        if not any(run_dir.iterdir()) and run_dir.stat().st_mtime < cutoff:
            found.append(Leftover(run_dir, 0, "an empty run folder"))
    return found


@dataclass
class _Sweeps:
    over: list[Leftover] = field(default_factory=list)  # the records of sweeps that are over
    input_runs: set[str] = field(default_factory=set)  # the run ids of live sweeps' inputs
    input_checkpoints: set[str] = field(default_factory=set)  # their checkpoint keys


def _sweeps(store_root: Path, live_slots: frozenset[str] | set[str], cutoff: float) -> _Sweeps:
    """The sweeps under ``sweeps/``: over (no unfinished slot run, and closed or untouched since ``cutoff``), or
    live, whose inputs' run ids and checkpoints are kept."""
    found = _Sweeps()
    root = store_root / SweepKeys.ROOT
    if not root.is_dir():
        return found
    for sweep_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        keys = SweepKeys(sweep_dir.name)
        try:
            closed = (store_root / keys.closed).exists()
            if sweep_dir.name not in live_slots and (closed or _newest_mtime(sweep_dir) < cutoff):
                why = "a closed sweep's records" if closed else "the records of a sweep whose slot runs all ended"
                found.over.append(Leftover(sweep_dir, _size(sweep_dir), why))
                continue
            queue = store_root / keys.queue
            queued = sorted(queue.glob("*" + SweepKeys.QUEUED_SUFFIX)) if queue.is_dir() else []
        except FileNotFoundError:  # its caller removed it meanwhile
            continue
        for path in queued:
            found.input_runs.add(SweepKeys.run_id_of(path.name))
            with contextlib.suppress(OSError, ValueError, AttributeError):
                checkpoint = (json.loads(path.read_text()).get("env") or {}).get(Env.CHECKPOINT_KEY)
                if checkpoint:
                    found.input_checkpoints.add(checkpoint)
    return found


def _checkpoint_leftovers(store_root: Path, checkpoint_keys: set[str], cutoff: float) -> list[Leftover]:
    """Empty checkpoint folders under ``checkpoints/`` that no active run uses."""
    checkpoints = store_root / "checkpoints"
    if not checkpoints.is_dir():
        return []
    active_dirs = {store_root / key for key in checkpoint_keys}
    return [
        Leftover(folder, 0, "an empty checkpoint folder")
        for folder in sorted(p for p in checkpoints.iterdir() if p.is_dir())
        if folder not in active_dirs
        and folder.stat().st_mtime < cutoff
        and not any(p.is_file() for p in folder.rglob("*"))
    ]


def _local_job_leftovers(jobs: Path, flow_runs: set[str], cutoff: float) -> list[Leftover]:
    """kinetic-local job folders whose run is final (or unknown) and whose processes are gone."""
    found: list[Leftover] = []
    if not jobs.is_dir():
        return found
    for job_dir in sorted(p for p in jobs.iterdir() if p.is_dir()):
        if not _final_or_unknown(job_dir.name, flow_runs):
            continue
        try:
            record = json.loads((job_dir / "job.json").read_text())
        except (OSError, ValueError):
            record = {}
        if record and not _job_processes_gone(record):
            continue
        if _newest_mtime(job_dir) < cutoff:
            found.append(Leftover(job_dir, _size(job_dir), "a local job's folder; its processes are gone"))
    return found


def _tmp_leftovers(tmp: Path, cutoff: float) -> list[Leftover]:
    if not tmp.is_dir():
        return []
    return [
        Leftover(folder, _size(folder), "a job's temporary folder")
        for folder in sorted(p for p in tmp.iterdir() if p.is_dir() and p.name.startswith(TMP_PREFIXES))
        if _newest_mtime(folder) < cutoff
    ]


def _half_unpacked_archives(cutoff: float) -> list[Leftover]:
    """Project archives a job began to unpack into the node's code cache and never finished."""
    from kinetic_prefect.pod.runner import _node_cache

    node_code = _node_cache() / "code"
    if not node_code.is_dir():
        return []
    return [
        Leftover(folder, _size(folder), "a half-unpacked project archive")
        for folder in sorted(p for p in node_code.iterdir() if p.is_dir() and p.name.startswith(".extract-"))
        if _newest_mtime(folder) < cutoff
    ]


def remove(leftovers: list[Leftover] | list[Leftover | BlockLeftover]) -> int:
    """Delete them; returns how many were removed (one already gone is not an error)."""
    removed = 0
    for item in leftovers:
        if isinstance(item, BlockLeftover):
            removed += _delete_block(item)
            continue
        try:
            if item.path.is_dir():
                shutil.rmtree(item.path)
            else:
                item.path.unlink()
            removed += 1
        except FileNotFoundError:
            continue
        if item.path.parent.parent.name == "runs":  # the run folder, once its last object is gone
            with contextlib.suppress(OSError):
                item.path.parent.rmdir()
    return removed


def _delete_block(item: BlockLeftover) -> int:
    from uuid import UUID

    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.delete_block_document(UUID(item.block_id))
        except ObjectNotFound:  # its worker read it meanwhile
            return 0
    return 1


def store_root(url: str | None) -> Path:
    """The local directory of the store ``url`` (default: the default store); a gs:// store is refused."""
    url = url or config.default_store_url()
    if url.startswith("gs://"):
        raise ValueError(f"{url}: cleanup handles local stores; on a bucket, expire runs/ with a lifecycle rule")
    return Path(url).expanduser().resolve()


def describe(leftovers: list[Leftover] | list[Leftover | BlockLeftover], deleting: bool) -> str:
    verb = "removing" if deleting else "would remove"
    lines = [f"{verb} {item.path} ({item.size / 2**20:.2f} MiB): {item.why}" for item in leftovers]
    total = sum(item.size for item in leftovers) / 2**20
    if not leftovers:
        lines.append("nothing to clean up")
    elif not deleting:
        lines.append(f"dry run: {len(leftovers)} item(s), {total:.2f} MiB; run again with --yes to delete them")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the command


def cleanup_command(
    store: str | None = typer.Option(
        None, "--store", metavar="DIR", help=f"the local store (default: {Env.STORE} or ~/.cache/kinetic-prefect/store)"
    ),
    older_than: float = typer.Option(60.0, "--older-than", metavar="MINUTES", help="only what is at least this old"),
    uncollected_older_than: float | None = typer.Option(
        None,
        "--uncollected-older-than",
        metavar="MINUTES",
        help="also results nobody collected, this old (without it results are kept until collected)",
    ),
    yes: bool = typer.Option(False, "--yes", help="delete what is listed (without it: a dry run)"),
) -> None:
    """List (or with --yes remove) what crashed calls and jobs left: payloads whose job wrote no result, empty
    run and checkpoint folders, the forwarded-env Secret blocks of runs that are over, dead local jobs' folders,
    jobs' temporary folders, the records of sweeps that are over (never a live sweep's, nor its inputs' payloads);
    uncollected results only with --uncollected-older-than."""
    try:
        root = store_root(store)
        active = active_runs()
    except ValueError as exc:
        raise ClickException(str(exc)) from None
    except Exception as exc:  # the API: without it, objects of running jobs cannot be told apart
        raise ClickException(
            f"cannot read Prefect's unfinished kinetic runs ({type(exc).__name__}: {exc}); "
            "cleanup needs them to leave running jobs alone: check PREFECT_API_URL"
        ) from None
    for name, value in (("--older-than", older_than), ("--uncollected-older-than", uncollected_older_than)):
        if value is not None and value < 0:
            raise ClickException(f"{name} {value:g}: give an age in minutes, 0 or more")
    leftovers: list[Leftover | BlockLeftover] = [
        *find(
            root,
            older_than * 60,
            active=active,
            uncollected_older_than_s=None if uncollected_older_than is None else uncollected_older_than * 60,
        ),
        *env_block_leftovers(active.run_ids, time.time() - older_than * 60),
    ]
    sys.stdout.write(describe(leftovers, deleting=yes))
    if yes and leftovers:
        sys.stdout.write(f"removed {remove(leftovers)} of {len(leftovers)}\n")


def register(app: typer.Typer) -> None:
    """Add ``cleanup`` to the ``kinetic-prefect`` app."""
    app.command("cleanup")(cleanup_command)
