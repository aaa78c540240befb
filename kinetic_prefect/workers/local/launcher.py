"""``LocalJobLauncher``: a kinetic-local job is a local process in a hash-keyed environment.

The embedded default. It runs exactly what a pod would run (``python -m kinetic_prefect.pod.runner``
with the same ``KINETIC_*`` environment), so a flow that works here works on GKE.

Each job has a folder ``<cache>/jobs/<flow run id>/`` holding ``job.json`` (pid, process start
time, pool, owner) and ``job.log`` (the job's stdout and stderr). The job writes to a file, not a
pipe: it is never slowed or blocked by whoever forwards its output, it survives a worker that
dies, and a restarted worker finds the process and the log again and reattaches.

A job runs as the worker's user. What keeps the worker's secrets from it: its environment holds no master key (only
the keyring handed over for its run) and none of Prefect's credentials, whatever the pool's ``inherit_env`` says;
and a polling worker makes itself non-dumpable before its first job (Linux ``PR_SET_DUMPABLE`` 0), so a process of
the same user without ``CAP_SYS_PTRACE`` can read neither ``/proc/<worker>/environ`` nor its memory. Files the
worker's user can read stay readable to its jobs: ``kinetic-prefect doctor`` says so for a kinetic-local pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from prefect.client.schemas.objects import FlowRun

from kinetic_prefect import accelerators, config
from kinetic_prefect.contract import JOB_LOG_NAME, RUNNER_COMMAND, Env, WarmRunnerFiles, host_log_name
from kinetic_prefect.contract.job_variables import never_a_jobs
from kinetic_prefect.shared.processes import process_start_ticks
from kinetic_prefect.workers.base import slot_argv
from kinetic_prefect.workers.job_launcher import JobLauncher, JobStatus
from kinetic_prefect.workers.local import warm
from kinetic_prefect.workers.local.configuration import KineticLocalJobConfiguration, choose_local_accelerator
from kinetic_prefect.workers.local.environments import LocalEnvironments, machine_environment


def _runner_end(job_dir: Path, host_index: int) -> float | None:
    """When a host's runner recorded its exit (``WarmRunnerFiles.exit_status_name``), or None before that."""
    try:
        return (job_dir / WarmRunnerFiles.exit_status_name(host_index)).stat().st_mtime
    except OSError:
        return None


def _ticks_to_epoch(ticks: int | None) -> float | None:
    """A process start time in clock ticks since boot as epoch seconds (for records written before metering)."""
    if ticks is None:
        return None
    try:
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _warn_if_not_on_this_machine(configuration: KineticLocalJobConfiguration, log: Callable[[str], None]) -> None:
    wanted = configuration.env.get("JAX_PLATFORMS") or ""
    if not accelerators.local_platform_available(wanted):
        log(
            f"WARNING: accelerator {configuration.accelerator!r} is not on this machine (no {wanted} device for "
            "JAX): the job runs on the CPU, and is reported and billed as cpu. Use a kinetic-gke pool to get one."
        )


PR_SET_DUMPABLE = 4  # <linux/prctl.h>


def close_to_jobs() -> bool:
    """Make this process non-dumpable (Linux ``prctl(PR_SET_DUMPABLE, 0)``): ``/proc/<pid>/environ``, ``mem`` and
    ptrace are then refused to processes of the same user without ``CAP_SYS_PTRACE``, as its jobs are. A job's own
    ``execve`` makes it dumpable again: only the worker is closed. False where it cannot be done (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class _LogCursor:
    """Reads new complete lines of a job's log file and hands them on in batches.

    A flood is bounded: past ``lines_per_second`` (averaged from the job's start, with a burst
    allowance of a few seconds) lines are counted, not forwarded, and a note takes their place, in
    order ("N lines left out here"), pointing to the whole log, which is kept with the job's
    outputs. Nothing is dropped silently.
    """

    BATCH_LINES = 500
    BATCH_BYTES = 64 * 1024
    BURST_SECONDS = 5

    def __init__(self, path: Path, offset: int, lines_per_second: int):
        self.path, self.offset, self.rate = path, offset, max(1, lines_per_second)
        self.started = time.monotonic()
        self.forwarded = self.dropped = 0
        self._gap = 0  # lines left out since the last forwarded one

    def _note(self) -> str:
        text = (
            f"[kinetic] {self._gap:,} lines of output left out here (over {self.rate:,} lines/s); "
            f"the whole log is kept with the job's outputs as {JOB_LOG_NAME}"
        )
        self._gap = 0
        return text

    def read(self, emit: Callable[[str], None], final: bool) -> None:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                data = handle.read(8 * 2**20)
        except FileNotFoundError:
            return
        end = len(data) if final else data.rfind(b"\n") + 1
        if end > 0:
            self.offset += end
        lines = data[:end].decode(errors="replace").splitlines() if end > 0 else []
        allowance = int(self.rate * (time.monotonic() - self.started + self.BURST_SECONDS)) - self.forwarded
        batch: list[str] = []
        size = 0

        def flush() -> None:
            nonlocal batch, size
            if batch:
                emit("\n".join(batch))
                batch, size = [], 0

        for line in lines:
            if allowance <= 0:
                self._gap += 1
                self.dropped += 1
                continue
            if self._gap:
                batch.append(self._note())
            batch.append(line)
            allowance -= 1
            self.forwarded += 1
            size += len(line) + 1
            if len(batch) >= self.BATCH_LINES or size >= self.BATCH_BYTES:
                flush()
        if final and self._gap:
            batch.append(self._note())
        flush()


class LocalJobLauncher(JobLauncher):
    """Starts the runner as local process groups (one per host of a multi-host group); follows them by pid
    and log file.

    A group of N hosts (``hosts=N``) is N runner processes with ``KINETIC_NUM_HOSTS=N``,
    ``KINETIC_HOST_INDEX=i`` and the coordinator at ``127.0.0.1:<free port>`` (host 0's ``jax.distributed``
    service). Host 0 writes ``job.log``, host i ``host-<i>.log``; host i's lines are forwarded tagged
    ``[host i] `` (host 0's untagged, as on kinetic-gke). All or nothing: the group has exited when every
    process has, or as soon as one exits non-zero, and then the others are stopped.
    """

    job_kind = "local job"

    # After the coordinator has exited, the other hosts get this long to finish (they normally exit with it:
    # JAX's shutdown barrier holds every host until all arrive), then are stopped.
    GROUP_EXIT_GRACE_SECONDS = 10.0
    # A failed host's peers are stopped with SIGTERM, then SIGKILL after this: a peer blocked in a collective
    # waiting for the dead host cannot run its signal handler.
    PEER_STOP_GRACE_SECONDS = 5.0

    def __init__(self, environments: LocalEnvironments | None = None, jobs_dir: Path | None = None):
        self.environments = environments or LocalEnvironments()
        self.jobs_dir = jobs_dir or config.cache_dir() / "jobs"
        self._children: dict[str, list[subprocess.Popen]] = {}
        self._cursors: dict[str, list[_LogCursor]] = {}
        self._coordinator_exited_at: dict[str, float] = {}
        self._group_failure: dict[str, JobStatus] = {}
        self._ended_at: dict[str, dict[int, float]] = {}  # metering: when each host was first seen gone
        self._last_spans: dict[str, list[Any]] = {}
        self.owner_pid: int | None = None  # in-process submission: the caller's pid
        self.warm_runners = warm.runners_for(self.jobs_dir.parent / "warm")
        self.api_env: dict[str, str] = {}
        self._closed_to_jobs = False  # close_to_jobs() done (a polling worker)

    # -------------------------------------------------------------- records
    def job_dir(self, identifier: str) -> Path:
        return self.jobs_dir / identifier

    def read_record(self, identifier: str) -> dict[str, Any] | None:
        """The job's record (``job.json``: its processes, log offsets), or None when there is none."""
        try:
            return json.loads((self.job_dir(identifier) / "job.json").read_text())
        except (OSError, ValueError):
            return None

    @staticmethod
    def hosts_of(record: dict[str, Any]) -> list[dict[str, Any]]:
        """One entry per host process (records of single jobs name only ``pid``/``start_ticks``)."""
        return record.get("hosts") or [
            {"pid": record["pid"], "start_ticks": record.get("start_ticks"), "log_offset": record.get("log_offset", 0)}
        ]

    @staticmethod
    def log_name(index: int) -> str:
        return host_log_name(index)

    def command(self, configuration: KineticLocalJobConfiguration, log: Callable[[str], None]) -> list[str]:
        python = self.environments.python_for(configuration.image_spec, log, configuration.env.get(Env.STORE) or "")
        argv = shlex.split(configuration.command or RUNNER_COMMAND)
        if argv and argv[0] in ("python", "python3"):
            argv[0] = python
        return argv

    def job_environment(self, configuration: KineticLocalJobConfiguration) -> dict[str, str]:
        env = {
            **machine_environment(configuration.inherit_env),
            **{k: str(v) for k, v in configuration.env.items() if v is not None},
            **configuration.secret_env,
            "PYTHONUNBUFFERED": "1",
        }
        if not accelerators.local_platform_available(env.get("JAX_PLATFORMS", "")):
            env["JAX_PLATFORMS"] = "cpu"  # the named accelerator is not on this machine (warned at submit)
        # Prefect's credentials and its server's settings reach no job, whatever put them there: the worker's own
        # Prefect settings (Prefect's base environment of a job), an inherit_env pattern, the pool's env (issue 45,
        # finding 3). A job runs no Prefect; an in-process job's way to cancel its own run is api_env below.
        env = {name: value for name, value in env.items() if not never_a_jobs(name)}
        # Nor the worker's own keys (an inherit_env pattern such as KINETIC_* would give its previous master keys):
        # a job signs with the keyring handed over for its run, in secret_env, or with nothing.
        for name in (Env.SIGNING_KEY, Env.SIGNING_KEY_PREVIOUS):
            if name not in configuration.secret_env:
                env.pop(name, None)
        if self.owner_pid is not None:
            env[Env.OWNER_PID] = str(self.owner_pid)
            env.update(self.api_env)
        else:
            env.pop(Env.OWNER_PID, None)
        return env

    # -------------------------------------------------------------- JobLauncher
    async def submit(
        self, flow_run: FlowRun, configuration: KineticLocalJobConfiguration, log: Callable[[str], None]
    ) -> str:
        identifier = str(flow_run.id)
        if self.owner_pid is None and not self._closed_to_jobs:  # a polling worker, before its first job
            self._closed_to_jobs = close_to_jobs()
        choose_local_accelerator(configuration)
        _warn_if_not_on_this_machine(configuration, log)
        hosts = configuration.host_count
        argv = await anyio.to_thread.run_sync(self.command, configuration, log)
        slot_job = bool(configuration.env.get(Env.SWEEP_ID))  # a sweep's slot: warm by itself, never handed over
        if slot_job:
            argv = slot_argv(argv)
        job_dir = self.job_dir(identifier)
        job_dir.mkdir(parents=True, exist_ok=True)
        for stale in job_dir.glob(f"{WarmRunnerFiles.EXIT_STATUS}*"):  # a relaunch's earlier attempt ended there
            stale.unlink(missing_ok=True)
        self._ended_at.pop(identifier, None)
        base_env = {**self.job_environment(configuration), Env.JOB_DIR: str(job_dir)}
        if hosts > 1:
            base_env.update({Env.NUM_HOSTS: str(hosts), Env.COORDINATOR_ADDRESS: f"127.0.0.1:{_free_port()}"})
            log(
                f"Starting a group of {hosts} job processes "
                f"(host 0 is the coordinator, {base_env[Env.COORDINATOR_ADDRESS]})"
            )
        warm_call = hosts == 1 and configuration.keep_warm_seconds > 0 and not slot_job
        processes = self._start_hosts(flow_run, configuration, argv, base_env, job_dir, warm_call)
        self._children[identifier] = processes
        self._write_record(identifier, configuration, processes, warm_call)
        self._cursors[identifier] = [
            _LogCursor(job_dir / self.log_name(i), 0, configuration.log_lines_per_second) for i in range(hosts)
        ]
        return identifier

    def _start_hosts(
        self,
        flow_run: FlowRun,
        configuration: KineticLocalJobConfiguration,
        argv: list[str],
        base_env: dict[str, str],
        job_dir: Path,
        warm_call: bool,
    ) -> list[subprocess.Popen]:
        """The job's processes, one per host (or the call handed to a warm runner): all started, or none."""
        hosts = configuration.host_count
        processes: list[subprocess.Popen] = []
        try:
            if warm_call:
                processes.append(
                    self.warm_runners.hand_over(
                        argv,
                        configuration.working_dir,
                        base_env,
                        job_dir,
                        self.log_name(0),
                        configuration.keep_warm_seconds,
                        configuration.min_warm,
                        pool=flow_run.work_pool_name or configuration.labels.get("prefect.io/work-pool-name"),
                        accelerator=str(configuration.accelerator),
                        floor_idle_seconds=configuration.warm_floor_idle_seconds,
                        keys=configuration.signing_keys,
                    )
                )
            for index in range(0 if warm_call else hosts):
                env = {**base_env, Env.HOST_INDEX: str(index)} if hosts > 1 else base_env
                with open(job_dir / self.log_name(index), "ab") as out:
                    processes.append(
                        subprocess.Popen(
                            argv,
                            cwd=configuration.working_dir or None,
                            env=env,
                            stdin=subprocess.DEVNULL,
                            stdout=out,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,  # one process group per host: a cancel stops it and its children
                        )
                    )
        except BaseException:
            for process in processes:  # all or nothing from the start
                _kill_group(process.pid, signal.SIGKILL)
            raise
        return processes

    def _write_record(
        self,
        identifier: str,
        configuration: KineticLocalJobConfiguration,
        processes: list[subprocess.Popen],
        warm_call: bool,
    ) -> None:
        """The job's record (``job.json``): what a restarted worker, ``cancel`` and ``cleanup`` find it by."""
        started_at = time.time()  # metering: the hosts' processes start together (cost.HostSpan)
        entries = [
            {"pid": p.pid, "start_ticks": process_start_ticks(p.pid), "log_offset": 0, "started_at": started_at}
            for p in processes
        ]
        record = {
            "pid": processes[0].pid,
            "start_ticks": entries[0]["start_ticks"],
            "flow_run_id": identifier,
            "owner": "caller" if self.owner_pid is not None else "worker",
            "pool": configuration.labels.get("prefect.io/work-pool-name"),
            "log_offset": 0,
            "hosts": entries,
            "warm": warm_call,
        }
        (self.job_dir(identifier) / "job.json").write_text(json.dumps(record))

    async def find(self, flow_run: FlowRun, configuration: KineticLocalJobConfiguration) -> str | None:
        identifier = str(flow_run.id)
        return identifier if self.read_record(identifier) is not None else None

    def _host_states(self, identifier: str) -> list[tuple[bool, int | None]]:
        """(alive, exit code) of each host process; the exit code is known only for our own children."""
        children = self._children.get(identifier)
        if children is not None:
            return [(code is None, code) for code in (child.poll() for child in children)]
        record = self.read_record(identifier)
        if record is None:
            return []
        states: list[tuple[bool, int | None]] = []
        for host in self.hosts_of(record):
            ticks = process_start_ticks(host["pid"])
            states.append((ticks is not None and ticks == host.get("start_ticks"), None))
        return states

    def _alive(self, identifier: str) -> tuple[bool, int | None]:
        """Whether any process of the job still runs; the coordinator's exit code once none does."""
        states = self._host_states(identifier)
        if not states:
            return False, None
        return any(alive for alive, _ in states), states[0][1]

    async def status(self, identifier: str, configuration: KineticLocalJobConfiguration) -> JobStatus:
        if identifier in self._group_failure:
            return self._group_failure[identifier]
        record = self.read_record(identifier) or {}
        if record.get("warm") and (code := warm.exit_status(self.job_dir(identifier))) is not None:
            return JobStatus("exited", exit_code=code)  # the call is over; its runner waits for the next one
        states = self._host_states(identifier)
        if len(states) <= 1:
            alive, code = states[0] if states else (False, None)
            if alive:
                return JobStatus("running", detail=f"Local job process {record.get('pid')}")
            return JobStatus("exited", exit_code=code)
        hosts = len(states)
        failed = [(i, code) for i, (alive, code) in enumerate(states) if not alive and code not in (None, 0)]
        if failed:
            index, code = failed[0]
            detail = (
                f"host {index} of {hosts} exited with status {code}; the group fails with it "
                "(the other hosts were stopped)"
            )
            await self._stop_group(identifier, self.PEER_STOP_GRACE_SECONDS)
            status = self._group_failure[identifier] = JobStatus(
                "exited", exit_code=code, detail=detail, failed_host=index
            )
            return status
        if not any(alive for alive, _ in states):
            return JobStatus("exited", exit_code=states[0][1], detail=f"all {hosts} hosts exited")
        if not states[0][0]:  # the coordinator has ended: the others normally follow at once
            since = self._coordinator_exited_at.setdefault(identifier, time.monotonic())
            if time.monotonic() - since > self.GROUP_EXIT_GRACE_SECONDS:
                left = [i for i, (alive, _) in enumerate(states) if alive]
                await self._stop_group(identifier, self.PEER_STOP_GRACE_SECONDS)
                return JobStatus(
                    "exited",
                    exit_code=states[0][1],
                    detail=f"host 0 exited; host(s) {', '.join(map(str, left))} still ran "
                    f"{self.GROUP_EXIT_GRACE_SECONDS:.0f} s later and were stopped",
                )
        pids = ", ".join(str(h["pid"]) for h in self.hosts_of(record)) if record else "?"
        return JobStatus("running", detail=f"Local group of {hosts} job processes ({pids})")

    async def forward_logs(
        self,
        identifier: str,
        configuration: KineticLocalJobConfiguration,
        emit: Callable[[str], None],
        final: bool = False,
    ) -> None:
        cursors = self._cursors.get(identifier)
        if cursors is None:  # reattached: go on from what the previous worker forwarded
            record = self.read_record(identifier) or {}
            hosts = self.hosts_of(record) if record else [{"log_offset": 0}]
            cursors = self._cursors[identifier] = [
                _LogCursor(
                    self.job_dir(identifier) / self.log_name(i),
                    int(host.get("log_offset", 0)),
                    configuration.log_lines_per_second,
                )
                for i, host in enumerate(hosts)
            ]
        for index, cursor in enumerate(cursors):
            await anyio.to_thread.run_sync(cursor.read, _tagged(emit, index), final)

    async def forwarded(self, identifier: str) -> None:
        """What was read so far is stored in Prefect: a worker that reattaches later starts after it."""
        cursors = self._cursors.get(identifier)
        if cursors:
            await anyio.to_thread.run_sync(self._save_offsets, identifier, [c.offset for c in cursors])

    def _save_offsets(self, identifier: str, offsets: list[int]) -> None:
        record = self.read_record(identifier)
        if record is not None:
            record["log_offset"] = offsets[0]
            if record.get("hosts"):
                for host, offset in zip(record["hosts"], offsets):
                    host["log_offset"] = offset
            path = self.job_dir(identifier) / "job.json"
            partial = path.with_name(f"job.json.{os.getpid()}")
            partial.write_text(json.dumps(record))
            os.replace(partial, path)  # a worker killed while it writes must leave a readable record

    async def _stop_group(self, identifier: str, grace_seconds: float) -> None:
        """SIGTERM every host's process group (the runner unwinds: checkpoints and outputs are saved), SIGKILL
        what is left after ``grace_seconds``, and return once every host is gone."""
        record = self.read_record(identifier)
        if record is None:
            return
        if record.get("warm") and not self.warm_runners.retire_for(record["pid"], self.job_dir(identifier)):
            return  # the call is over: its runner is not this job's any more
        pids = [host["pid"] for host in self.hosts_of(record)]
        alive = lambda: any(a for a, _ in self._host_states(identifier))  # noqa: E731
        if alive():
            for pid in pids:
                _kill_group(pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_seconds
            while alive() and time.monotonic() < deadline:
                await anyio.sleep(0.1)
            if alive():
                for pid in pids:
                    _kill_group(pid, signal.SIGKILL)
                while alive():
                    await anyio.sleep(0.05)
        for pid in pids:
            _kill_group(pid, signal.SIGKILL)  # children that outlived the runner

    async def cancel(self, identifier: str, configuration: KineticLocalJobConfiguration, grace_seconds: float) -> None:
        await self._stop_group(identifier, grace_seconds)

    # The worker stops its jobs only through cancel(): a SIGTERM from anyone else (the machine shutting down, an
    # orchestrator draining it) takes the job away like a preemption, and is retried from preemption_retries.
    outside_sigterm_is_preemption = True

    can_relaunch = True

    async def relaunch(
        self,
        flow_run: FlowRun,
        configuration: KineticLocalJobConfiguration,
        identifier: str,
        spec: accelerators.AcceleratorSpec,
        attempt: int,
        log: Callable[[str], None],
    ) -> str:
        """The same job again (same identifier and log files): the log is forwarded on from where it was."""
        offsets = [cursor.offset for cursor in self._cursors.get(identifier, [])]
        await self._stop_group(identifier, 0)
        self._children.pop(identifier, None)
        self._group_failure.pop(identifier, None)
        self._coordinator_exited_at.pop(identifier, None)
        configuration.accelerator = spec.name
        new = await self.submit(flow_run, configuration, log)
        for cursor, offset in zip(self._cursors.get(new, []), offsets):
            cursor.offset = offset
        return new

    async def cleanup(self, identifier: str, configuration: KineticLocalJobConfiguration) -> None:
        cursors = self._cursors.pop(identifier, None) or []
        self._children.pop(identifier, None)
        self._coordinator_exited_at.pop(identifier, None)
        self._group_failure.pop(identifier, None)
        self._ended_at.pop(identifier, None)
        self._last_spans.pop(identifier, None)
        job_dir = self.job_dir(identifier)
        if any(c.dropped for c in cursors) and configuration.env.get(Env.STORE):
            from kinetic_prefect.contract import RunLayout
            from kinetic_prefect.storage import open_store

            layout = RunLayout(str(configuration.env[Env.RUN_ID]))
            for index, cursor in enumerate(cursors):
                if not cursor.dropped:
                    continue
                with contextlib.suppress(Exception):
                    await anyio.to_thread.run_sync(
                        open_store(str(configuration.env[Env.STORE])).put_file,
                        f"{layout.host_outputs(index)}/{JOB_LOG_NAME}",
                        cursor.path,
                    )
        shutil.rmtree(job_dir, ignore_errors=True)

    async def host_spans(self, identifier: str, configuration: KineticLocalJobConfiguration) -> list[Any]:
        """Each host process's start (recorded at launch) and end (when first seen gone), for metering."""
        from kinetic_prefect.shared.cost import HostSpan
        from kinetic_prefect.workers.metering import job_spec

        record = self.read_record(identifier)
        if record is None:
            return self._last_spans.get(identifier, [])
        states = self._host_states(identifier)
        ended = self._ended_at.setdefault(identifier, {})
        spot, now = job_spec(configuration).spot, time.time()
        spans = []
        job_dir = self.job_dir(identifier)
        for index, host in enumerate(self.hosts_of(record)):
            if index not in ended and (runner_end := _runner_end(job_dir, index)) is not None:
                ended[index] = runner_end  # the runner's own record: a warm call ends while its process lives on
            elif index >= len(states) or not states[index][0]:
                ended.setdefault(index, now)
            start = host.get("started_at") or _ticks_to_epoch(host.get("start_ticks")) or now
            spans.append(HostSpan(float(start), ended.get(index), spot))
        self._last_spans[identifier] = spans
        return spans

    async def unfinished_jobs(self, work_pool: Any) -> list[tuple[str, str]]:
        found: list[tuple[str, str]] = []
        if not self.jobs_dir.is_dir():
            return found
        for job_dir in self.jobs_dir.iterdir():
            record = self.read_record(job_dir.name)
            if record and record.get("owner") == "worker" and record.get("pool") in (None, work_pool.name):
                found.append((record["flow_run_id"], job_dir.name))
        return found


def _tagged(emit: Callable[[str], None], index: int) -> Callable[[str], None]:
    """Host i's lines carry ``[host i] ``; host 0's (and a single job's) go on untagged, as on kinetic-gke."""
    if index == 0:
        return emit
    from kinetic_prefect.pod.progress import parse

    prefix = f"[host {index}] "

    def readable(line: str) -> str:
        # the coordinator's progress is the group's (its artifact); another host's progress is shown as text
        record = parse(line)
        if record is None:
            return prefix + line
        return prefix + f"progress {record['percent']:.0f}%" + (f": {record['message']}" if record["message"] else "")

    return lambda text: emit("\n".join(readable(line) for line in text.split("\n")))
