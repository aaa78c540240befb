"""Warm pods on kinetic-gke: a pod that finished a call takes the next call of the same environment.

A sweep then pays one pod start (scheduling, image pull, interpreter, JAX initialisation) per concurrent slot
instead of one per input. Every call is still its own job to the lifecycle: its own flow run, states, log lines,
outcome, outputs, cancel and timeout; only the pod is reused. The pod runs ``kinetic_prefect.pod.warm_runner``
(what each call gets fresh, and what is shared, is the same as for a kinetic-local warm runner).

Why pods of their own and not an Indexed Job: an Indexed Job with ``parallelism=8, completions=64`` still runs a
pod per completion index (a finished index's pod exits), so it would save API calls, not pod starts. Here a warm
pod is a one-pod Job whose runner asks the store for its next call, and the launcher starts one more only when no
pod of the call's environment is waiting; so a sweep's pods are as many as its calls ever ran at once.

The hand-over goes through the store (``contract.WarmPodKeys``; a pod and the worker share no folder), with the
store's create-if-absent as the claim. Identifiers of warm calls are ``namespace:job@flow_run_id``. The pods of
an environment carry the label ``kinetic.prefect.io/warm-key``; a call is handed only to a pod that is running
and not being deleted. Stopping a call deletes its pod's Job (the pod is not reused); the next call starts a new
pod. A warm pod's Job has no ``activeDeadlineSeconds`` (a pool's ``job_watch_timeout_seconds`` would end a pod
that serves many calls); each call keeps its task's own timeout.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from prefect.client.schemas.objects import FlowRun

from kinetic_prefect import accelerators, signing
from kinetic_prefect.contract import (
    CALL_BEGIN_MARKER,
    CALL_END_MARKER,
    RUNNER_MODULE,
    WARM_RUNNER_MODULE,
    Env,
    RunLayout,
    WarmPodKeys,
    WarmRunnerFiles,
)
from kinetic_prefect.shared import warm_idle
from kinetic_prefect.workers.base import open_job_store, slot_argv
from kinetic_prefect.workers.gke.configuration import KineticGKEJobConfiguration
from kinetic_prefect.workers.gke.follower import DELETED_POD_MARGIN_SECONDS, JobFollower, deleted_for, pod_exit
from kinetic_prefect.workers.gke.kube import FLOW_RUN_LABEL, POOL_LABEL, READ_TIMEOUT, JobGone, label_value
from kinetic_prefect.workers.lifecycle import JobStatus

WARM_KEY_LABEL = "kinetic.prefect.io/warm-key"
FLOOR_LABEL = "kinetic.prefect.io/warm-floor"  # one of the pool's min_warm pods (`kinetic-prefect warm` lists them)
ACCELERATOR_LABEL = "kinetic.prefect.io/accelerator"  # set on every Job by the configuration
FIRST_RUN_LABEL = "kinetic.prefect.io/first-flow-run-id"  # not FLOW_RUN_LABEL: the Job is not that run's alone
END_WAIT_SECONDS = 10.0  # how long an ended call waits for its last log lines (its end marker)
BILL_LEFT_SECONDS = 30.0  # how often a launcher publishes the idle time of the floor pods that left (per store)


def wanted(configuration: KineticGKEJobConfiguration) -> bool:
    """Whether a call goes to a warm pod: the pool keeps pods warm, one host, a single accelerator (a fallback
    list or a spot fallback moves a call between Jobs, which a shared pod cannot follow). A sweep's slot job is not
    one: its pod takes the sweep's inputs, and is never handed a call."""
    return (
        configuration.keep_warm_seconds > 0
        and not is_slot(configuration)
        and configuration.host_count == 1
        and len(configuration.accelerator_choices) <= 1
        and not configuration.spot_fallback
    )


def is_slot(configuration: KineticGKEJobConfiguration) -> bool:
    """A sweep's slot job (caller/slots.py): one pod that takes the sweep's inputs one after another."""
    return bool(configuration.env.get(Env.SWEEP_ID))


def prepare_slot_pod(configuration: KineticGKEJobConfiguration) -> None:
    """Turn the rendered Job into a slot's: the slot runner in the runner's place (as on kinetic-local), and no
    ``activeDeadlineSeconds`` (a pool's job_watch_timeout_seconds would end a pod that serves many inputs; each
    input keeps its task's own timeout)."""
    manifest = configuration.job_manifest
    container = _container(manifest)
    container["command"] = slot_argv(list(container["command"]))
    manifest["spec"].pop("activeDeadlineSeconds", None)


def _keep_seconds(configuration: KineticGKEJobConfiguration, floor: bool) -> str:
    """How long the pod waits idle for its next call: a floor pod its pool's warm_floor_idle_seconds (else for ever)."""
    if not floor:
        return str(configuration.keep_warm_seconds)
    limit = configuration.warm_floor_idle_seconds
    return "inf" if limit is None else str(limit)


def _floor_record(flow_run: FlowRun, configuration: KineticGKEJobConfiguration, job_name: str) -> str:
    """``Env.WARM_FLOOR``: the pool, accelerator and runner (``namespace/Job``) a floor pod's idle time is billed as."""
    spec = configuration.accelerator_spec
    accelerator = f"{spec.name}:spot" if spec.spot and not spec.name.endswith(":spot") else spec.name
    pool = configuration.labels.get(POOL_LABEL) or flow_run.work_pool_name
    return json.dumps({"pool": pool, "accelerator": accelerator, "runner": f"{configuration.namespace}/{job_name}"})


def bill_left_floor_pods(store: Any, drain: bool = False) -> int:
    """Publish the idle time of the floor pods that left by their idle limit (``WarmPodKeys.left`` in ``store``) as
    their pools' cost; returns how many. Each is published once: by whoever creates its ``billed`` object first."""
    published = 0
    for key in store.list(WarmPodKeys.LEFT):
        if not key.endswith(".json"):
            continue
        job_name = key[len(WarmPodKeys.LEFT) : -len(".json")]
        if not store.put_bytes(WarmPodKeys.billed(job_name), b"", if_absent=True):
            continue  # another worker or command is publishing it
        try:
            left = json.loads(store.get_bytes(key))
            work_pool, prices = warm_idle.pool_prices(left.get("pool"))
            idle = warm_idle.idle_cost(left["accelerator"], float(left["idle_since"]), float(left["left_at"]), prices)
            who = warm_idle.IdleRunner(left["runner"], left.get("pool"), left["accelerator"], True, int(left["calls"]))
            warm_idle.publish_idle(who, idle, work_pool, drain=drain)
            published += 1
        except (KeyError, TypeError, ValueError):  # a record this version cannot read: dropped, not retried for ever
            pass
        except Exception:  # the store failed: left for the next look
            store.delete(WarmPodKeys.billed(job_name))
            raise
        store.delete(key)
        store.delete(WarmPodKeys.billed(job_name))
    return published


def is_warm(identifier: str) -> bool:
    return "@" in identifier


def _parts(identifier: str) -> tuple[str, str, str]:
    job, _, flow_run_id = identifier.partition("@")
    namespace, _, name = job.partition(":")
    return namespace, name, flow_run_id


def _container(manifest: dict[str, Any]) -> dict[str, Any]:
    return manifest["spec"]["template"]["spec"]["containers"][0]


def call_env(manifest: dict[str, Any]) -> dict[str, str]:
    """The per-call variables of a rendered manifest: what a warm pod swaps between calls."""
    return {
        str(e["name"]): str(e["value"])
        for e in _container(manifest).get("env") or []
        if "value" in e and WarmRunnerFiles.is_per_call(str(e["name"]))
    }


def environment_key(configuration: KineticGKEJobConfiguration) -> str:
    """Everything a pod's process depends on, without the per-call variables: the pod spec (image, command,
    node selector, tolerations, resources, every other variable), the namespace, and the secret values."""
    pod = copy.deepcopy(configuration.job_manifest["spec"]["template"]["spec"])
    container = pod["containers"][0]
    container["env"] = sorted(
        (e for e in container.get("env") or [] if not WarmRunnerFiles.is_per_call(str(e.get("name")))),
        key=lambda e: str(e.get("name")),
    )
    # The signing keys differ per call (each run's own) and reach a pod's later calls through the signed hand-over.
    shared_secrets = sorted((k, v) for k, v in configuration.secret_env.items() if k != signing.KEY_ENV)
    secrets = hashlib.sha256(json.dumps(shared_secrets).encode()).hexdigest()
    text = json.dumps([configuration.namespace, pod, secrets], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _CallOver(Exception):
    """Raised from a warm call's log filter at its end marker: ends that call's log stream."""


class CallLines:
    """One call's lines of a warm pod's log: those between its begin and end markers, handed to ``emit``."""

    def __init__(self, run_id: str, emit: Callable[[str], None]):
        self.begin, self.end = CALL_BEGIN_MARKER + run_id, CALL_END_MARKER + run_id
        self.emit = emit
        self.inside = False
        self.over = threading.Event()

    def __call__(self, line: str) -> None:
        if self.over.is_set():
            return
        if not self.inside:
            self.inside = line == self.begin
            return
        if line == self.end:
            self.over.set()
            raise _CallOver
        self.emit(line)


class WarmPods:
    """The launcher side of warm pods: hand a call to a waiting pod or start one, follow each call on its pod."""

    def __init__(self, api: Callable[[KineticGKEJobConfiguration], Any]):
        self._api = api
        self._lines: dict[str, CallLines] = {}
        self._followers: dict[str, JobFollower] = {}
        self._emitters: dict[str, Callable[[str], None]] = {}
        self._handed_at: dict[str, float] = {}
        self.pods_started = 0  # warm pods this launcher started (the benchmarks count them)
        self._stores: dict[str, Any] = {}
        self._billed_at: dict[int, float] = {}  # id(store): when its left floor pods were last billed

    async def _store(self, configuration: KineticGKEJobConfiguration) -> Any:
        """The call's store, opened once per URL: status is read every poll, and opening a gs:// store with
        the pool's credentials block reads that block from Prefect."""
        url = str(configuration.env[Env.STORE])
        if url not in self._stores:
            self._stores[url] = await open_job_store(configuration)
        return self._stores[url]

    async def _bill_left_floor_pods(self, store: Any) -> None:
        """The idle time of the pool's floor pods that left by their idle limit, published (``bill_left_floor_pods``)
        at most every ``BILL_LEFT_SECONDS`` per store: a sweep's calls do not each list the store for it."""
        if time.monotonic() - self._billed_at.get(id(store), -BILL_LEFT_SECONDS) < BILL_LEFT_SECONDS:
            return
        self._billed_at[id(store)] = time.monotonic()
        with contextlib.suppress(Exception):  # a report: it never fails a call
            await anyio.to_thread.run_sync(bill_left_floor_pods, store)

    # ----------------------------------------------------------------- handing a call over
    async def hand_over(
        self, flow_run: FlowRun, configuration: KineticGKEJobConfiguration, log: Callable[[str], None]
    ) -> tuple[str | None, int]:
        """Give the call to a running pod of its environment that waits for one: its identifier (else None),
        and how many of the environment's pods are floor pods (``min_warm``)."""
        key = environment_key(configuration)
        store = await self._store(configuration)
        await self._bill_left_floor_pods(store)
        pods = await anyio.to_thread.run_sync(self._pods, configuration, key)
        floor = len({job for job, _, is_floor in pods if is_floor})
        env = call_env(configuration.job_manifest)
        for job_name in sorted({job for job, phase, _ in pods if phase == "Running"}):
            control = WarmPodKeys.control(key, job_name)
            n = await anyio.to_thread.run_sync(_waiting_for, store, control)
            if n is None:
                continue
            claimed = await anyio.to_thread.run_sync(
                _claim, store, f"{control}/{WarmPodKeys.claim(n)}", str(flow_run.id).encode()
            )
            if not claimed:
                continue
            identifier = f"{configuration.namespace}:{job_name}@{flow_run.id}"
            await anyio.to_thread.run_sync(self._record, store, flow_run, identifier)
            await anyio.to_thread.run_sync(hand_over_record, store, control, n, env, configuration.signing_keys)
            self._handed_at[identifier] = time.time()
            log(f"Handed the call to warm pod {configuration.namespace}/{job_name} (its call {n + 1})")
            return identifier, floor
        return None, floor

    def prepare_new_pod(self, flow_run: FlowRun, configuration: KineticGKEJobConfiguration, floor: bool) -> str:
        """Turn the rendered Job into a warm pod's Job (this call is its first); returns the call's identifier.
        ``floor``: one of the pool's ``min_warm`` pods, which waits for calls until its Job is deleted."""
        key = environment_key(configuration)
        manifest = configuration.job_manifest
        job_name = manifest["metadata"]["name"]
        container = _container(manifest)
        container["command"] = [WARM_RUNNER_MODULE if part == RUNNER_MODULE else part for part in container["command"]]
        container["env"] = [
            *(container.get("env") or []),
            {"name": Env.WARM_CONTROL, "value": WarmPodKeys.control(key, job_name)},
            {"name": Env.WARM_KEEP_SECONDS, "value": _keep_seconds(configuration, floor)},
        ]
        if floor:  # what the pod bills its idle time as, should it leave by its idle limit
            container["env"].append({"name": Env.WARM_FLOOR, "value": _floor_record(flow_run, configuration, job_name)})
        for labels in (
            manifest["metadata"].setdefault("labels", {}),
            manifest["spec"]["template"]["metadata"]["labels"],
        ):
            first = labels.pop(FLOW_RUN_LABEL, None)
            if first:
                labels[FIRST_RUN_LABEL] = first
            labels[WARM_KEY_LABEL] = key
            if floor:
                labels[FLOOR_LABEL] = "true"
        manifest["spec"].pop("activeDeadlineSeconds", None)
        if configuration.signing_keys is not None:  # the pod checks its later calls' hand-overs with this scope
            configuration.hand_over_signing_keys(configuration.signing_keys, WarmPodKeys.control(key, job_name))
        self.pods_started += 1
        identifier = f"{configuration.namespace}:{job_name}@{flow_run.id}"
        self._handed_at[identifier] = time.time()
        return identifier

    async def record_new_pod(self, flow_run: FlowRun, configuration: KineticGKEJobConfiguration, identifier: str):
        store = await self._store(configuration)
        await anyio.to_thread.run_sync(self._record, store, flow_run, identifier)

    @staticmethod
    def _record(store: Any, flow_run: FlowRun, identifier: str) -> None:
        store.put_bytes(WarmPodKeys.run(str(flow_run.id)), identifier.encode())

    def _pods(self, configuration: KineticGKEJobConfiguration, key: str) -> list[tuple[str, str, bool]]:
        """``(job name, phase, floor)`` of environment ``key``'s pods that are not being deleted."""
        from kubernetes import client

        pods = (
            client.CoreV1Api(self._api(configuration))
            .list_namespaced_pod(
                configuration.namespace, label_selector=f"{WARM_KEY_LABEL}={key}", _request_timeout=READ_TIMEOUT
            )
            .items
        )
        found = []
        for pod in pods:
            if pod.metadata is None or pod.metadata.deletion_timestamp is not None:
                continue
            labels = pod.metadata.labels or {}
            if labels.get(WARM_KEY_LABEL) != key or not labels.get("job-name"):
                continue
            phase = (pod.status.phase if pod.status is not None else None) or "Pending"
            if phase in ("Pending", "Running"):
                found.append((labels["job-name"], phase, labels.get(FLOOR_LABEL) == "true"))
        return found

    async def find(self, flow_run: FlowRun, configuration: KineticGKEJobConfiguration) -> str | None:
        from kinetic_prefect.storage import ObjectNotFound

        store = await self._store(configuration)
        try:
            return (await anyio.to_thread.run_sync(store.get_bytes, WarmPodKeys.run(str(flow_run.id)))).decode()
        except ObjectNotFound:
            return None

    # ----------------------------------------------------------------- following one call
    def _follower(self, identifier: str, configuration: KineticGKEJobConfiguration) -> JobFollower:
        if identifier not in self._followers:
            namespace, job_name, _ = _parts(identifier)
            lines = self._lines[identifier] = CallLines(
                str(configuration.env[Env.RUN_ID]), lambda line: self._emitters.get(identifier, lambda _: None)(line)
            )
            self._followers[identifier] = JobFollower(self._api(configuration), namespace, job_name, lines)
        return self._followers[identifier]

    async def _exit_record(self, configuration: KineticGKEJobConfiguration) -> dict[str, Any] | None:
        from kinetic_prefect.storage import ObjectNotFound

        store = await self._store(configuration)
        try:
            data = await anyio.to_thread.run_sync(
                store.get_bytes, RunLayout(str(configuration.env[Env.RUN_ID])).warm_exit
            )
        except ObjectNotFound:
            return None
        return json.loads(data)

    async def status(
        self,
        identifier: str,
        configuration: KineticGKEJobConfiguration,
        pending_status: Callable[[str], Any],
    ) -> JobStatus:
        """``pending_status``: the launcher's own status of the pod's Job, for a pod not running yet (scheduling,
        image pull: its diagnosis and timeouts are a cold Job's)."""
        namespace, job_name, _ = _parts(identifier)
        record = await self._exit_record(configuration)
        if record is not None:
            await self._finish_lines(identifier, configuration)
            return JobStatus("exited", exit_code=int(record["exit_code"]), detail=f"warm pod {namespace}/{job_name}")
        follower = self._follower(identifier, configuration)
        try:
            pod = await anyio.to_thread.run_sync(follower.pod)
        except JobGone:
            if (record := await self._exit_record(configuration)) is not None:
                return JobStatus("exited", exit_code=int(record["exit_code"]))
            return JobStatus("gone", detail=f"the warm pod's Job {job_name} was deleted")
        phase = pod.status.phase if pod is not None and pod.status else None
        if phase in (None, "Pending"):
            return await pending_status(f"{namespace}:{job_name}")
        deleted = deleted_for(pod)
        if phase == "Running" and (deleted is None or deleted < DELETED_POD_MARGIN_SECONDS):
            if not self._lines[identifier].over.is_set():
                follower.stream_logs(pod.metadata.name)
            return JobStatus("running", detail=f"warm pod {pod.metadata.name} on {pod.spec.node_name or '?'}")
        if (record := await self._exit_record(configuration)) is not None:  # written just before the pod ended
            return JobStatus("exited", exit_code=int(record["exit_code"]))
        follower.stream_logs(pod.metadata.name, again=True)
        await anyio.to_thread.run_sync(follower.finish_logs)
        if phase == "Running":  # deleted, and no kubelet reported its end: its runner is gone all the same
            return JobStatus(
                "exited",
                exit_code=137,
                detail=f"warm pod {pod.metadata.name} was deleted during the call (its runner wrote no exit record)",
            )
        code, reason = pod_exit(pod)
        return JobStatus(
            "exited", exit_code=code or 1, detail=f"warm pod {pod.metadata.name} {phase} during the call: {reason}"
        )

    async def _finish_lines(self, identifier: str, configuration: KineticGKEJobConfiguration) -> None:
        """Wait (bounded) for the call's end marker, so its last lines are forwarded before its state is set."""
        follower = self._follower(identifier, configuration)
        lines = self._lines[identifier]
        deadline = time.monotonic() + END_WAIT_SECONDS
        while not lines.over.is_set() and time.monotonic() < deadline:
            try:
                pod = await anyio.to_thread.run_sync(follower.pod)
            except JobGone:
                return
            if pod is None:
                return
            follower.stream_logs(pod.metadata.name, again=follower.log_failed)  # a broken stream
            await anyio.sleep(0.2)

    def forward_logs(self, identifier: str, emit: Callable[[str], None]) -> None:
        self._emitters[identifier] = emit

    async def cancel(self, identifier: str, configuration: KineticGKEJobConfiguration) -> None:
        """Stop the call: its pod is deleted with it unless the call is already over (then the pod may be serving
        the next one, and is left alone)."""
        if await self._exit_record(configuration) is not None:
            return
        await anyio.to_thread.run_sync(self._follower(identifier, configuration).delete)

    async def cleanup(self, identifier: str, configuration: KineticGKEJobConfiguration) -> None:
        from kinetic_prefect.storage import ObjectNotFound

        for table in (self._followers, self._lines, self._emitters, self._handed_at):
            table.pop(identifier, None)
        store = await self._store(configuration)
        with contextlib.suppress(ObjectNotFound):
            await anyio.to_thread.run_sync(store.delete, WarmPodKeys.run(_parts(identifier)[2]))

    async def host_spans(self, identifier: str, configuration: KineticGKEJobConfiguration) -> list[Any]:
        """The call's own time on its pod (metering): a warm pod is billed to the calls it runs, not between them."""
        from kinetic_prefect.shared.cost import HostSpan

        record = await self._exit_record(configuration)
        if record is not None:
            return [HostSpan(float(record["started"]), float(record["ended"]), configuration.spot)]
        started = self._handed_at.get(identifier)
        return [HostSpan(started, None, configuration.spot)] if started is not None else []

    async def unfinished_calls(self, configuration: KineticGKEJobConfiguration) -> list[tuple[str, str]]:
        """``(flow_run_id, identifier)`` of every warm call recorded in the pool's store (a restarted worker)."""
        store = await self._store(configuration)
        keys = await anyio.to_thread.run_sync(store.list, WarmPodKeys.RUNS)
        found = []
        for key in keys:
            identifier = (await anyio.to_thread.run_sync(store.get_bytes, key)).decode()
            found.append((key.rsplit("/", 1)[-1], identifier))
        return found


# ------------------------------------------------------------------------- floor pods, for `kinetic-prefect warm`


@dataclass
class FloorPod:
    """A ``min_warm`` pod as ``kinetic-prefect warm list`` sees it: its Job's labels and, from the store's hand-over
    objects, whether it waits idle (since when, after how many calls) or runs a call."""

    namespace: str
    job: str
    pool: str | None
    accelerator: str  # a catalog name, ``:spot`` when its Job asks for Spot nodes
    since: float
    control: str
    store: Any
    idle_since: float | None = None  # None: busy with a call
    calls: int = 0
    floor: bool = True

    @property
    def runner(self) -> str:
        return f"{self.namespace}/{self.job}"

    def idle_seconds(self, now: float) -> float:
        return 0.0 if self.idle_since is None else max(0.0, now - self.idle_since)


def floor_pods(api: Any, namespace: str, pool: str | None, open_store: Callable[[str], Any]) -> list[FloorPod]:
    """The live floor pods' Jobs in ``namespace`` (of ``pool`` if given), oldest first; ``open_store(url)`` opens
    the store their runners take calls from (the ``KINETIC_STORE`` of their Jobs)."""
    from kubernetes import client

    selector = f"{FLOOR_LABEL}=true" + (f",{POOL_LABEL}={label_value(pool)}" if pool else "")
    jobs: list[Any] = client.BatchV1Api(api).list_namespaced_job(namespace, label_selector=selector).items
    stores: dict[str, Any] = {}
    found = []
    for job in jobs:
        status = job.status
        if job.metadata.deletion_timestamp is not None or (status and (status.succeeded or status.failed)):
            continue
        pod_spec = job.spec.template.spec
        env = {e.name: e.value for e in pod_spec.containers[0].env or [] if e.value is not None}
        if not env.get(Env.WARM_CONTROL) or not env.get(Env.STORE):
            continue
        url = env[Env.STORE]
        if url not in stores:
            stores[url] = open_store(url)
        labels = job.metadata.labels or {}
        spot = (pod_spec.node_selector or {}).get(accelerators.SPOT_LABEL) == "true"
        accelerator = labels.get(ACCELERATOR_LABEL) or "cpu"
        info = FloorPod(
            job.metadata.namespace,
            job.metadata.name,
            labels.get(POOL_LABEL),
            f"{accelerator}:spot" if spot and not accelerator.endswith(":spot") else accelerator,
            job.metadata.creation_timestamp.timestamp(),
            env[Env.WARM_CONTROL],
            stores[url],
        )
        state = _waiting_state(info.store, info.control)
        if state is None:
            continue  # leaving by itself
        info.idle_since, info.calls = state
        found.append(info)
    return sorted(found, key=lambda p: p.since)


def pool_floor_pods(work_pool: Any) -> list[tuple[FloorPod, Callable[[], bool]]]:
    """``kinetic-prefect warm``: the floor pods of ``work_pool``, read through its cluster, each with what ends it;
    the pods that left by their idle limit are billed first (``bill_left_floor_pods``)."""
    from kinetic_prefect.storage import open_store
    from kinetic_prefect.workers.gke.kube import CLUSTER_VARIABLES, pool_kube_client

    def variable(name: str) -> Any:
        properties = work_pool.base_job_template.get("variables", {}).get("properties", {})
        return properties.get(name, {}).get("default")

    api = pool_kube_client(*(variable(k) for k in CLUSTER_VARIABLES))
    pods = floor_pods(api, variable("namespace") or "default", work_pool.name, open_store)
    with contextlib.suppress(Exception):  # a report: the listing goes on
        if url := variable("store"):
            bill_left_floor_pods(open_store(url), drain=True)
    return [(pod, functools.partial(end_floor_pod, api, pod)) for pod in pods]


def _waiting_state(store: Any, control: str) -> tuple[float | None, int] | None:
    """(idle since, calls served) of a pod from its hand-over objects: idle since None while it runs a call; None
    when it is leaving (its own claim of its next call)."""
    names = {key.rsplit("/", 1)[-1] for key in store.list(f"{control}/")}
    ready = [int(name.split("-", 1)[1]) for name in names if name.startswith("ready-") and name[6:].isdigit()]
    if not ready:
        return None, 0  # its first call
    n = max(ready)
    if WarmPodKeys.claim(n) in names:
        try:
            leaving = store.get_bytes(f"{control}/{WarmPodKeys.claim(n)}") == WarmPodKeys.LEAVING
        except Exception:  # noqa: BLE001 - gone meanwhile: it left
            return None
        return None if leaving else (None, n)
    try:
        idle_since = float(json.loads(store.get_bytes(f"{control}/{WarmPodKeys.ready(n)}") or b"{}")["idle_since"])
    except Exception:  # noqa: BLE001 - written by a runner that did not say when: from now on
        idle_since = time.time()
    return idle_since, n


def end_floor_pod(api: Any, pod: FloorPod) -> bool:
    """End an idle floor pod: its next call claimed for it first (so no launcher can hand it one meanwhile), then its
    Job deleted. False: it is running a call (or a launcher just took it), left alone."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    n = pod.calls
    if pod.idle_since is None or not _claim(pod.store, f"{pod.control}/{WarmPodKeys.claim(n)}", WarmPodKeys.LEAVING):
        return False
    try:
        client.BatchV1Api(api).delete_namespaced_job(pod.job, pod.namespace, propagation_policy="Background")
    except ApiException as exc:
        if exc.status != 404:
            raise
    pod.store.delete_prefix(f"{pod.control}/")
    return True


def hand_over_record(store: Any, control: str, n: int, env: dict[str, str], keys: signing.Keyring | None) -> None:
    """Call ``n`` for the pod at ``control``: its per-call variables, and (signed stores) its run's keys wrapped
    for this pod and this record only; the record is signed with the pod's scope, so no store writer and no
    other job can hand a pod a call."""
    object_key = f"{control}/{WarmPodKeys.call(n)}"
    record: dict[str, Any] = {"env": env}
    if keys is not None:
        scopes = signing.run_scopes(env[Env.RUN_ID], env.get(Env.CHECKPOINT_KEY))
        record["keys"] = keys.grant(scopes, under=signing.scope_of(object_key), nonce=object_key)
    signing.put(store, object_key, json.dumps(record).encode(), keys)


def _claim(store: Any, key: str, owner: bytes) -> bool:
    return bool(store.put_bytes(key, owner, if_absent=True))


def _waiting_for(store: Any, control: str) -> int | None:
    """The call a pod waits for (its last ``ready-<n>`` with no ``claim-<n>``), else None."""
    names = {key.rsplit("/", 1)[-1] for key in store.list(f"{control}/")}
    ready = [int(name.split("-", 1)[1]) for name in names if name.startswith("ready-") and name[6:].isdigit()]
    if not ready:
        return None
    n = max(ready)
    return None if WarmPodKeys.claim(n) in names else n
