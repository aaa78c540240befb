"""``kinetic-prefect up / down --platform vertex``: what a kinetic-vertex setup needs, looked up, then made or deleted.

No cluster: the Google APIs the worker and its jobs call (Service Usage), an Artifact Registry repository for the
hash-tagged images, a bucket for the store and Cloud Build's contexts, a service account the custom jobs run as
(IAM), granted the bucket's objects and the repository's images, the signing key (a Prefect Secret block), and the
kinetic-vertex work pool with its settings. Names are derived, never random, so a second ``up`` finds what the
first made and makes nothing. Each resource is a :class:`~kinetic_prefect.workers.provisioning.Step`; the requests
go through Google's client libraries (google-api-python-client's Service Usage and IAM, google-cloud-artifact-
registry, google-cloud-storage), which tests give fake transports.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kinetic_prefect import config, signing
from kinetic_prefect.contract import VERTEX_WORKER_TYPE, Env
from kinetic_prefect.workers import provisioning
from kinetic_prefect.workers.provisioning import (
    ABSENT,
    CREATE,
    DELETE,
    EXISTS,
    KEEP,
    UPDATE,
    ClientsFor,
    Options,
    Plan,
    PrefectAccess,
    ProvisionError,
    Step,
)

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
BUCKET_ROLE = "roles/storage.objectUser"  # read, write and delete the store's objects
REPOSITORY_ROLE = "roles/artifactregistry.reader"  # pull the job images
CLOUD_PLATFORM = "https://www.googleapis.com/auth/cloud-platform"
LABELS = {"made-by": "kinetic-prefect"}
_PROJECT_RE = re.compile(r"[a-z][a-z0-9-]{4,28}[a-z0-9]")
_REGION_RE = re.compile(r"[a-z]+-[a-z]+[0-9]+")


@dataclass(frozen=True)
class VertexSettings:
    project: str
    region: str
    work_pool: str = VERTEX_WORKER_TYPE

    def __post_init__(self) -> None:
        if not _PROJECT_RE.fullmatch(self.project):
            raise ProvisionError(f"--project {self.project!r} is not a Google Cloud project id")
        if not _REGION_RE.fullmatch(self.region):
            raise ProvisionError(f"--region {self.region!r} is not a region (e.g. us-central1)")

    @property
    def repository_id(self) -> str:
        return "kn-vertex"

    @property
    def repository_path(self) -> str:
        return f"projects/{self.project}/locations/{self.region}/repositories/{self.repository_id}"

    @property
    def image_repository(self) -> str:
        return f"{self.region}-docker.pkg.dev/{self.project}/{self.repository_id}"

    @property
    def bucket(self) -> str:
        return f"{self.project}-kn-vertex-jobs"

    @property
    def service_account(self) -> str:
        return f"{JOB_SERVICE_ACCOUNT}@{self.project}.iam.gserviceaccount.com"

    @property
    def service_account_path(self) -> str:
        return f"projects/{self.project}/serviceAccounts/{self.service_account}"

    @property
    def member(self) -> str:
        return f"serviceAccount:{self.service_account}"

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


@dataclass
class VertexClients(PrefectAccess):
    """Service Usage and IAM (google-api-python-client resources), Artifact Registry and Cloud Storage clients,
    and Prefect's; tests give fakes at the transport."""

    services: Any
    iam: Any
    registry: Any
    storage: Any
    prefect: Callable[[], Any] | None = None
    sleep: Callable[[float], None] = time.sleep
    poll_seconds: float = 5.0
    say: Callable[[str], None] = print


def make_clients(project: str) -> VertexClients:
    """The real clients, on Application Default Credentials."""
    import google.auth

    # Credentials first: without them the refusal comes before the client libraries load (seconds of imports).
    credentials, _ = google.auth.default(scopes=[CLOUD_PLATFORM])
    from google.cloud import artifactregistry_v1, storage  # type: ignore[attr-defined]
    from googleapiclient import discovery  # type: ignore[import-untyped]

    def resource(api: str) -> Any:
        return discovery.build(api, "v1", credentials=credentials, cache_discovery=False, static_discovery=True)

    return VertexClients(
        services=resource("serviceusage"),
        iam=resource("iam"),
        registry=artifactregistry_v1.ArtifactRegistryClient(credentials=credentials),
        storage=storage.Client(project=project, credentials=credentials),
    )


def _not_found(exc: BaseException) -> bool:
    """A 404 from either kind of client (google-api-python-client's HttpError, google-api-core's NotFound)."""
    status = getattr(getattr(exc, "resp", None), "status", None) or getattr(exc, "code", None)
    return str(status) == "404"


# ------------------------------------------------------------------------------------------------ APIs


def api_step(clients: VertexClients, settings: VertexSettings, api: str) -> Step:
    name = f"projects/{settings.project}/services/{api}"
    found = clients.services.services().get(name=name).execute()
    if found.get("state") == "ENABLED":
        return Step("api", api, EXISTS, "enabled")

    def enable() -> None:
        operation = clients.services.services().enable(name=name, body={}).execute()
        while not operation.get("done"):
            clients.sleep(clients.poll_seconds)
            operation = clients.services.operations().get(name=operation["name"]).execute()
        if operation.get("error"):
            raise ProvisionError(f"enabling {api}: {operation['error'].get('message', operation['error'])}")

    return Step("api", api, UPDATE, "will be enabled on the project", enable)


# ------------------------------------------------------------------------------------------------ registry, bucket


def _repository(clients: VertexClients, settings: VertexSettings) -> Any | None:
    try:
        return clients.registry.get_repository(name=settings.repository_path)
    except Exception as exc:
        if _not_found(exc):
            return None
        raise


def repository_step(clients: VertexClients, settings: VertexSettings) -> Step:
    if _repository(clients, settings) is not None:
        return Step("artifact registry", settings.image_repository, EXISTS, "Docker repository")

    def create() -> None:
        from google.cloud import artifactregistry_v1

        repository = artifactregistry_v1.Repository(
            format_=artifactregistry_v1.Repository.Format.DOCKER,
            description="kinetic-prefect: kinetic-vertex job images",
            labels=dict(LABELS),
        )
        clients.registry.create_repository(
            parent=f"projects/{settings.project}/locations/{settings.region}",
            repository_id=settings.repository_id,
            repository=repository,
        ).result(timeout=600)

    return Step("artifact registry", settings.image_repository, CREATE, "Docker repository for the job images", create)


def bucket_step(clients: VertexClients, settings: VertexSettings) -> Step:
    name = f"gs://{settings.bucket}"
    if clients.storage.lookup_bucket(settings.bucket) is not None:
        return Step("bucket", name, EXISTS, f"store {settings.pool_settings()['store']}")

    def create() -> None:
        bucket = clients.storage.bucket(settings.bucket)
        bucket.iam_configuration.uniform_bucket_level_access_enabled = True
        bucket.labels = dict(LABELS)
        clients.storage.create_bucket(bucket, project=settings.project, location=settings.region)

    return Step("bucket", name, CREATE, f"{settings.region}, the store and Cloud Build's contexts", create)


# ------------------------------------------------------------------------------------------------ the jobs' account


def _service_account(clients: VertexClients, settings: VertexSettings) -> dict[str, Any] | None:
    try:
        return clients.iam.projects().serviceAccounts().get(name=settings.service_account_path).execute()
    except Exception as exc:
        if _not_found(exc):
            return None
        raise


def service_account_step(clients: VertexClients, settings: VertexSettings) -> Step:
    if _service_account(clients, settings) is not None:
        return Step("service account", settings.service_account, EXISTS, "the custom jobs run as it")

    def create() -> None:
        body = {
            "accountId": JOB_SERVICE_ACCOUNT,
            "serviceAccount": {
                "displayName": "kinetic-vertex jobs",
                "description": "kinetic-prefect: the custom jobs of kinetic-vertex pools run as it",
            },
        }
        clients.iam.projects().serviceAccounts().create(name=f"projects/{settings.project}", body=body).execute()

    return Step("service account", settings.service_account, CREATE, "the custom jobs run as it", create)


def bucket_grant_step(clients: VertexClients, settings: VertexSettings) -> Step:
    """``BUCKET_ROLE`` on the bucket for the jobs' account, on the bucket alone (not the project)."""
    name = f"{settings.service_account} on gs://{settings.bucket}"

    def granted() -> tuple[Any, Any, bool]:
        bucket = clients.storage.lookup_bucket(settings.bucket)
        if bucket is None:
            return None, None, False
        policy = bucket.get_iam_policy(requested_policy_version=3)
        members = {m for b in policy.bindings if b.get("role") == BUCKET_ROLE for m in b.get("members", ())}
        return bucket, policy, settings.member in members

    if granted()[2]:
        return Step("iam", name, EXISTS, BUCKET_ROLE)

    def grant() -> None:
        bucket, policy, done = granted()
        if bucket is None:
            raise ProvisionError(f"bucket gs://{settings.bucket} is missing: its step comes first")
        if not done:
            policy.bindings.append({"role": BUCKET_ROLE, "members": {settings.member}})
            bucket.set_iam_policy(policy)

    return Step("iam", name, CREATE, BUCKET_ROLE, grant)


def repository_grant_step(clients: VertexClients, settings: VertexSettings) -> Step:
    """``REPOSITORY_ROLE`` on the repository for the jobs' account: it pulls the job images, nothing else."""
    name = f"{settings.service_account} on {settings.repository_id}"

    def read() -> Any:
        return clients.registry.get_iam_policy(request={"resource": settings.repository_path})

    def holds(policy: Any) -> bool:
        return any(b.role == REPOSITORY_ROLE and settings.member in b.members for b in policy.bindings)

    if _repository(clients, settings) is not None and holds(read()):
        return Step("iam", name, EXISTS, REPOSITORY_ROLE)

    def grant() -> None:
        policy = read()
        if not holds(policy):
            policy.bindings.add(role=REPOSITORY_ROLE, members=[settings.member])
            clients.registry.set_iam_policy(request={"resource": settings.repository_path, "policy": policy})

    return Step("iam", name, CREATE, REPOSITORY_ROLE, grant)


# ------------------------------------------------------------------------------------------------ the work pool


def _pool_template(settings: VertexSettings, base: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """``base`` with ``up``'s settings as defaults where the operator set none: (template, set, kept as they were)."""
    template = json.loads(json.dumps(base))
    properties = template["variables"]["properties"]
    shipped = config.pool_template(VERTEX_WORKER_TYPE)["variables"]["properties"]
    changed, kept = [], []
    for key, value in settings.pool_settings().items():
        current = properties[key].get("default")
        if current in (None, "", shipped[key].get("default")) and current != value:
            properties[key]["default"] = value
            changed.append(key)
        elif current != value:
            kept.append(f"{key}={current!r}")
    return template, changed, kept


def work_pool_step(clients: VertexClients, settings: VertexSettings) -> Step:
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    with clients.prefect_client() as client:
        try:
            pool = client.read_work_pool(settings.work_pool)
        except ObjectNotFound:
            pool = None
    if pool is not None and pool.type != VERTEX_WORKER_TYPE:
        raise ProvisionError(
            f"--pool-name {settings.work_pool!r}: that work pool exists and is of type {pool.type}, not "
            f"{VERTEX_WORKER_TYPE}; give another --pool-name"
        )
    base = config.pool_template(VERTEX_WORKER_TYPE) if pool is None else pool.base_job_template
    template, changed, kept = _pool_template(settings, base)
    note = ", ".join(f"{k}={v}" for k, v in settings.pool_settings().items() if k in changed)
    if pool is None:

        def create() -> None:
            with clients.prefect_client() as client:
                description = f"kinetic-prefect up --platform vertex: {settings.project}, {settings.region}"
                client.create_work_pool(
                    WorkPoolCreate(
                        name=settings.work_pool,
                        type=VERTEX_WORKER_TYPE,
                        base_job_template=template,
                        description=description,
                    )
                )

        return Step("work pool", settings.work_pool, CREATE, f"type {VERTEX_WORKER_TYPE}: {note}", create)
    kept_note = f"keeps {', '.join(kept)}" if kept else ""
    if not changed:
        return Step("work pool", settings.work_pool, EXISTS, kept_note)

    def update() -> None:
        with clients.prefect_client() as client:
            client.update_work_pool(settings.work_pool, WorkPoolUpdate(base_job_template=template))

    return Step("work pool", settings.work_pool, UPDATE, "; ".join(filter(None, [f"sets {note}", kept_note])), update)


# ------------------------------------------------------------------------------------------------ down


def delete_work_pool_step(clients: VertexClients, settings: VertexSettings) -> Step:
    from prefect.exceptions import ObjectNotFound

    with clients.prefect_client() as client:
        try:
            pool = client.read_work_pool(settings.work_pool)
        except ObjectNotFound:
            return Step("work pool", settings.work_pool, ABSENT)
    if pool.type != VERTEX_WORKER_TYPE:
        return Step("work pool", settings.work_pool, KEEP, f"of type {pool.type}, not made by up --platform vertex")

    def delete() -> None:
        with clients.prefect_client() as client:
            client.delete_work_pool(settings.work_pool)

    return Step("work pool", settings.work_pool, DELETE, "", delete)


def delete_repository_step(clients: VertexClients, settings: VertexSettings) -> Step:
    if _repository(clients, settings) is None:
        return Step("artifact registry", settings.image_repository, ABSENT)

    def delete() -> None:
        clients.registry.delete_repository(name=settings.repository_path).result(timeout=600)

    return Step("artifact registry", settings.image_repository, DELETE, "and its images", delete)


def delete_bucket_step(clients: VertexClients, settings: VertexSettings, delete_data: bool) -> Step:
    name = f"gs://{settings.bucket}"
    bucket = clients.storage.lookup_bucket(settings.bucket)
    if bucket is None:
        return Step("bucket", name, ABSENT)
    if any(True for _ in bucket.list_blobs(max_results=1)) and not delete_data:
        return Step("bucket", name, KEEP, "holds objects: --delete-data deletes them with the bucket")

    def delete() -> None:
        for blob in bucket.list_blobs():  # Bucket.delete(force=True) gives up past 256 objects
            blob.delete()
        bucket.delete()

    return Step("bucket", name, DELETE, "and every object in it" if delete_data else "empty", delete)


def delete_service_account_step(clients: VertexClients, settings: VertexSettings) -> Step:
    if _service_account(clients, settings) is None:
        return Step("service account", settings.service_account, ABSENT)

    def delete() -> None:
        clients.iam.projects().serviceAccounts().delete(name=settings.service_account_path).execute()

    return Step("service account", settings.service_account, DELETE, "its grants go with it", delete)


# ------------------------------------------------------------------------------------------------ the platform


def settings_of(options: Options) -> VertexSettings:
    if not options.project:
        raise ProvisionError("--project is required (or GOOGLE_CLOUD_PROJECT)")
    region = options.region or (options.zone or "").rpartition("-")[0] or "us-central1"
    return VertexSettings(options.project, region, *([options.pool_name] if options.pool_name else []))


def plan_up(clients: VertexClients, settings: VertexSettings) -> list[Step]:
    """Every resource ``up --platform vertex`` makes, in order, each looked up first."""
    return [
        *(api_step(clients, settings, api) for api in APIS),
        repository_step(clients, settings),
        bucket_step(clients, settings),
        service_account_step(clients, settings),
        bucket_grant_step(clients, settings),
        repository_grant_step(clients, settings),
        provisioning.signing_key_step(clients),
        work_pool_step(clients, settings),
    ]


def plan_down(clients: VertexClients, settings: VertexSettings, delete_data: bool, delete_key: bool) -> list[Step]:
    """What ``down --platform vertex`` deletes; the APIs stay enabled (other things of the project may use them),
    a bucket holding objects stays unless ``delete_data``, the signing key unless ``delete_key``."""
    return [
        delete_work_pool_step(clients, settings),
        delete_repository_step(clients, settings),
        delete_bucket_step(clients, settings, delete_data),
        delete_service_account_step(clients, settings),
        provisioning.delete_signing_key_step(clients, delete_key),
        Step("api", ", ".join(APIS), KEEP, "left enabled: other things of the project may use them"),
    ]


class VertexPlatform:
    name = "vertex"

    def make_clients(self, project: str) -> Any:
        return make_clients(project)

    def plan_up(self, options: Options, clients: ClientsFor) -> Plan:
        settings = settings_of(options)
        return Plan(
            f"kinetic-prefect up --platform vertex: {settings.project}/{settings.region} (no cluster)",
            plan_up(clients(settings.project), settings),
            question="Create or update {n} resource(s)?",
            rerun="Run the same `kinetic-prefect up --platform vertex` again to resume: what exists is kept.",
            next_steps=[
                f"\nSubmit with work_pool={settings.work_pool!r} (or {Env.WORK_POOL}={settings.work_pool}): each "
                f"call is a Vertex AI custom job in {settings.region}, running as {settings.service_account}.",
                f"Calls are signed with the Prefect Secret block {signing.SECRET_BLOCK!r}; a polling worker: "
                f"`prefect worker start --pool {settings.work_pool} --type {VERTEX_WORKER_TYPE}`.",
            ],
        )

    def plan_down(self, options: Options, clients: ClientsFor) -> Plan:
        settings = settings_of(options)
        return Plan(
            f"kinetic-prefect down --platform vertex: {settings.project}/{settings.region}",
            plan_down(clients(settings.project), settings, options.delete_data, options.delete_signing_key),
            question="Delete {n} resource(s)? This cannot be undone",
            rerun="Run the same `kinetic-prefect down --platform vertex` again to finish: what is gone is skipped.",
        )
