"""``kinetic-prefect up --platform vertex``: what a kinetic-vertex setup needs, as a plan (pure: no request).

No cluster: the Google APIs the worker and its jobs call, an Artifact Registry repository for the hash-tagged
images, a bucket for the store and Cloud Build's contexts, a service account the custom jobs run as (granted the
bucket and the repository's images), the signing key (a Prefect Secret block), and the kinetic-vertex work pool with
its settings. Names are derived, never random, so a second ``up`` finds what the first made.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kinetic_prefect.contract import VERTEX_WORKER_TYPE
from kinetic_prefect.signing import SECRET_BLOCK

APIS = (
    "aiplatform.googleapis.com",  # the custom jobs
    "artifactregistry.googleapis.com",  # the images
    "cloudbuild.googleapis.com",  # building them
    "storage.googleapis.com",  # the store
    "logging.googleapis.com",  # the jobs' output
    "iam.googleapis.com",  # the jobs' service account
)
JOB_SERVICE_ACCOUNT = "kinetic-vertex-jobs"
STORE_PREFIX = "kinetic-prefect"
_PROJECT_RE = re.compile(r"[a-z][a-z0-9-]{4,28}[a-z0-9]")
_REGION_RE = re.compile(r"[a-z]+-[a-z]+[0-9]+")


@dataclass(frozen=True)
class Planned:
    kind: str
    name: str
    detail: str = ""


@dataclass(frozen=True)
class VertexSettings:
    project: str
    region: str
    work_pool: str = VERTEX_WORKER_TYPE

    def __post_init__(self) -> None:
        if not _PROJECT_RE.fullmatch(self.project):
            raise ValueError(f"--project {self.project!r} is not a Google Cloud project id")
        if not _REGION_RE.fullmatch(self.region):
            raise ValueError(f"--region {self.region!r} is not a region (e.g. us-central1)")

    @property
    def repository_id(self) -> str:
        return "kn-vertex"

    @property
    def image_repository(self) -> str:
        return f"{self.region}-docker.pkg.dev/{self.project}/{self.repository_id}"

    @property
    def bucket(self) -> str:
        return f"{self.project}-kn-vertex-jobs"

    @property
    def service_account(self) -> str:
        return f"{JOB_SERVICE_ACCOUNT}@{self.project}.iam.gserviceaccount.com"

    def pool_settings(self) -> dict[str, Any]:
        """The work pool's defaults ``up`` sets (the variables of ``workers/vertex/variables.py``)."""
        return {
            "gcp_project": self.project,
            "region": self.region,
            "service_account_name": self.service_account,
            "image_builder": "cloud-build",
            "image_repository": self.image_repository,
            "build_staging_bucket": self.bucket,
            "store": f"gs://{self.bucket}/{STORE_PREFIX}",
        }


def plan_up(settings: VertexSettings) -> list[Planned]:
    """Every resource ``up --platform vertex`` makes, in order."""
    steps = [Planned("api", api, "enabled on the project") for api in APIS]
    steps += [
        Planned("artifact registry", settings.image_repository, "Docker repository for the job images"),
        Planned("bucket", f"gs://{settings.bucket}", "the store and Cloud Build's contexts"),
        Planned("service account", settings.service_account, "the custom jobs run as it"),
        Planned("iam", f"{settings.service_account} on gs://{settings.bucket}", "roles/storage.objectUser"),
        Planned("iam", f"{settings.service_account} on {settings.repository_id}", "roles/artifactregistry.reader"),
        Planned("signing key", SECRET_BLOCK, "a Prefect Secret block; the worker signs and checks with it"),
        Planned(
            "work pool",
            settings.work_pool,
            f"type {VERTEX_WORKER_TYPE}: " + ", ".join(f"{k}={v}" for k, v in settings.pool_settings().items()),
        ),
    ]
    return steps
