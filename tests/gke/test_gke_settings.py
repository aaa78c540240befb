"""kinetic-gke settings are checked before anything is uploaded or built, naming the setting and its fix."""

from __future__ import annotations

import copy
import uuid

import pytest
from prefect import flow, get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.filters import FlowFilter, FlowFilterName

from kinetic_prefect import kinetic_task
from kinetic_prefect.workers.gke.worker import KineticGKEWorker


def _pool(**defaults) -> str:
    name = f"gke-settings-{uuid.uuid4().hex[:6]}"
    template = copy.deepcopy(KineticGKEWorker.get_default_base_job_template())
    for key, value in defaults.items():
        template["variables"]["properties"][key]["default"] = value
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=name, type="kinetic-gke", base_job_template=template))
    return name


@pytest.mark.parametrize(
    "defaults, message",
    [
        (
            {"image_builder": "cloud-build", "image_repository": "us-docker.pkg.dev/p/r", "store": "gs://b/k"},
            "gcp_project, gcp_region, build_staging_bucket are not set: `kinetic-prefect pool-set",
        ),
        ({"store": "gs://b/k"}, "has no image and image_builder='none'"),
    ],
)
def test_incomplete_image_settings_fail_before_anything_is_uploaded(store_dir, defaults, message):
    pool = _pool(**defaults)
    name = f"gke-check-{uuid.uuid4().hex[:6]}"

    @kinetic_task(name=name, work_pool=pool, accelerator="l4")
    def train() -> int:
        return 1

    @flow
    def pipeline():
        return train()

    payloads_before = set((store_dir / "runs").glob("*")) if (store_dir / "runs").exists() else set()
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("`", ".")):
        pipeline()
    with get_client(sync_client=True) as client:
        assert not client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=[name])))
    after = set((store_dir / "runs").glob("*")) if (store_dir / "runs").exists() else set()
    assert after == payloads_before, "nothing may be uploaded before the settings are checked"
