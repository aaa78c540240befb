"""Cost per job, task run and flow run; budgets; usage artifacts; `kinetic-prefect cost`.

On kinetic-local against the real Prefect server: a pool with a priced `cpu` entry (its `prices` variable),
real job processes. The GKE pricing cases (a spot l4, a two-host group) go through the launcher's own inputs:
pods built from the manifest kinetic-gke renders, with the times a kubelet reports.
"""

from __future__ import annotations

import json
import re
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from prefect import flow, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
from test_spine import job_runs

from kinetic_prefect import accelerators, kinetic_task
from kinetic_prefect.contract import FLOW_COST_ARTIFACT_KEY, JOB_COST_ARTIFACT_KEY, USAGE_ARTIFACT_KEY
from kinetic_prefect.errors import BudgetExceeded
from kinetic_prefect.shared import cost
from kinetic_prefect.workers.base import load_template

CPU_PER_HOUR = 36.0  # $0.01 per second: budgets and figures in whole cents
CPU_SPOT_PER_HOUR = 12.0


def priced_pool(**defaults) -> str:
    name = f"priced-{uuid.uuid4().hex[:6]}"
    template = load_template("kinetic-local")
    properties = template["variables"]["properties"]
    properties["prices"]["default"] = {
        "cpu": {"on_demand": CPU_PER_HOUR, "spot": CPU_SPOT_PER_HOUR, "source": "test price sheet"}
    }
    for key, value in defaults.items():
        properties[key]["default"] = value
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="kinetic-local", base_job_template=template))
    return name


def artifacts(flow_run_id, key: str | None = None) -> list:
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]),
                **({"key": ArtifactFilterKey(any_=[key])} if key else {}),
            )
        )
    return sorted(found, key=lambda a: a.created)


def table(artifact) -> list[dict]:
    return artifact.data if isinstance(artifact.data, list) else json.loads(artifact.data)


def events(name: str, resource_id: str, timeout: float = 15.0, until=bool) -> list[dict]:
    """Events from Prefect's event API. They arrive asynchronously and not in order: poll until ``until(found)``."""
    deadline = time.time() + timeout
    while True:
        with get_client(sync_client=True) as client:
            response = client.request(
                "POST",
                "/events/filter",
                json={
                    "filter": {
                        "event": {"name": [name]},
                        "resource": {"id": [resource_id]},
                        "occurred": {"since": (datetime.now(UTC) - timedelta(hours=1)).isoformat()},
                    },
                    "limit": 50,
                },
            )
        found = response.json().get("events", [])
        if until(found) or time.time() > deadline:
            return found
        time.sleep(0.5)


# --------------------------------------------------------------------------- kinetic-local, end to end


@pytest.mark.slow
def test_a_six_second_job_costs_its_duration_times_the_price_and_reports_its_usage():
    pool = priced_pool()
    name = f"six-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool, accelerator="cpu")
    def six_seconds() -> int:
        import time as _time

        end = _time.time() + 6
        spins = 0
        while _time.time() < end:  # busy half the time: the usage samples see CPU work
            spins += sum(range(20000))
            _time.sleep(0.01)
        return spins

    @flow
    def pipeline():
        return six_seconds()

    assert pipeline() > 0
    [run] = job_runs(name)
    [artifact] = artifacts(run.id, JOB_COST_ARTIFACT_KEY)
    [row] = table(artifact)
    seconds = row["minutes"] * 60
    assert 6.0 <= seconds <= 11.0, row
    # the row's minutes are rounded to 4 places: half of 0.0001 min at the price is the most the two can differ
    assert row["usd"] == pytest.approx(seconds / 3600 * CPU_PER_HOUR, abs=0.00005 * CPU_PER_HOUR / 60 + 1e-6)
    assert row["usd_per_hour"] == CPU_PER_HOUR and row["spot"] is False and row["hosts"] == 1
    assert row["price"] == "test price sheet"
    # the metered span agrees with what Prefect saw of the job: Running until its final state
    with get_client(sync_client=True) as client:
        states = client.read_flow_run_states(run.id)
    running = next(s.timestamp for s in states if s.is_running())
    final = next(s.timestamp for s in states if s.is_final())
    assert abs((final - running).total_seconds() - seconds) < 2.0
    assert events("kinetic.job.cost", f"prefect.flow-run.{run.id}")

    usage = artifacts(run.id, USAGE_ARTIFACT_KEY)
    assert usage, "the job's usage table is missing"
    figures = {r["figure"]: r for r in table(usage[-1])}
    cpu = figures["host CPU (% of cores)"]
    assert cpu["samples"] >= 3 and 0 < cpu["peak"] <= 100.5 and cpu["mean"] <= cpu["peak"]
    assert 0 < figures["host memory (GiB)"]["peak"] < 64
    plot = [a for a in artifacts(run.id) if a.type == "markdown" and "usage over time" in (a.data or "")]
    assert plot and "data:image/svg+xml;base64," in plot[0].data


def test_an_l4_call_on_a_machine_without_one_says_it_ran_on_the_cpu_and_is_billed_as_cpu(monkeypatch):
    """Issue 48, defect 10: kinetic-local runs an l4 call on the CPU (with a warning) when the machine has no GPU;
    the run used to say "ran on l4" and bill the l4's $0.8536/h. It says cpu (naming the l4 asked for) and bills
    the pool's cpu price."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    monkeypatch.setenv("KINETIC_LOCAL_DEVICES", "")  # this machine: a CPU only, whatever it really has
    pool = priced_pool()
    name = f"l4-on-cpu-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool, accelerator="l4", ship_project=False)
    def platform() -> str:
        import os

        return os.environ["JAX_PLATFORMS"]

    @flow
    def pipeline():
        return platform()

    assert pipeline() == "cpu"
    [run] = job_runs(name)
    [row] = table(artifacts(run.id, JOB_COST_ARTIFACT_KEY)[0])
    assert row["accelerator"] == "cpu", row
    assert row["usd_per_hour"] == CPU_PER_HOUR and row["price"] == "test price sheet", row
    assert row["usd"] == pytest.approx(row["minutes"] / 60 * CPU_PER_HOUR, abs=0.00005 * CPU_PER_HOUR / 60 + 1e-6)
    with get_client(sync_client=True) as client:
        caller_run = client.read_task_run(run.parent_task_run_id).flow_run_id  # the task run's log says what ran
        found = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[caller_run, run.id])))
    logs = [log.message for log in found]
    said = [line for line in logs if " ran on " in line]
    assert said and all("ran on cpu" in line and "l4 was asked for" in line for line in said), said
    assert not any("ran on l4" in line for line in logs), logs


@pytest.mark.slow
def test_a_budget_below_the_jobs_cost_stops_it_within_two_seconds_not_retried_outputs_kept(store_dir):
    pool = priced_pool()
    name = f"budget-{uuid.uuid4().hex[:6]}"
    budget = 0.05  # 5 seconds at $36/h

    @kinetic_task(name=name, work_pool=pool, accelerator="cpu", max_cost_usd=budget, retries=2, retry_delay_seconds=0)
    def sixty_seconds() -> str:
        import os as _os
        import pathlib
        import time as _time

        out = pathlib.Path(_os.environ["KINETIC_OUTPUT_DIR"])
        (out / "progress.txt").write_text("started")
        for step in range(600):
            _time.sleep(0.1)
            (out / "progress.txt").write_text(f"step {step}")
        return "finished"

    @flow
    def pipeline():
        return sixty_seconds()

    state = pipeline(return_state=True)
    assert state.is_failed()
    with pytest.raises(BudgetExceeded, match=r"budget of \$0.05 reached after \d+\.\d s"):
        state.result()
    runs = job_runs(name)
    assert len(runs) == 1, "a budget stop must not be retried"
    [run] = runs
    assert run.state.is_failed() and run.state.message.startswith("budget of $0.05 reached after ")
    [row] = table(artifacts(run.id, JOB_COST_ARTIFACT_KEY)[0])
    seconds = row["minutes"] * 60
    assert 5.0 <= seconds <= 7.0, f"stopped {seconds - 5.0:.2f} s after the budget was reached"
    assert budget <= row["usd"] <= budget + 2 * CPU_PER_HOUR / 3600
    kept = list((store_dir / "outputs").glob("*/progress.txt"))
    assert any(p.read_text().startswith("step") for p in kept), "the job's outputs were not kept"


@pytest.mark.slow
def test_a_flow_with_three_calls_shows_their_sum_and_the_cli_reads_it(capsys):
    from kinetic_prefect import cli

    pool = priced_pool()
    name = f"three-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool, accelerator="cpu")
    def nap(seconds: float) -> float:
        import time as _time

        _time.sleep(seconds)
        return seconds

    @flow
    def pipeline():
        return [nap(1.0), nap(2.0), nap(3.0)]

    state = pipeline(return_state=True)
    assert state.result() == [1.0, 2.0, 3.0]
    parent = state.state_details.flow_run_id
    jobs = job_runs(name)
    assert len(jobs) == 3
    job_usd = [table(artifacts(j.id, JOB_COST_ARTIFACT_KEY)[0])[0]["usd"] for j in jobs]
    [total_artifact] = artifacts(parent, FLOW_COST_ARTIFACT_KEY)
    rows = table(total_artifact)
    assert [r["call"] for r in rows[:3]] == [j.name for j in jobs] and rows[-1]["call"] == "total"
    assert rows[-1]["usd"] == pytest.approx(sum(job_usd), abs=1e-5)
    assert all(u > 0 for u in job_usd)
    expected = pytest.approx(sum(job_usd), abs=1e-5)
    flow_events = events(
        "kinetic.flow-run.cost",
        f"prefect.flow-run.{parent}",
        until=lambda found: any(e["payload"]["total_usd"] == expected for e in found),
    )
    assert max(e["payload"]["total_usd"] for e in flow_events) == pytest.approx(sum(job_usd), abs=1e-5)

    assert cli.main(["cost", "--flow-run", str(parent), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["runs"][0]["total_usd"] == pytest.approx(sum(job_usd), abs=1e-5)
    assert len(report["runs"][0]["calls"]) == 3
    assert cli.main(["cost", "--last", "1", "--flow", pipeline.name]) == 0
    assert f"${sum(job_usd):.4f}" in capsys.readouterr().out

    # a job run's id (what `jobs list` shows) reports that job's cost, not an empty table
    assert cli.main(["cost", "--flow-run", str(jobs[0].id), "--json"]) == 0
    [job_report] = json.loads(capsys.readouterr().out)["runs"]
    assert job_report["total_usd"] == pytest.approx(job_usd[0], abs=1e-5) and len(job_report["calls"]) == 1
    # what the report cannot show is an error naming the culprit, exit 1, no traceback
    unknown = str(uuid.uuid4())
    for argv, culprit in (
        (["--flow-run", unknown], f"--flow-run {unknown}: no such flow run"),
        (["--deployment", "nope/nope"], "--deployment 'nope/nope': no such deployment"),
        (["--last", "-1"], "--last -1"),
    ):
        assert cli.main(["cost", *argv]) == 1, argv
        captured = capsys.readouterr()
        assert culprit in captured.err and "Traceback" not in captured.err + captured.out, captured


@pytest.mark.slow
def test_a_flow_run_budget_tag_caps_its_calls():
    from prefect import tags

    pool = priced_pool()
    name = f"flowbudget-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool, accelerator="cpu", retries=1, retry_delay_seconds=0)
    def nap(seconds: float) -> float:
        import time as _time

        _time.sleep(seconds)
        return seconds

    @flow
    def pipeline():
        # the first call gets the flow's whole $0.02 as its budget (2 s) and is stopped there; the second finds
        # the flow's budget spent and starts no job
        states = [nap(10.0, return_state=True), nap(1.0, return_state=True)]
        errors = [state.result(raise_on_failure=False) for state in states]
        return [(state.is_failed(), type(error).__name__, str(error)) for state, error in zip(states, errors)]

    with tags("kinetic-max-cost-usd:0.02"):
        (first_failed, first_type, first), (second_failed, second_type, second) = pipeline()
    assert first_failed and first_type == "BudgetExceeded" and "budget of $0.02 reached after" in first, first
    assert second_failed and second_type == "BudgetExceeded", second
    assert "budget of $0.02 reached" in second and "no further call starts" in second, second
    assert len(job_runs(name)) == 1, "a budget stop is not retried, and the second call must not start a job"


def test_a_budget_needs_a_price_and_fails_before_upload():
    name = f"unpriced-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, accelerator="cpu", max_cost_usd=1.0)
    def anything() -> int:
        return 1

    @flow
    def pipeline():
        return anything()

    with pytest.raises(cost.PriceTableError, match="no on-demand price for accelerator 'cpu'.*pool-set"):
        pipeline()
    assert job_runs(name) == []
    with pytest.raises(cost.PriceTableError, match="positive number"):
        kinetic_task(max_cost_usd=0, name="zero-budget")(lambda: 1)


def test_every_entry_of_a_fallback_list_needs_a_price():
    """Only the first entry's price was checked: `["l4", "cpu"]` with a budget ran its whole body on the unpriced
    cpu, "unpriced", Completed. Every entry the call may land on must be priced, or it is refused before upload."""
    name = f"fallback-unpriced-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, accelerator=["l4", "cpu"], max_cost_usd=0.001)
    def anything() -> int:
        return 1

    @flow
    def pipeline():
        return anything()

    with pytest.raises(cost.PriceTableError, match="no on-demand price for accelerator 'cpu'.*fallback list"):
        pipeline()
    assert job_runs(name) == []


@pytest.mark.slow
def test_a_pool_given_the_price_an_error_asked_for_is_read_again_at_once():
    """The error names `kinetic-prefect pool-set POOL 'prices=…'` as the fix; a script that made it and called again
    got the same error from the caller's 30 s copy of the pool. The pool is read again before a refusal. ≈ 5 s: a
    refused call, a `pool-set` and a real call."""
    from kinetic_prefect.cli import main

    pool = priced_pool()
    with get_client(sync_client=True) as client:
        before = client.read_work_pool(pool).base_job_template
    before["variables"]["properties"]["prices"]["default"] = None
    from prefect.client.schemas.actions import WorkPoolUpdate

    with get_client(sync_client=True) as client:
        client.update_work_pool(pool, WorkPoolUpdate(base_job_template=before))

    @kinetic_task(name=f"repriced-{uuid.uuid4().hex[:6]}", work_pool=pool, accelerator="cpu", max_cost_usd=1.0)
    def anything() -> int:
        return 1

    @flow
    def pipeline():
        return anything()

    with pytest.raises(cost.PriceTableError, match="pool-set"):
        pipeline()
    assert main(["pool-set", pool, 'prices={"cpu": {"on_demand": 36}}']) == 0
    assert pipeline() == 1


# --------------------------------------------------------------------------- pricing, at the launcher boundary


def _pod_from_manifest(manifest: dict, index: int, started: datetime, finished: datetime | None):
    """The pod the Job controller makes from ``manifest``, as the API returns it once the kubelet reported."""
    from kubernetes import client

    template = manifest["spec"]["template"]
    api = client.ApiClient()
    spec = api._ApiClient__deserialize(template["spec"], "V1PodSpec")  # noqa: SLF001 (the client's own decoder)
    terminated = (
        client.V1ContainerStateTerminated(exit_code=0, started_at=started, finished_at=finished) if finished else None
    )
    state = client.V1ContainerState(
        terminated=terminated, running=None if finished else client.V1ContainerStateRunning(started_at=started)
    )
    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=f"job-{index}", annotations={"batch.kubernetes.io/job-completion-index": str(index)}
        ),
        spec=spec,
        status=client.V1PodStatus(
            phase="Succeeded" if finished else "Running",
            start_time=started,
            container_statuses=[
                client.V1ContainerStatus(
                    name="job", image="i", image_id="", ready=not finished, restart_count=0, state=state
                )
            ],
        ),
    )


def _gke_manifest(accelerator: str, **variables) -> dict:
    import asyncio

    from prefect.client.schemas.objects import FlowRun

    from kinetic_prefect.workers.gke.configuration import KineticGKEJobConfiguration

    template = load_template("kinetic-gke")
    configuration = asyncio.run(
        KineticGKEJobConfiguration.from_template_and_values(
            template, {"accelerator": accelerator, "image": "registry.example/job:1", **variables}
        )
    )
    configuration.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="priced"))
    return configuration.job_manifest


def test_a_spot_l4_pod_is_priced_at_the_spot_rate():
    from kinetic_prefect.shared.prices import PRICES
    from kinetic_prefect.workers.gke.follower import pod_span

    started = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    spot = pod_span(_pod_from_manifest(_gke_manifest("l4", spot=True), 0, started, started + timedelta(minutes=30)))
    on_demand = pod_span(_pod_from_manifest(_gke_manifest("l4"), 0, started, started + timedelta(minutes=30)))
    assert spot.spot and not on_demand.spot
    spec = accelerators.resolve("l4")
    spot_cost = cost.job_cost(spec, [spot], PRICES["l4"], now=0)
    assert spot_cost.spot and spot_cost.usd == pytest.approx(0.5 * 0.34057)
    assert cost.job_cost(spec, [on_demand], PRICES["l4"], now=0).usd == pytest.approx(0.5 * 0.85362)
    running = pod_span(_pod_from_manifest(_gke_manifest("l4", spot=True), 0, started, None))
    assert running.end is None
    assert cost.job_cost(spec, [running], PRICES["l4"], now=started.timestamp() + 600).usd == pytest.approx(
        600 / 3600 * 0.34057
    )


def test_a_two_host_group_is_priced_for_both_hosts():
    from kinetic_prefect.workers.gke.follower import pod_span

    manifest = _gke_manifest("l4", hosts=2)
    assert manifest["spec"]["completions"] == 2
    started = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    spans = [
        pod_span(_pod_from_manifest(manifest, i, started + timedelta(seconds=5 * i), started + timedelta(minutes=20)))
        for i in range(2)
    ]
    price = cost.load_prices({"l4": {"on_demand": 1.2, "spot": 0.4}})["l4"]
    job = cost.job_cost(accelerators.resolve("l4"), spans, price, now=0)
    assert job.hosts == 2 and job.usd_per_hour == pytest.approx(2.4)
    assert job.usd == pytest.approx((1200 + 1195) / 3600 * 1.2)
    assert job.minutes == pytest.approx(20.0)
    v6e = accelerators.resolve("tpu-v6e-16")  # per chip: each host is billed for its 4 chips
    tpu = cost.job_cost(v6e, spans, cost.price_for(v6e), now=0)
    assert tpu.usd == pytest.approx((1200 + 1195) / 3600 * 4 * 2.7)


class _AttemptsLauncher:
    """A launcher as the meter sees it: each attempt's hosts' spans, by the attempt's identifier."""

    def __init__(self):
        self.spans: dict[str, list[cost.HostSpan]] = {}

    async def host_spans(self, identifier, configuration):
        return self.spans.get(identifier, [])


@pytest.mark.no_server
def test_one_meter_sums_a_runs_attempts_lists_them_and_holds_its_budget_across_them():
    """A run that fell back (a100 never placed) and was preempted once on l4: each attempt is a row with its
    accelerator, hosts, minutes (image pull apart) and cost, the run's cost is their sum, and the budget counts
    the preempted attempt: the relaunch is stopped when the two together reach it."""
    import asyncio
    from types import SimpleNamespace

    from kinetic_prefect.workers.metering import JobMeter, cost_table

    prices = {"a100": {"on_demand": 3.6}, "l4": {"on_demand": CPU_PER_HOUR}}  # l4: $0.01 a second
    configuration = SimpleNamespace(accelerator="a100", prices=prices, max_cost_usd=1.0)
    launcher, now = _AttemptsLauncher(), time.time()
    meter = JobMeter(launcher, "job-a1", configuration)
    asyncio.run(meter.observe())  # pending: no pod started
    configuration.accelerator = "l4"  # what the launcher's relaunch does to the configuration
    meter.relaunched("job-a2", "no node pool has it")
    launcher.spans["job-a2"] = [cost.HostSpan(now - 100, now - 40, False, running=now - 90)]  # 10 s of image pull
    asyncio.run(meter.observe())
    meter.relaunched("job-a3", "preempted: node shut down")
    launcher.spans["job-a3"] = [cost.HostSpan(now - 30, None, False)]
    asyncio.run(meter.observe())
    assert meter.over_budget() is None  # $0.60 + $0.30 of $1
    launcher.spans["job-a3"] = [cost.HostSpan(now - 45, None, False)]
    asyncio.run(meter.observe())
    assert re.fullmatch(r"budget of \$1 reached after 1\.[78] min", meter.over_budget() or ""), meter.over_budget()

    job, rows = cost_table(meter, "train")
    assert job.usd == pytest.approx(0.60 + 0.45, abs=0.01) and job.accelerator == "l4"
    total, *attempts = rows
    assert total["call"] == "train" and total["attempts"] == 3 and total["usd"] == pytest.approx(job.usd)
    assert [(a["attempt"], a["accelerator"], a["hosts"], a["ended"]) for a in attempts] == [
        (1, "a100", 0, "no node pool has it"),
        (2, "l4", 1, "preempted: node shut down"),
        (3, "l4", 1, ""),
    ]
    assert attempts[0]["usd"] == 0.0 and attempts[1]["usd"] == pytest.approx(0.60)
    assert attempts[1]["minutes"] == 1.0 and attempts[1]["pending_minutes"] == pytest.approx(10 / 60, abs=1e-4)
    assert attempts[1]["run_minutes"] == pytest.approx(50 / 60, abs=1e-4)
    assert sum(a["usd"] for a in attempts) == pytest.approx(total["usd"], abs=1e-5)


@pytest.mark.no_server
def test_a_pods_image_pull_is_pending_time_apart_from_its_run_time():
    """GKE sets a pod's startTime when the kubelet takes it, before the image is pulled; the container's startedAt
    comes after: the span keeps both, so the cost table says how much of the billed time was pending."""
    from kinetic_prefect.workers.gke.follower import pod_span

    started = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    pod = _pod_from_manifest(_gke_manifest("l4"), 0, started, started + timedelta(minutes=30))
    pod.status.start_time = started - timedelta(seconds=90)  # accepted by the kubelet, then 90 s of image pull
    span = pod_span(pod)
    assert span.seconds(0) == 30 * 60 + 90 and span.pending_seconds(0) == 90
    running = pod_span(_pod_from_manifest(_gke_manifest("l4"), 0, started, None))
    assert running.pending_seconds(started.timestamp() + 60) == 0.0
    assert cost.HostSpan(0.0, 10.0).pending_seconds(10.0) is None  # a launcher that cannot tell


def test_price_tables_name_their_culprit():
    from kinetic_prefect.shared import prices

    assert all(p.source and p.date for p in prices.PRICES.values())
    for name in prices.PRICES:
        assert accelerators.resolve(name).name == name
    with pytest.raises(cost.PriceTableError, match="entry 'l5'.*Closest valid names"):
        cost.load_prices({"l5": {"on_demand": 1}})
    with pytest.raises(cost.PriceTableError, match="on_demand='cheap'"):
        cost.load_prices({"l4": {"on_demand": "cheap"}})
    with pytest.raises(cost.PriceTableError, match="cannot read price file"):
        cost.load_prices("/nonexistent/prices.json")
    assert cost.load_prices('{"v6e-8": {"on_demand": 2.0, "unit": "chip"}}')["tpu-v6e-8"].unit == "chip"


# --------------------------------------------------------------------------- usage, summarised


def test_usage_hints_name_what_would_do():
    from kinetic_prefect.workers.usage_report import hint, plot_svg, summarize

    gib = 2**30
    samples = [
        {
            "t": t,
            "cpu": 50.0,
            "rss": 2 * gib,
            "mem_total": 16 * gib,
            "devices": [{"id": 0, "platform": "gpu", "in_use": 7 * gib, "peak": int(7.2 * gib), "limit": 80 * gib}],
            "gpus": [{"index": 0, "util": 85.0, "mem_used": 8 * gib, "mem_total": 80 * gib}],
        }
        for t in range(5)
    ]
    summary = summarize(samples)
    assert summary["accelerator memory peak, JAX (GiB, busiest device)"]["peak"] == pytest.approx(7.2)
    assert hint(accelerators.resolve("a100-80gb"), summary) == "peak GPU memory 9 % of an a100-80gb: an l4 would do"
    idle = summarize([{**s, "gpus": [{"index": 0, "util": 5.0}], "devices": []} for s in samples])
    assert "busy 5 %" in hint(accelerators.resolve("l4"), idle)
    cpu_only = summarize([{"t": t, "cpu": 90.0, "rss": gib} for t in range(3)])
    assert "saw no accelerator" in hint(accelerators.resolve("l4"), cpu_only)
    assert hint(accelerators.resolve("cpu"), cpu_only) is None
    assert plot_svg(samples).startswith("<svg") and "polyline" in plot_svg(samples)


def test_the_sampler_never_imports_while_the_job_is_still_importing_jax(monkeypatch):
    """The sampler runs on its own thread. Importing `jax._src.xla_bridge` from there while the job's main thread
    was inside `import jax` made Python hand the main thread a half-made module, and a Gemma job failed with
    "module 'jax._src.xla_bridge' has no attribute 'is_known_platform'". It reads only finished imports."""
    import builtins
    import importlib.machinery
    import types

    from kinetic_prefect.pod import utilization

    half_made = types.ModuleType("jax")
    half_made.__spec__ = importlib.machinery.ModuleSpec("jax", None)
    half_made.__spec__._initializing = True  # what the import system sets until the module's code has run
    monkeypatch.setitem(sys.modules, "jax", half_made)
    imported: list[str] = []
    real_import = builtins.__import__

    def recording_import(name, *args, **kwargs):
        imported.append(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", recording_import)
    assert utilization.jax_device_memory() == []
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert not [name for name in imported if name.startswith("jax")], imported


def test_the_sampler_reads_this_machine_and_jax_on_cpu_reports_no_device_memory():
    import jax

    from kinetic_prefect.pod import utilization

    jax.numpy.ones(4).block_until_ready()  # a CPU backend exists now: memory_stats() is None or partial there
    assert utilization.jax_device_memory() == []
    lines: list[str] = []
    sampler = utilization.Sampler(0.05, nvml=utilization.Nvml.open(), write=lines.append).start()
    time.sleep(0.3)
    sampler.stop()
    samples = [utilization.parse(line.rstrip("\n")) for line in lines]
    assert len(samples) >= 3 and all(s is not None for s in samples)
    assert samples[-1]["rss"] > 0 and samples[-1]["mem_total"] > samples[-1]["rss"] and "cpu" in samples[-1]
    if utilization.Nvml.open() is None:
        assert "gpus" not in samples[-1]  # no NVML here: the figure is left out, not faked


@pytest.mark.no_server
def test_a_budget_reached_within_a_minute_says_so_in_seconds():
    """Issue 48, defect 11: a budget stop said "after 0.0 min"."""
    from kinetic_prefect.shared.cost import budget_message

    assert budget_message(0.01, 2.5 / 60) == "budget of $0.01 reached after 2.5 s"
    assert budget_message(2.5, 23.4) == "budget of $2.5 reached after 23.4 min"
