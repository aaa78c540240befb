"""Caller side of sweeps in slots: the calls of one fan-out share a few slot jobs instead of a job each.

When calls of one kinetic task run concurrently from one flow run (``.map()``, many ``.submit()``s) on a
kinetic-local pool with warm runners (``keep_warm_seconds > 0``), each call stays the user's Prefect task run, but
its input goes into the sweep's queue in the store (``contract.SweepKeys``) instead of into a job run of its own. The
sweep launches at most N *slot jobs* (job flow runs created as a call's job run is, so the worker, the in-process
lifecycle, the UI and cancels all apply), N = ``KINETIC_SWEEP_SLOTS`` (default twice the CPUs, at least 4) and no
more than the calls waiting at once (which a tag concurrency limit bounds). Each slot takes inputs one after another
(``pod.slot_runner``); the call waits for its input's ``done`` record (one listing per sweep every POLL_SECONDS
answers every waiting call), forwards the input's log to its task run and reads the outcome and result as a single
call does. A call with no concurrent sibling keeps the one-job path.

What ends an input other than its own outcome, decided here and in ``sweep_calls.wait_in_sweep``:
* its slot's run ends (cancelled: the input ends Cancelled, not retried; killed or failed: Crashed, retried per
  ``retries=``); its queued siblings go to the other slots, or to a new slot;
* the call stops waiting (its timeout, an interrupt, ``fail_fast``): the input is withdrawn if no slot took it,
  else its slot is asked to stop it (``stop/<run id>``); a Ctrl-C or SIGTERM of the script cancels every slot.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio import to_thread

from kinetic_prefect import signing
from kinetic_prefect.caller.pools import abilities_of
from kinetic_prefect.contract import (
    COMPLETED,
    SLOT_INPUTS_ARTIFACT_KEY,
    SLOT_TAG,
    SWEEP_TAG_PREFIX,
    USAGE_PREFIX,
    Env,
    RunLayout,
    SweepKeys,
    WarmRunnerFiles,
    settings,
)
from kinetic_prefect.shared import exit_hooks, prefect_runs
from kinetic_prefect.shared import sweeps as sweep_stops

logger = logging.getLogger("kinetic_prefect.slots")

POLL_SECONDS = 0.1  # how often a sweep lists its done records (one listing answers all its waiting calls)
LOG_POLL_SECONDS = 0.5  # how often it lists its inputs' log chunks (one listing streams every running input's)
CLOSE_GRACE_SECONDS = 0.5  # a sweep with no waiting call closes after this (a retry or the next call rejoins it)
EXIT_WAIT_SECONDS = 10.0  # at the script's exit, how long its in-process slots get to end their runs
PARENT_CHECK_SECONDS = 1.0  # how often a sweep reads its calling flow run's state (for a cancel)

# --------------------------------------------------------------------------- which calls join a sweep

_lock = threading.Lock()
_in_flight: dict[tuple[Any, ...], int] = {}
_sweeps: dict[tuple[Any, ...], Sweep] = {}
_open: set[Sweep] = set()  # not yet finished (closing ones included): atexit closes them, fail_fast reaches them


@contextlib.contextmanager
def calling(key: tuple[Any, ...]) -> Iterator[None]:
    """Count a call of ``key`` (its flow run and task) while it is in flight: a second one makes them a sweep."""
    with _lock:
        _in_flight[key] = _in_flight.get(key, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _in_flight[key] -= 1
            if not _in_flight[key]:
                del _in_flight[key]


def has_siblings(key: tuple[Any, ...]) -> bool:
    with _lock:
        return _in_flight.get(key, 0) > 1


def slot_count(pool: Any = None) -> int:
    """At most this many slot jobs per sweep; 0: no sweeps, every call a job run of its own. ``KINETIC_SWEEP_SLOTS``
    if set; else, where the pool's launcher has a default slot count (kinetic-gke: a slot is a pod holding an
    accelerator, and the caller's CPUs say nothing about it), the work pool's concurrency limit or that default;
    else twice the caller's CPUs, at least 4."""
    count = settings.SWEEP_SLOTS.value()
    if count is not None:
        return count
    default = abilities_of(pool.type).default_slots if pool is not None else None
    if default is not None:
        return int(pool.concurrency_limit or default)
    return max(4, 2 * (os.cpu_count() or 1))


def split_variables(job_variables: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """(the variables every input of a sweep shares, this input's per-call ones)."""
    env = job_variables.get("env", {})
    shared = {**job_variables, "env": {k: v for k, v in env.items() if not WarmRunnerFiles.is_per_call(k)}}
    return shared, {k: str(v) for k, v in env.items() if WarmRunnerFiles.is_per_call(k)}


def sweep_for(key: tuple[Any, ...], make: Any) -> Sweep:
    """The open sweep of ``key``, or a new one from ``make()``."""
    global _exit_hook
    if not _exit_hook:  # outside the lock: starting Prefect's senders waits for its loop thread
        _exit_hook = True
        _register_exit_hook()
    with _lock:
        sweep = _sweeps.get(key)
        if sweep is None or sweep.closed:
            sweep = _sweeps[key] = make()
            _open.add(sweep)
        return sweep


_exit_hook = False


def _register_exit_hook() -> None:
    """``_close_at_exit`` runs when the main thread ends, *before* the interpreter shuts down the thread pools of
    concurrent.futures and Prefect's event and log senders (threading's exit hooks run last-registered first;
    ``atexit``'s run after all of them): a sweep closed later could start no thread ("cannot schedule new futures
    after interpreter shutdown"), and its slots' events, cost and tables of inputs were lost with a traceback each
    ("can't register atexit after shutdown"). The senders are started first, so their hooks come after this one
    and send what the slots' ends emit."""
    with contextlib.suppress(Exception):  # without them the slots' ends still reach the API, their events do not
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        EventsWorker.instance()
        APILogWorker.instance()
    try:
        exit_hooks.run_before_pools_shut_down(_close_at_exit)
    except RuntimeError:  # the interpreter is already ending
        atexit.register(_close_at_exit)


# --------------------------------------------------------------------------- one sweep


@dataclass
class _Slot:
    run_id: str  # its RunLayout id: what its claims name
    name: str
    final: asyncio.Future
    flow_run: Any = None
    task: asyncio.Task | None = None  # its whole end: run final, inputs' rows published


@dataclass(eq=False)
class Sweep:
    key: tuple[Any, ...]
    client: Any
    store: Any
    pool: Any
    polling: bool
    variables: dict[str, Any]  # the job variables every input shares (per-call env taken out)
    task_name: str
    idle_seconds: float
    signing_key: signing.KeyLike = None  # the queued records are signed with it, as payloads are
    close_grace: float = CLOSE_GRACE_SECONDS  # how long it stays open with no waiting call (a batch's: its slots')
    keys: SweepKeys = field(default_factory=lambda: SweepKeys(uuid.uuid4().hex[:16]))
    waiting: dict[str, tuple[str | None, asyncio.Future]] = field(default_factory=dict)  # run id: (task run, done)
    inputs: dict[str, tuple[int, str, str | None]] = field(default_factory=dict)  # run id: (n-th queued, name, tr)
    loggers: dict[str, Any] = field(default_factory=dict)  # run id: its task run's logger, while it waits
    log_chunks: dict[str, int] = field(default_factory=dict)  # run id: its next log chunk to forward
    log_locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    logs_forwarded: set[str] = field(default_factory=set)  # run ids whose every line went to their task run
    served: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # slot id: a row per input it served
    recorded: set[str] = field(default_factory=set)  # the run ids whose done record is in a slot's rows
    slots: dict[str, _Slot] = field(default_factory=dict)  # launched, not ended
    every_slot: dict[str, _Slot] = field(default_factory=dict)
    closed: bool = False
    stopped: bool = False
    seq: int = 0
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _watching: bool = False
    _close_timer: Any = None

    def __post_init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.cap = slot_count(self.pool)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run_input(self, run_id: str, per_call_env: dict[str, str], task_run: Any, name: str) -> tuple:
        """Queue one input and wait until it is decided: ("done", its done record), ("slot-ended", the slot's
        name and final state) or ("cancelled", why)."""
        done: asyncio.Future = self.loop.create_future()
        task_run_id = str(task_run.id) if task_run is not None else None
        self.waiting[run_id] = (task_run_id, done)
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None
        self.seq += 1
        self.inputs[run_id] = (self.seq, name, task_run_id)
        self.loggers[run_id] = _task_run_logger()
        item: dict[str, Any] = {"run_id": run_id, "env": per_call_env, "task_run_id": task_run_id, "name": name}
        queued = self.keys.queued(self.seq, run_id)
        ring = signing.as_keyring(self.signing_key)
        if ring is not None:  # the input's own keys, readable only by a slot of this sweep, for this record only
            scopes = signing.run_scopes(run_id, per_call_env.get(Env.CHECKPOINT_KEY))
            item["keys"] = ring.grant(scopes, under=signing.scope_of(queued), nonce=queued)
        try:
            blob = json.dumps(item).encode()
            await to_thread.run_sync(signing.put, self.store, queued, blob, self.signing_key)
            self._ensure_slots()
            if not self._watching:
                self._watching = True
                self._spawn(self._watch())
            return await done
        except BaseException:
            await self.stop_input(run_id)
            raise
        finally:
            self.waiting.pop(run_id, None)
            self.loggers.pop(run_id, None)
            if not self.waiting and not self.closed:
                self._close_timer = self.loop.call_later(self.close_grace, lambda: self._spawn(self.close()))

    async def stop_input(self, run_id: str) -> None:
        """The call stopped waiting: withdraw its input, or ask its slot to stop it; an interrupted script stops
        the whole sweep. Shielded: it runs while the call is being cancelled."""
        with anyio.CancelScope(shield=True):
            try:
                withdrawn = await to_thread.run_sync(self._withdraw, run_id)  # no slot took it, and none will
                if sweep_stops.caller_was_stopped() or self.stopped:  # every slot's run is cancelled instead
                    await self.stop("the calling script was interrupted (Ctrl-C or SIGTERM)")
                elif not withdrawn:
                    await to_thread.run_sync(self.store.put_bytes, self.keys.stop(run_id), b"")
            except Exception as exc:  # best effort while the call is already failing
                logger.debug("stopping input %s: %r", run_id, exc)

    def _withdraw(self, run_id: str) -> bool:
        return bool(self.store.put_bytes(self.keys.claim(run_id), SweepKeys.WITHDRAWN, if_absent=True))

    def cancel_inputs(self, task_run_ids: set[str], reason: str) -> None:
        """``fail_fast``/``stop_futures``: the inputs of these task runs end Cancelled (on the sweep's loop)."""
        for task_run_id, done in list(self.waiting.values()):
            if task_run_id in task_run_ids and not done.done():
                done.set_result(("cancelled", reason))

    async def slot_final(self, slot_id: str) -> Any:
        slot = self.every_slot.get(slot_id)
        return await slot.final if slot is not None else None

    async def forward_log(self, run_id: str, run_logger: Any) -> None:
        """The input's output not yet forwarded while it ran, as its task run's log lines (called once the input
        is done: its last chunk is in the store before its done record)."""
        chunks = await to_thread.run_sync(self.store.list, self.keys.log_prefix(run_id))
        await self._forward_chunks(run_id, chunks, run_logger, last=True)

    async def _forward_chunks(self, run_id: str, chunk_keys: list[str], run_logger: Any, last: bool = False) -> None:
        """Forward the chunks of ``chunk_keys`` from the input's next one on, in order, each once; ``last``: no
        chunk of the input comes after these (its done record was read)."""
        lock = self.log_locks.setdefault(run_id, asyncio.Lock())
        async with lock:
            if run_id in self.logs_forwarded:  # the watcher's listing came in after the last forward
                return
            following = self.log_chunks.get(run_id, 0)
            for chunk_key in sorted(chunk_keys):
                if SweepKeys.log_chunk_of(chunk_key)[1] != following:  # forwarded already, or one still to come
                    continue
                text = (await to_thread.run_sync(self.store.get_bytes, chunk_key)).decode(errors="replace")
                for line in text.splitlines():
                    if run_logger is not None and not line.startswith(USAGE_PREFIX):  # the sampler's, not the body's
                        run_logger.info(line)
                following += 1
                self.log_chunks[run_id] = following
            if last:
                self.logs_forwarded.add(run_id)
                self.log_chunks.pop(run_id, None)
                self.log_locks.pop(run_id, None)

    async def _stream_logs(self) -> None:
        """One listing of the sweep's log chunks: each running input's new lines go to its task run now."""
        by_input: dict[str, list[str]] = {}
        for chunk_key in await to_thread.run_sync(self.store.list, self.keys.logs):
            by_input.setdefault(SweepKeys.log_chunk_of(chunk_key)[0], []).append(chunk_key)
        for run_id, chunk_keys in by_input.items():
            run_logger = self.loggers.get(run_id)
            if run_logger is not None and run_id in self.waiting:
                await self._forward_chunks(run_id, chunk_keys, run_logger)

    # ----------------------------------------------------------------- slots

    def _ensure_slots(self) -> None:
        if self.closed:
            return
        while len(self.slots) < min(self.cap, len(self.waiting)):
            slot = _Slot(
                uuid.uuid4().hex, f"{self.task_name}-slot{len(self.every_slot) + 1}", self.loop.create_future()
            )
            self.slots[slot.run_id] = self.every_slot[slot.run_id] = slot
            slot.task = self._spawn(self._run_slot(slot))

    def _slot_variables(self, slot: _Slot) -> dict[str, Any]:
        env = {
            **self.variables["env"],
            Env.SWEEP_ID: self.keys.sweep_id,
            Env.RUN_ID: slot.run_id,
            Env.SLOT_IDLE_SECONDS: str(self.idle_seconds),
            Env.PAYLOAD_SHA256: self.keys.sweep_id,  # a kinetic job's mark (the slot's inputs carry their own)
        }
        variables = {**self.variables, "env": env}
        if "preemption_retries" in self.pool.base_job_template["variables"]["properties"]:
            variables["preemption_retries"] = 0  # a slot taken away is not relaunched: its input is retried instead
        return variables

    async def _run_slot(self, slot: _Slot) -> None:
        from kinetic_prefect.caller.in_process import run_in_process

        state = None
        try:
            slot.flow_run = await prefect_runs.create_job_flow_run(
                self.client,
                flow_name=self.task_name,
                run_name=slot.name,
                pool=self.pool,
                job_variables=self._slot_variables(slot),
                caller=None,
                tags=["kinetic", SLOT_TAG, SWEEP_TAG_PREFIX + self.keys.sweep_id],
                for_polling_worker=self.polling,
                signing_key=self.signing_key,
                in_flow_run=self.key[0],  # its cost is the calling flow run's, as a single call's job's is
            )
            if self.stopped:
                await prefect_runs.cancel_unstarted_run(self.client, slot.flow_run.id, "its sweep was stopped")
            elif self.polling:
                state = await prefect_runs.wait_for_final_state(self.client, slot.flow_run.id)
            else:
                await run_in_process(self.client, self.pool, slot.flow_run)
            if state is None:
                state = (await prefect_runs.read_flow_run_batched(self.client, slot.flow_run.id)).state
        except Exception as exc:
            logger.warning("slot %s of sweep %s: %r", slot.name, self.keys.sweep_id, exc)
            if slot.flow_run is None and len(self.slots) <= 1:  # no slot can run: the calls fail (and are retried)
                self._mark_closed()  # rather than a new slot launched after every failed one
                for _, done in self.waiting.values():
                    if not done.done():
                        done.set_result(("slot-ended", {"slot": slot.name, "state": None, "error": repr(exc)}))
        finally:
            self.slots.pop(slot.run_id, None)
            if not slot.final.done():
                slot.final.set_result(state)
            await self._slot_ended(slot, state)
            await self._publish_inputs(slot)

    def _claimed_by(self, slot_id: str) -> list[str]:
        """The waiting inputs ``slot_id`` took and did not finish."""
        from kinetic_prefect.storage import ObjectNotFound

        taken = []
        for run_id in list(self.waiting):
            try:
                if self.store.get_bytes(self.keys.claim(run_id)).decode() != slot_id:
                    continue
            except ObjectNotFound:
                continue
            if not self.store.exists(self.keys.done(run_id)):  # done: the watcher delivers it
                taken.append(run_id)
        return taken

    async def _slot_ended(self, slot: _Slot, state: Any) -> None:
        with anyio.CancelScope(shield=True):
            try:
                for run_id in await to_thread.run_sync(self._claimed_by, slot.run_id):
                    self._add_row(slot.run_id, run_id, "ended with its slot (no outcome)", None)
                    entry = self.waiting.get(run_id)
                    if entry is not None and not entry[1].done():
                        entry[1].set_result(("slot-ended", {"slot": slot.name, "state": state}))
                await to_thread.run_sync(self.store.delete_prefix, RunLayout(slot.run_id).prefix + "/")
            except Exception as exc:
                logger.debug("after slot %s: %r", slot.name, exc)
        self._ensure_slots()  # its unclaimed inputs go to the other slots, or to a new one

    async def _watch(self) -> None:
        """Deliver every done record to its waiting call: one listing of the sweep per POLL_SECONDS; stream the
        running inputs' new log lines to their task runs every LOG_POLL_SECONDS."""
        parent_read = logs_read = 0.0
        while self.waiting:  # checked and left in one step: a call queued later starts a new watch
            if self.loop.time() - parent_read > PARENT_CHECK_SECONDS:
                parent_read = self.loop.time()
                await self._stop_if_parent_cancelled()
            try:
                if self.loop.time() - logs_read > LOG_POLL_SECONDS:
                    logs_read = self.loop.time()
                    await self._stream_logs()
                await self._deliver_done()
            except Exception as exc:  # a store hiccup: list again
                logger.debug("listing sweep %s: %r", self.keys.sweep_id, exc)
            await asyncio.sleep(POLL_SECONDS)
        self._watching = False

    async def _deliver_done(self) -> None:
        """Each new done record: a row of its slot's table, and the answer of its waiting call."""
        for done_key in await to_thread.run_sync(self.store.list, self.keys.done_prefix):
            run_id = done_key.rsplit("/", 1)[-1]
            entry = self.waiting.get(run_id)
            if run_id in self.recorded and (entry is None or entry[1].done()):
                continue
            record = json.loads(await to_thread.run_sync(self.store.get_bytes, done_key))
            if run_id not in self.recorded:
                self.recorded.add(run_id)
                self._add_row(str(record.get("slot")), run_id, _outcome_text(record), record.get("seconds"))
            if entry is not None and not entry[1].done():
                entry[1].set_result(("done", record))

    def _add_row(self, slot_id: str, run_id: str, outcome: str, seconds: Any) -> None:
        n, name, task_run_id = self.inputs.get(run_id, (0, run_id, None))
        row = {"n": n, "name": name, "task_run_id": task_run_id, "outcome": outcome, "seconds": seconds}
        self.served.setdefault(slot_id, []).append(row)

    async def _publish_inputs(self, slot: _Slot) -> None:
        """The slot's job run gets the table of the inputs it served (its log lines name them too)."""
        if slot.flow_run is None:
            return
        from prefect.client.schemas.actions import ArtifactCreate

        with anyio.CancelScope(shield=True):
            try:
                await self._deliver_done()  # a done record written just before the slot's run ended
                rows = sorted(self.served.pop(slot.run_id, []), key=lambda row: row["n"])
                artifact = ArtifactCreate(
                    key=SLOT_INPUTS_ARTIFACT_KEY,
                    type="markdown",
                    data=inputs_table(slot.name, self.keys.sweep_id, rows),
                    description=f"the {len(rows)} input(s) slot job {slot.name} served",
                    flow_run_id=slot.flow_run.id,
                )
                await self.client.create_artifact(artifact=artifact)
            except Exception as exc:  # the rows are in the slot's log lines as well
                logger.debug("the table of slot %s: %r", slot.name, exc)

    async def _stop_if_parent_cancelled(self) -> None:
        """A cancel of the calling flow run: every slot stopped, every waiting input Cancelled (the calls raise
        FlowRunCancelled, as a single call does). One read per sweep, with the process's other reads."""
        try:
            parent = await prefect_runs.read_flow_run_batched(self.client, self.key[0])
        except Exception:  # the API is away: the outage rows of the slots' own lifecycles apply
            return
        state = parent.state
        if state is None or not (state.is_cancelling() or state.is_cancelled()):
            return
        reason = f"The parent flow run {parent.name} was cancelled"
        for _, done in list(self.waiting.values()):
            if not done.done():
                done.set_result(("cancelled", reason))
        await self.stop(reason)

    # ----------------------------------------------------------------- the end of a sweep

    def _mark_closed(self) -> None:
        self.closed = True
        with _lock:
            if _sweeps.get(self.key) is self:
                del _sweeps[self.key]

    async def stop(self, reason: str) -> None:
        """Every slot stopped (its run Cancelled), no new one launched."""
        if self.stopped:
            return
        self.stopped = True
        self._mark_closed()
        for slot in list(self.slots.values()):  # their workers stop them (no `closed`: a slot that left by
            if slot.flow_run is not None:  # itself would end Completed)
                await prefect_runs.cancel_flow_run(self.client, slot.flow_run.id, reason)

    async def close(self) -> None:
        """No call waits: idle slots leave (each run Completed), and once every slot's run has ended, the sweep's
        records are removed. Called again (at the script's exit), it waits for the slots again."""
        if self.waiting:
            return
        if not self.closed:
            self._mark_closed()
            await to_thread.run_sync(self.store.put_bytes, self.keys.closed, b"")
        for slot in list(self.every_slot.values()):
            await slot.final
            if slot.task is not None and slot.task is not asyncio.current_task():  # its table and cost published
                await asyncio.wait({slot.task})
        if self in _open:
            _open.discard(self)
            await to_thread.run_sync(self.store.delete_prefix, self.keys.prefix + "/")


def _task_run_logger() -> Any:
    """The calling task run's logger (None outside one): a waiting input's streamed lines go to it."""
    from prefect.context import TaskRunContext
    from prefect.logging import get_run_logger

    return get_run_logger() if TaskRunContext.get() else None


def _outcome_text(record: dict[str, Any]) -> str:
    """An input's outcome, as its slot's table shows it, from its done record."""
    if record.get("refused"):
        return "refused (its queued record failed its signature)"
    if record.get("stopped"):
        return "stopped"
    if record.get("status") == COMPLETED:
        return "Completed"
    if record.get("status"):
        return f"Failed ({record.get('error_type') or record['status']})"
    return f"no outcome (exit code {record.get('exit_code')})"


def inputs_table(slot_name: str, sweep_id: str, rows: list[dict[str, Any]]) -> str:
    """The markdown of a slot's artifact: one row per input it served, in the order they were queued."""
    lines = [
        f"### Inputs served by slot job {slot_name} (sweep {sweep_id})",
        "",
        "| queued # | input (task run) | task run id | outcome | seconds |",
        "|---:|---|---|---|---:|",
    ]
    for row in rows:
        seconds = "" if row["seconds"] is None else f"{row['seconds']:.3f}"
        lines.append(f"| {row['n']} | {row['name']} | {row['task_run_id']} | {row['outcome']} | {seconds} |")
    return "\n".join(lines) + "\n"


def stop_task_runs(task_run_ids: set[str], reason: str) -> None:
    """From any thread (``sweeps.stop_futures``): the inputs of these task runs end Cancelled."""
    for sweep in list(_open):
        sweep.loop.call_soon_threadsafe(sweep.cancel_inputs, task_run_ids, reason)


def _close_at_exit() -> None:
    """The script is ending: its sweeps close now, and its in-process slots are given a moment to end Completed
    (a slot whose caller is gone would otherwise cancel its own run)."""
    for sweep in list(_open):
        if sweep.loop.is_closed() or not sweep.loop.is_running():
            continue
        with contextlib.suppress(Exception):  # the process is ending: the slots' owner watch stops what is left
            asyncio.run_coroutine_threadsafe(sweep.close(), sweep.loop).result(timeout=EXIT_WAIT_SECONDS)


sweep_stops.STOP_HOOKS.append(stop_task_runs)

__all__ = ["Sweep", "calling", "has_siblings", "split_variables", "sweep_for", "stop_task_runs"]
