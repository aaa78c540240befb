"""Storage end to end against fake-gcs-server: a kinetic-local pool whose store is gs://, Data
arguments, outputs, checkpoints that survive a killed job, and results shared through the bucket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from job_runs import calling_task_run
from prefect import flow, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterTaskRunId, FlowFilter, FlowFilterName

from kinetic_prefect import Data, kinetic_task
from kinetic_prefect.storage import open_store
from kinetic_prefect.workers.base import load_template


@dataclass
class Inputs:
    images: object
    labels: object


def _jobs(flow_name: str):
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])))
    return sorted(runs, key=lambda r: r.created)


def _pool_with_store(store_url: str) -> str:
    name = f"gcs-{uuid.uuid4().hex[:6]}"
    template = load_template("kinetic-local")
    template["variables"]["properties"]["store"]["default"] = store_url
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="kinetic-local", base_job_template=template))
    return name


@pytest.fixture
def gcs_pool(gcs_bucket):
    store_url = f"{gcs_bucket}/kinetic"
    return _pool_with_store(store_url), open_store(store_url)


def _dataset(root: Path) -> Path:
    (root / "images" / "Forest").mkdir(parents=True)
    (root / "images" / "River").mkdir(parents=True)
    for i in range(5):
        (root / "images" / "Forest" / f"f{i}.bin").write_bytes(os.urandom(2000 + i))
        (root / "images" / "River" / f"r{i}.bin").write_bytes(os.urandom(1000 + i))
    (root / "labels.csv").write_text("name,label\nf0,Forest\n")
    return root


@pytest.mark.slow
def test_a_gcs_pool_runs_with_nested_data_outputs_and_artifacts(gcs_pool, tmp_path):
    pool, store = gcs_pool
    root = _dataset(tmp_path / "dataset")
    name = f"gcs-train-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool)
    def count_files(inputs: Inputs, extra: dict) -> dict:
        from pathlib import Path

        images = Path(inputs.images)
        out = Path(os.environ["KINETIC_OUTPUT_DIR"])
        (out / "report.txt").write_text("ok")
        (out / "plots").mkdir()
        (out / "plots" / "curve.png").write_bytes(b"\x89PNG")
        return {
            "images": sorted(p.relative_to(images).as_posix() for p in images.rglob("*") if p.is_file()),
            "labels": Path(inputs.labels).read_text(),
            "extra_is_dir": Path(extra["again"][0]).is_dir(),
            "store": os.environ["KINETIC_STORE"],
        }

    @flow
    def pipeline():
        inputs = Inputs(images=Data(root / "images"), labels=Data(root / "labels.csv"))
        return count_files(inputs, {"again": [Data(root / "images")]})

    result = pipeline()
    assert len(result["images"]) == 10 and "Forest/f0.bin" in result["images"]
    assert result["labels"].startswith("name,label") and result["extra_is_dir"]
    assert result["store"].startswith("gs://")

    [job] = _jobs(name)
    assert job.state.is_completed()
    markers = [k for k in store.list("data") if k.endswith("manifest.json")]
    assert len(markers) == 2, "each distinct Data content is stored once, under its hash"
    outputs = store.list("outputs")
    assert any(k.endswith("report.txt") for k in outputs) and any(k.endswith("plots/curve.png") for k in outputs)
    assert not [k for k in store.list("runs") if k.endswith("payload.pkl")], "payload removed after collection"
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(task_run_id=ArtifactFilterTaskRunId(any_=[calling_task_run(job).id]))
        )
    tables = [a for a in artifacts if a.type == "table"]
    assert tables and "report.txt" in json.dumps(tables[0].data)

    before = len(store.list("data"))
    assert pipeline()["labels"] == result["labels"]
    assert len(store.list("data")) == before, "same content: nothing uploaded again"


def test_outputs_are_uploaded_when_the_job_fails(gcs_pool):
    pool, store = gcs_pool

    @kinetic_task(name=f"fails-{uuid.uuid4().hex[:6]}", work_pool=pool)
    def fails_after_writing() -> None:
        (Path(os.environ["KINETIC_OUTPUT_DIR"]) / "partial.log").write_text("epoch 1 done\n")
        raise RuntimeError("out of patience")

    @flow
    def pipeline():
        return fails_after_writing()

    with pytest.raises(RuntimeError, match="out of patience"):
        pipeline()
    [key] = [k for k in store.list("outputs") if k.endswith("partial.log")]
    assert store.get_bytes(key) == b"epoch 1 done\n"


@pytest.mark.parametrize("backend", ["gcs", "local"])
@pytest.mark.slow
def test_a_killed_job_resumes_from_its_checkpoint(backend, gcs_bucket, tmp_path, monkeypatch):
    pool = _pool_with_store(f"{gcs_bucket}/ckpt" if backend == "gcs" else str(tmp_path / "store"))
    monkeypatch.setenv("KINETIC_CHECKPOINT_SYNC_SECONDS", "0.2")
    marker = tmp_path / "killed-once"

    @kinetic_task(
        name=f"resumes-{backend}-{uuid.uuid4().hex[:6]}",
        work_pool=pool,
        retries=1,
        env=["KINETIC_CHECKPOINT_SYNC_SECONDS"],
    )
    def count_to(n: int, marker_path: str) -> dict:
        import signal
        import time
        from pathlib import Path

        ckpt = Path(os.environ["KINETIC_CHECKPOINT_DIR"]) / "step.txt"
        start = int(ckpt.read_text()) if ckpt.exists() else 0
        for step in range(start, n):
            tmp = ckpt.with_suffix(".tmp")
            tmp.write_text(str(step + 1))
            tmp.replace(ckpt)
            if step + 1 == 3 and not Path(marker_path).exists():
                Path(marker_path).write_text("x")
                time.sleep(1.0)  # long enough for the periodic sync to save step 3
                os.kill(os.getpid(), signal.SIGKILL)
        return {"resumed_from": start, "final": int(ckpt.read_text())}

    @flow
    def pipeline():
        return count_to(5, str(marker))

    assert pipeline() == {"resumed_from": 3, "final": 5}


@pytest.mark.slow
def test_a_cache_hit_works_from_another_machine_sharing_the_bucket(gcs_bucket, tmp_path):
    store_url = f"{gcs_bucket}/shared"
    token = uuid.uuid4().hex
    script = tmp_path / "project" / "shared_cache.py"
    script.parent.mkdir()
    script.write_text(
        textwrap.dedent(f"""
        from prefect import flow
        from prefect.cache_policies import INPUTS
        from kinetic_prefect import kinetic_task

        @kinetic_task(name="expensive-{token[:8]}", cache_policy=INPUTS, persist_result=True)
        def expensive(token: str) -> str:
            return "computed for " + token

        @flow
        def pipeline():
            return expensive("{token}")

        if __name__ == "__main__":
            print("RESULT", pipeline())
    """)
    )

    def run_on_machine(machine: str) -> str:
        home = tmp_path / machine
        env = {
            **os.environ,
            "KINETIC_STORE": store_url,
            "KINETIC_CACHE_DIR": str(home / "cache"),
            "PREFECT_LOCAL_STORAGE_PATH": str(home / "prefect-storage"),
            "PREFECT_HOME": str(home / "prefect"),
        }
        proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout + proc.stderr

    first = run_on_machine("machine-a")
    assert f"RESULT computed for {token}" in first
    second = run_on_machine("machine-b")
    assert f"RESULT computed for {token}" in second
    assert "Cached" in second
    assert len(_jobs(f"expensive-{token[:8]}")) == 1, "machine B must not launch a job"
    assert open_store(store_url).list("results"), "the result record lives in the bucket"
