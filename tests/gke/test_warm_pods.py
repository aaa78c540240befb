"""The warm-pod hand-over (kinetic-gke) on a real store, without a cluster: a claim and a departure cannot both win,
a call handed over reaches the pod, and each call's log lines are only its own. The end-to-end sweep on the
Kubernetes control plane is ``test_a_sweep_on_warm_pods_starts_a_pod_per_slot_not_per_input`` in
``tests/gke/test_gke_cluster.py``.
"""

from __future__ import annotations

import threading
import time

import pytest

from kinetic_prefect.contract import CALL_BEGIN_MARKER, CALL_END_MARKER, WarmPodKeys
from kinetic_prefect.pod import warm_runner
from kinetic_prefect.storage import open_store

pytest.importorskip("prefect_kubernetes")
from kinetic_prefect.workers.gke import warm  # noqa: E402

pytestmark = pytest.mark.no_server

CONTROL = WarmPodKeys.control("k" * 16, "kinetic-job-1")


def test_an_idle_pod_leaves_by_claiming_its_own_next_call(tmp_path):
    store = open_store(tmp_path)
    store.put_bytes(f"{CONTROL}/{WarmPodKeys.ready(1)}", b"")
    assert warm._waiting_for(store, CONTROL) == 1
    started = time.monotonic()
    assert warm_runner._next_pod_call(store, CONTROL, 1, keep_warm_seconds=0.3) is None
    assert time.monotonic() - started >= 0.3
    assert store.get_bytes(f"{CONTROL}/{WarmPodKeys.claim(1)}") == WarmPodKeys.LEAVING
    assert warm._waiting_for(store, CONTROL) is None, "a pod that left is never handed a call"
    assert not warm._claim(store, f"{CONTROL}/{WarmPodKeys.claim(1)}", b"run-x"), "the launcher's claim loses"


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_a_claimed_call_reaches_the_pod_even_after_its_keep_warm_time(tmp_path, signed):
    """Signed: the launcher's record is signed under the pod's scope and carries the call's own run keys, which
    the pod unwraps; the call never sees the pod's own key."""
    from kinetic_prefect import signing

    master = signing.Keyring([b"master"]) if signed else None
    pod_keys = master.for_job(signing.scope_of(CONTROL + "/x")) if master else None
    store = open_store(tmp_path)
    store.put_bytes(f"{CONTROL}/{WarmPodKeys.ready(1)}", b"")
    assert warm._claim(store, f"{CONTROL}/{WarmPodKeys.claim(1)}", b"run-a")

    def pod() -> None:
        handed = warm_runner._next_pod_call(store, CONTROL, 1, 0.1)
        got.append(warm_runner._take_pod_call(store, handed, pod_keys, {"PATH": "/bin"}) if handed else None)

    got: list = []
    thread = threading.Thread(target=pod)
    thread.start()
    time.sleep(0.6)  # past the keep-warm time: the pod's own claim fails, so it waits for the call
    assert thread.is_alive()
    warm.hand_over_record(store, CONTROL, 1, {"KINETIC_RUN_ID": "run-a", "PATH": "/evil"}, master)
    thread.join(5)
    [env] = got
    assert env.pop("KINETIC_RUN_ID") == "run-a" and "PATH" not in env  # per-call variables only
    if signed:
        assert master is not None
        call_keys = signing.parse_keys(env.pop(signing.KEY_ENV))
        assert call_keys is not None and set(call_keys.scoped) == {"runs/run-a", "outputs/run-a"}
        signing.check(master, "runs/run-a/result.pkl", b"v", signing.sign(call_keys, "runs/run-a/result.pkl", b"v"), "")
    assert env == {}
    assert not store.exists(f"{CONTROL}/{WarmPodKeys.call(1)}"), "the pod takes the call object"


def test_two_launchers_racing_for_one_waiting_pod_hand_it_one_call(tmp_path):
    store = open_store(tmp_path)
    store.put_bytes(f"{CONTROL}/{WarmPodKeys.ready(3)}", b"")
    wins: list[bool] = []
    barrier = threading.Barrier(8)

    def launcher(i: int) -> None:
        barrier.wait()
        wins.append(warm._claim(store, f"{CONTROL}/{WarmPodKeys.claim(3)}", f"run-{i}".encode()))

    threads = [threading.Thread(target=launcher, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(wins) == [False] * 7 + [True]


def test_a_calls_lines_are_those_between_its_markers():
    got: list[str] = []
    lines = warm.CallLines("run-b", got.append)
    log = [
        CALL_BEGIN_MARKER + "run-a",
        "a's line",
        CALL_END_MARKER + "run-a",
        CALL_BEGIN_MARKER + "run-b",
        "b's first line",
        "b's second line",
        CALL_END_MARKER + "run-b",
        CALL_BEGIN_MARKER + "run-c",
        "c's line",
    ]
    with pytest.raises(warm._CallOver):
        for line in log:
            lines(line)
    assert got == ["b's first line", "b's second line"]
    assert lines.over.is_set()
    lines("c's line")
    assert got == ["b's first line", "b's second line"], "nothing after the call's end"


class _DeletedPodFollower:
    """A follower whose pod is being deleted but still reads Running: a kubelet that never reported its end (a lost
    node), or a runner killed before it wrote its exit record."""

    def __init__(self, deleted_seconds_ago: float):
        import datetime as dt

        from kubernetes import client as k8s

        when = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=deleted_seconds_ago)
        self._pod = k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name="kinetic-job-1-abcde", deletion_timestamp=when),
            spec=k8s.V1PodSpec(containers=[], node_name="node-a"),
            status=k8s.V1PodStatus(phase="Running"),
        )
        self._log_failed = False

    def pod(self):
        return self._pod

    def stream_logs(self, pod_name: str, again: bool = False) -> None:
        pass

    def finish_logs(self, timeout: float = 10) -> None:
        pass


@pytest.mark.parametrize("deleted_seconds_ago", [1.0, warm.DELETED_POD_MARGIN_SECONDS + 5])
def test_a_pod_deleted_during_a_call_without_an_exit_record_ends_that_call(tmp_path, deleted_seconds_ago):
    """The call must not wait forever on a pod that reads Running with a deletionTimestamp: past its grace period
    and the margin, the call has exited (and the lifecycle fails it); within them it is still running."""
    import types

    import anyio

    from kinetic_prefect.contract import Env

    configuration = types.SimpleNamespace(env={Env.STORE: str(tmp_path), Env.RUN_ID: "run-d"})
    pods = warm.WarmPods(api=lambda _: None)
    pods._stores[str(tmp_path)] = open_store(tmp_path)
    identifier = "default:kinetic-job-1@run-d-flow-run"
    pods._followers[identifier] = _DeletedPodFollower(deleted_seconds_ago)  # type: ignore[assignment]
    pods._lines[identifier] = warm.CallLines("run-d", lambda _: None)

    async def pending(_job: str):
        raise AssertionError("a Running pod is not pending")

    status = anyio.run(pods.status, identifier, configuration, pending)
    if deleted_seconds_ago < warm.DELETED_POD_MARGIN_SECONDS:
        assert status.phase == "running", status
    else:
        assert status.phase == "exited" and status.exit_code, status
        assert "deleted during the call" in status.detail


def test_a_floor_pod_leaving_by_its_idle_limit_leaves_its_idle_time_for_one_launcher_to_bill(tmp_path, monkeypatch):
    """A floor pod that left by its `warm_floor_idle_seconds` billed its idle time to no one (it may not reach
    Prefect, and it deletes its hand-over objects as it leaves). It now leaves a record outside them; whoever reaches
    Prefect first (a launcher handing the pool a call, `warm list|down`) publishes it once and deletes it. A pod
    that is not a floor one leaves none."""
    import json

    from kinetic_prefect.contract import Env
    from kinetic_prefect.shared import warm_idle

    published = []
    monkeypatch.setattr(warm_idle, "pool_prices", lambda pool: (None, {}))
    monkeypatch.setattr(
        warm_idle, "publish_idle", lambda who, idle, work_pool, drain=False: published.append((who, idle))
    )
    store = open_store(tmp_path)
    floor = {"pool": "p", "accelerator": "cpu", "runner": "default/kinetic-job-1"}
    environ = {Env.WARM_CONTROL: CONTROL, Env.WARM_FLOOR: json.dumps(floor)}
    warm_runner._record_floor_leaving(store, {Env.WARM_CONTROL: CONTROL}, 100.0, 2)
    assert store.list(WarmPodKeys.LEFT) == [], "a pod that is not a floor one left a record"
    warm_runner._record_floor_leaving(store, environ, time.time() - 30, 2)  # idle for 30 s
    store.put_bytes(WarmPodKeys.billed("kinetic-job-1"), b"")  # another launcher is publishing it
    assert warm.bill_left_floor_pods(store) == 0 and not published
    store.delete(WarmPodKeys.billed("kinetic-job-1"))
    assert warm.bill_left_floor_pods(store) == 1
    assert warm.bill_left_floor_pods(store) == 0, "published twice"
    [(who, idle)] = published
    assert who == warm_idle.IdleRunner("default/kinetic-job-1", "p", "cpu", True, 2)
    assert idle.hosts == 1 and idle.minutes == pytest.approx(0.5, abs=0.02), idle
    assert store.list("warm/") == [], "the record and its claim were left behind"
