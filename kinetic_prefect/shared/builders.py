"""Caller side: the container image of an :class:`~kinetic_prefect.shared.image.ImageSpec`, built at most once.

One generated Dockerfile serves every backend, so an image is named by the same ``ImageSpec.tag`` that names
kinetic-local's uv environment:

* :func:`build_context` writes the Dockerfile, the pip requirements and a copy of the job runner's modules
  (kinetic-prefect is not on PyPI, so the image cannot ``pip install`` it). Same spec, same bytes.
* :class:`DockerBuilder` runs ``docker build`` + ``docker push`` against any registry (workstations, tests).
* :class:`CloudBuildBuilder` asks Artifact Registry whether the tag exists, and otherwise uploads the context
  to GCS, submits a Cloud Build, streams its log and waits.
* :class:`PrebuiltImage` is what ``image=`` means: the caller's own image, never built.

Every builder's :meth:`ensure` looks the tag up first and builds only when it is missing. Two callers that
race on a missing tag both build; they push the same content under the same tag, so the race is harmless.

The google-cloud-* imports happen inside the Cloud Build code only: the ``gcp`` extra is optional.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import hashlib
import io
import json
import re
import subprocess
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kinetic_prefect.contract import RUNNER_ARGV
from kinetic_prefect.errors import KineticError
from kinetic_prefect.shared.image import JOB_USER_ID, ImageSpec, check_requirements, runner_sources
from kinetic_prefect.shared.processes import run_streamed
from kinetic_prefect.version import __version__

if TYPE_CHECKING:  # pragma: no cover
    from google.cloud.devtools import cloudbuild_v1

__all__ = [
    "BuildStopped",
    "CloudBuildBuilder",
    "DockerBuilder",
    "ImageBuildError",
    "ImageBuilder",
    "PrebuiltImage",
    "build_context",
    "builder_from_settings",
    "context_archive",
    "dockerfile",
    "ensure_interruptibly",
    "image_name",
    "requirements_lines",
]

IMAGE_NAME = "kinetic"
# The job reads and writes gs:// stores through storage.GCSStore, whatever the user's requirements say.
STORAGE_REQUIREMENT = "google-cloud-storage>=2.18"
TPU_FIND_LINKS = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"
# Requirement names that mean "this job runs JAX" (Keras 3 is run on its JAX backend here).
_JAX_USERS = re.compile(r"^(jax|jaxlib|flax|optax|orbax.*|keras|keras-.*|tf-keras)$")
# The frameworks of a job's requirements: large (hundreds of MB to GBs with their CUDA wheels) and changed far less
# often than the rest. They are installed in a layer of their own below the rest, so a changed small requirement
# rebuilds, pushes and has nodes pull only the layer above (Docker's cache and registries share layers by digest).
_FRAMEWORKS = re.compile(
    r"^(jax|jaxlib|jax-cuda\d+-.*|libtpu.*|tensorflow.*|tf-.*|torch|torchvision|torchaudio|nvidia-.*|flax|optax)$"
)
VENV = "/opt/venv"
RUNNER_DIR = "/opt/kinetic"
JOB_HOME = "/home/kinetic"  # the job user's home: caches (~/.cache, the runner's node cache) are written there
WORKSPACE = "/workspace"
# An image reference as `docker build` takes it after FROM: [host[:port]/]path[:tag][@sha256:digest], nothing else
# (a space or a newline would add Dockerfile instructions of the caller's choosing).
_IMAGE_REFERENCE = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?"
)
_PYTHON_VERSION = re.compile(r"3\.[0-9]{1,2}")
LOG_TAIL_LINES = 50


class ImageBuildError(KineticError, RuntimeError):
    """An image could not be built or pushed; the message ends with the build's last log lines."""

    def __init__(self, message: str, *, build_id: str | None = None, log_tail: str = ""):
        super().__init__(message)
        self.build_id = build_id
        self.log_tail = log_tail


class BuildStopped(ImageBuildError):
    """The build was told to stop (its caller was cancelled: Ctrl-C, a task timeout) and no longer runs."""


async def ensure_interruptibly(ensure: Callable[[threading.Event], str]) -> str:
    """``ensure(stop)`` (a builder's blocking ``ensure``) in a worker thread. A cancel of the awaiting task (Ctrl-C,
    a task timeout, a cancelled run) returns at once instead of when the build ends, minutes later on Cloud Build:
    the thread is abandoned and ``stop`` set, so the builder cancels its build and leaves (``BuildStopped``)."""
    import anyio

    stop = threading.Event()
    try:
        return await anyio.to_thread.run_sync(ensure, stop, abandon_on_cancel=True)
    finally:
        stop.set()  # after a result too: nothing is left for it to stop


def _stop_requested(stop: threading.Event | None, what: str) -> None:
    if stop is not None and stop.is_set():
        raise BuildStopped(f"{what}: stopped, its caller was cancelled")


def image_name(repository: str, spec: ImageSpec) -> str:
    """``<repository>/kinetic:<spec.tag>``, e.g. ``us-docker.pkg.dev/proj/repo/kinetic:py311-gpu-3f9c...``."""
    return f"{repository.rstrip('/')}/{IMAGE_NAME}:{spec.tag}"


def _split_image(image: str) -> tuple[str, str, str]:
    """``host[:port]/path/name:tag`` → (host, "path/name", tag). Digests are not used for our own images."""
    rest, _, tag = image.rpartition(":")
    if not rest or "/" in tag:
        raise ValueError(f"image reference {image!r} has no tag")
    host, _, path = rest.partition("/")
    if not path or not ("." in host or ":" in host or host == "localhost"):
        raise ValueError(f"image reference {image!r} does not start with a registry host")
    return host, path, tag


# --------------------------------------------------------------------------------------------- the build context


def _uses_jax(spec: ImageSpec) -> bool:
    from packaging.requirements import Requirement

    return any(_JAX_USERS.match(Requirement(r).name) for r in spec.requirements)


def _cloudpickle_version() -> str:
    import cloudpickle

    return str(cloudpickle.__version__)


def requirements_lines(spec: ImageSpec) -> list[str]:
    """The image's requirements.txt: the user's requirements plus what the runner and the accelerator need."""
    requirements = check_requirements(spec.requirements)  # one requirement a line, never a pip option of the caller's
    lines: list[str] = []
    # The accelerator build of JAX only when the job uses JAX: a PyTorch or plain-Python job on a GPU node would
    # otherwise carry gigabytes of CUDA wheels it never loads. (jax[cuda12] bundles CUDA as pip wheels, so a
    # python-slim base works on GKE's GPU nodes; libtpu is served from Google's find-links page.)
    accelerator_jax = _uses_jax(spec) and spec.family in ("gpu", "tpu")
    if accelerator_jax and spec.family == "tpu":
        lines.append(f"--find-links {TPU_FIND_LINKS}")
    lines.extend(requirements)
    # The job unpickles what the caller pickled: same cloudpickle as the caller.
    lines.append(f"cloudpickle=={_cloudpickle_version()}")
    lines.append(STORAGE_REQUIREMENT)
    if accelerator_jax:
        lines.append("jax[cuda12]" if spec.family == "gpu" else "jax[tpu]")
    return lines


def check_base_image(reference: str, variable: str = "base_image") -> str:
    """``reference`` if it is one image reference (what FROM takes), else ValueError naming ``variable``."""
    if not isinstance(reference, str) or not _IMAGE_REFERENCE.fullmatch(reference):
        raise ValueError(
            f"{variable}={reference!r} is not an image reference (registry/path:tag or @sha256:digest, no spaces "
            "or newlines); refusing to build from it"
        )
    return reference


def check_python_version(version: str, variable: str = "python_version") -> str:
    """``version`` if it is a Python minor version such as ``3.12``, else ValueError naming ``variable``."""
    if not isinstance(version, str) or not _PYTHON_VERSION.fullmatch(version):
        raise ValueError(f"{variable}={version!r} is not a Python minor version such as '3.12'; refusing to build")
    return version


def check_build_inputs(spec: ImageSpec) -> None:
    """Everything of ``spec`` that goes into the Dockerfile and requirements.txt, held to what a caller can send
    (``check_requirements``, one image reference, a Python minor version): ValueError naming the variable."""
    check_python_version(spec.python)
    if spec.base_image is not None:
        check_base_image(spec.base_image)
    check_requirements(spec.requirements)


def _base_image(spec: ImageSpec, base_image: str | None) -> str:
    return check_base_image(spec.base_image or base_image or f"python:{check_python_version(spec.python)}-slim")


def dockerfile(spec: ImageSpec, *, base_image: str | None = None, extra_files: Iterable[str] = ()) -> str:
    """The Dockerfile text; a pure function of its arguments (and the caller's cloudpickle version)."""
    check_python_version(spec.python)  # it is written into the file (the tag, the version check) before FROM is
    check_python = (
        "import sys; v = '%d.%d' % sys.version_info[:2]; "
        f"sys.exit(None if v == '{spec.python}' else 'the base image has Python ' + v + ', the caller has "
        f"{spec.python}: pickled functions only load on the same minor version; choose a matching base_image')"
    )
    lines = [
        f"# Generated by kinetic-prefect {__version__} for the image tag {spec.tag}; the tag names these inputs,",
        "# so edit the ImageSpec (requirements, base_image), not this file.",
        f"FROM {_base_image(spec, base_image)}",
        "ENV PYTHONUNBUFFERED=1 \\",
        "    PIP_NO_CACHE_DIR=1 \\",
        "    PIP_DISABLE_PIP_VERSION_CHECK=1 \\",
        f"    VIRTUAL_ENV={VENV} \\",
        f"    PATH={VENV}/bin:$PATH \\",
        f"    PYTHONPATH={RUNNER_DIR}",
    ]
    if extra_files:
        lines += [
            "# Files placed into the image before any install (e.g. a CA bundle and pip.conf behind a TLS proxy).",
            "COPY extra/ /",
        ]
    lines += [
        "# A venv because Debian-based Pythons refuse system-wide pip installs (PEP 668); --system-site-packages",
        "# keeps whatever a custom base image already ships importable. Without ensurepip (Debian without",
        "# python3-venv) the base image's own pip is used from inside the venv.",
        f"RUN python3 -m venv --system-site-packages {VENV} "
        f"|| python3 -m venv --system-site-packages --without-pip {VENV}",
        f"RUN {json.dumps([f'{VENV}/bin/python', '-c', check_python])}",
        *(
            [
                "# The frameworks first, in a layer of their own: the rest changes more often (builders._FRAMEWORKS).",
                f"COPY requirements-frameworks.txt {RUNNER_DIR}/requirements-frameworks.txt",
                f"RUN python -m pip install --requirement {RUNNER_DIR}/requirements-frameworks.txt",
            ]
            if framework_lines(spec)
            else []
        ),
        f"COPY requirements.txt {RUNNER_DIR}/requirements.txt",
        f"RUN python -m pip install --requirement {RUNNER_DIR}/requirements.txt",
        "# The job runner, copied from the caller's kinetic-prefect (stdlib + cloudpickle; no Prefect).",
        f"COPY kinetic_prefect/ {RUNNER_DIR}/kinetic_prefect/",
        *_job_user_lines(),
        f"WORKDIR {WORKSPACE}",
        f"ENTRYPOINT {json.dumps(list(RUNNER_ARGV))}",
    ]
    return "\n".join(lines) + "\n"


def _job_user_lines() -> list[str]:
    """The job's user (``JOB_USER_ID``, never root): named in /etc/passwd (written directly: a base image need not
    have useradd), owning its home and the workspace; the venv and the runner stay root's, read-only to the job."""
    uid = JOB_USER_ID
    has_uid = f"grep -q '^[^:]*:[^:]*:{uid}:' /etc/passwd"
    has_gid = f"grep -q '^[^:]*:[^:]*:{uid}:' /etc/group"
    return [
        f"# The job runs as the unprivileged user {uid} (Kubernetes' restricted Pod Security: runAsNonRoot),",
        "# with its home for caches; numeric, so the kubelet can check it without reading /etc/passwd.",
        f"RUN ({has_gid} || echo 'kinetic:x:{uid}:' >> /etc/group) \\",
        f" && ({has_uid} || echo 'kinetic:x:{uid}:{uid}:kinetic job:{JOB_HOME}:/bin/sh' >> /etc/passwd) \\",
        f" && mkdir -p {JOB_HOME} {WORKSPACE} && chown {uid}:{uid} {JOB_HOME} {WORKSPACE}",
        f"ENV HOME={JOB_HOME}",
        f"USER {uid}:{uid}",
    ]


def _extra_path(name: str) -> str:
    path = Path(name.lstrip("/"))
    if not path.parts or ".." in path.parts:
        raise ValueError(f"extra file {name!r}: give a path inside the image such as 'etc/pip.conf'")
    return path.as_posix()


def framework_lines(spec: ImageSpec) -> list[str]:
    """The lines of ``requirements_lines`` that name a framework (``_FRAMEWORKS``), with the find-links line they
    may need; [] when the job has none."""
    from packaging.requirements import Requirement

    lines = requirements_lines(spec)
    frameworks = [line for line in lines if not line.startswith("-") and _FRAMEWORKS.match(Requirement(line).name)]
    return [line for line in lines if line.startswith("--find-links")] + frameworks if frameworks else []


def _context_files(spec: ImageSpec, base_image: str | None, extra_files: dict[str, bytes] | None) -> dict[str, bytes]:
    extras = {f"extra/{_extra_path(k)}": v for k, v in sorted((extra_files or {}).items())}
    files = {
        "Dockerfile": dockerfile(spec, base_image=base_image, extra_files=list(extras)).encode(),
        "requirements.txt": ("\n".join(requirements_lines(spec)) + "\n").encode(),
        **(
            {"requirements-frameworks.txt": ("\n".join(frameworks) + "\n").encode()}
            if (frameworks := framework_lines(spec))
            else {}
        ),
        **runner_sources(),
        **extras,
    }
    return dict(sorted(files.items()))


def build_context(
    spec: ImageSpec, dest: Path, *, base_image: str | None = None, extra_files: dict[str, bytes] | None = None
) -> Path:
    """Write the Docker build context for ``spec`` into ``dest`` and return ``dest``.

    ``base_image`` is used when ``spec.base_image`` is unset (default ``python:<spec.python>-slim``).
    ``extra_files`` maps paths inside the image (``"etc/pip.conf"``) to contents copied in before pip runs.
    """
    dest = Path(dest)
    for rel, data in _context_files(spec, base_image, extra_files).items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return dest


def context_archive(
    spec: ImageSpec, *, base_image: str | None = None, extra_files: dict[str, bytes] | None = None
) -> bytes:
    """The build context as a reproducible tar.gz (fixed order, owners, modes and times): Cloud Build's source."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for rel, data in _context_files(spec, base_image, extra_files).items():
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------------- builders


class ImageBuilder(Protocol):
    def ensure(self, spec: ImageSpec, log: Callable[[str], None] = print) -> str:
        """Return the image reference for ``spec``, building and pushing it only if the registry lacks it."""
        ...


class PrebuiltImage:
    """``image=``: the caller's own image, used as is (it must contain Python, cloudpickle and the runner)."""

    def __init__(self, image: str):
        self.image = image
        self.builds = 0

    def ensure(self, spec: ImageSpec, log: Callable[[str], None] = print) -> str:
        return self.image


def _is_loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if host.count(":") == 1 or host.startswith("[") else host
    return name.strip("[]") in ("localhost", "127.0.0.1", "::1") or name.startswith("127.")


_MANIFEST_TYPES = ", ".join(
    [
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
        "application/vnd.oci.image.manifest.v1+json",
        "application/vnd.oci.image.index.v1+json",
    ]
)


class DockerBuilder:
    """``docker build`` + ``docker push`` with the local docker CLI (it honours ``DOCKER_HOST``).

    ``network`` is passed to ``docker build --network`` (``"host"`` where the build must reach PyPI through the
    host's own network setup); ``extra_files`` go into the image first (see :func:`build_context`).
    """

    def __init__(
        self,
        repository: str,
        *,
        base_image: str | None = None,
        docker: str = "docker",
        network: str | None = None,
        extra_files: dict[str, bytes] | None = None,
        stop: threading.Event | None = None,
    ):
        self.repository = repository.rstrip("/")
        self.base_image = base_image
        self.docker = docker
        self.network = network
        self.extra_files = dict(extra_files or {})
        self.stop = stop  # set: the build or push under way ends (BuildStopped)
        self.builds = 0

    def exists(self, image: str) -> bool:
        """Ask the registry. A plain-HTTP loopback registry is asked directly (``HEAD /v2/<name>/manifests/<tag>``);
        any other through ``docker manifest inspect``, which uses the CLI's credentials."""
        host, path, tag = _split_image(image)
        if _is_loopback(host):
            request = urllib.request.Request(
                f"http://{host}/v2/{path}/manifests/{tag}", method="HEAD", headers={"Accept": _MANIFEST_TYPES}
            )
            try:
                with urllib.request.urlopen(request, timeout=30):
                    return True
            except urllib.error.HTTPError as exc:
                if exc.code == 404:
                    return False
                raise ImageBuildError(f"registry {host} answered {exc.code} for {image}") from exc
            except OSError as exc:
                raise ImageBuildError(f"cannot reach the registry {host} to look up {image}: {exc}") from exc
        proc = subprocess.run([self.docker, "manifest", "inspect", image], capture_output=True, text=True)
        if proc.returncode == 0:
            return True
        if re.search(r"no such manifest|manifest unknown|not found", proc.stderr, re.IGNORECASE):
            return False
        raise ImageBuildError(f"`docker manifest inspect {image}` failed: {proc.stderr.strip()}")

    def _run(
        self, args: list[str], log: Callable[[str], None], image: str, stop: threading.Event | None = None
    ) -> None:
        """Run a docker command, passing each output line to ``log``; on failure raise with the last lines. A set
        ``stop`` ends the command (``BuildStopped``)."""
        status, text = run_streamed(args, log, LOG_TAIL_LINES, stop)
        if stop is not None:
            _stop_requested(stop, f"`{' '.join(args[:2])}` for {image}")
        if status != 0:
            raise ImageBuildError(
                f"`{' '.join(args[:2])}` failed with exit status {status} for {image}; last output:\n{text}",
                log_tail=text,
            )

    def ensure(self, spec: ImageSpec, log: Callable[[str], None] = print) -> str:
        """The image of ``spec``, built and pushed unless the registry has it; a set ``stop`` ends the build or
        push under way (``BuildStopped``)."""
        stop = self.stop
        image = image_name(self.repository, spec)
        if self.exists(image):
            log(f"kinetic: image {image} is in the registry; not building")
            return image
        from kinetic_prefect.pod.progress import line

        _stop_requested(stop, f"building {image}")
        log(f"kinetic: building {image}")
        log(line(0, 2, f"image {image}: building"))
        with tempfile.TemporaryDirectory(prefix="kinetic-build-") as tmp:
            build_context(spec, Path(tmp), base_image=self.base_image, extra_files=self.extra_files)
            network = ["--network", self.network] if self.network else []
            self._run([self.docker, "build", *network, "--tag", image, tmp], log, image, stop)
        log(line(1, 2, f"image {image}: pushing"))
        self._run([self.docker, "push", image], log, image, stop)
        log(line(2, 2, f"image {image}: pushed"))
        self.builds += 1
        return image


class CloudBuildBuilder:
    """Builds in Cloud Build and pushes to Artifact Registry.

    ``repository`` is the image repository (``us-docker.pkg.dev/PROJECT/REPO``), or just the Artifact Registry
    repository id, which then lives in ``region``. ``staging_bucket`` (``name`` or ``gs://name[/prefix]``) receives
    the build context under ``kinetic-builds/<tag>.tar.gz`` and Cloud Build's log under ``kinetic-builds/logs/``,
    where this builder reads it back while the build runs (the way ``gcloud builds submit`` streams logs), so the
    Cloud Build service account needs write access to that bucket. Clients are created on first use unless given,
    with ``credentials`` (``google.auth`` credentials, e.g. ``gcp.google_credentials(block)`` for the pool's
    ``GcpCredentials`` block) or, when None, Application Default Credentials.
    """

    TERMINAL = ("SUCCESS", "FAILURE", "INTERNAL_ERROR", "TIMEOUT", "CANCELLED", "EXPIRED")

    def __init__(
        self,
        project: str,
        region: str,
        repository: str,
        staging_bucket: str,
        *,
        base_image: str | None = None,
        timeout_seconds: int = 3600,
        machine_type: str | None = None,
        build_client: Any = None,
        registry_client: Any = None,
        storage_client: Any = None,
        poll_seconds: float = 3.0,
        extra_files: dict[str, bytes] | None = None,
        credentials: Any = None,
        stop: threading.Event | None = None,
    ):
        self.project, self.region = project, region
        self.stop = stop  # set: the build is cancelled within one poll (BuildStopped)
        self.credentials = credentials
        self.repository = (
            repository if "/" in repository else f"{region}-docker.pkg.dev/{project}/{repository}"
        ).rstrip("/")
        bucket_url = staging_bucket.removeprefix("gs://").strip("/")
        self.staging_bucket, _, prefix = bucket_url.partition("/")
        self.staging_prefix = f"{prefix}/kinetic-builds" if prefix else "kinetic-builds"
        self.base_image = base_image
        self.timeout_seconds = int(timeout_seconds)
        self.machine_type = machine_type
        self.poll_seconds = poll_seconds
        self.extra_files = dict(extra_files or {})
        self._build_client, self._registry_client, self._storage_client = build_client, registry_client, storage_client
        self.builds = 0

    # Clients: created lazily so constructing a builder needs neither credentials nor the gcp extra.
    @property
    def build_client(self) -> Any:
        if self._build_client is None:
            from google.cloud.devtools import cloudbuild_v1

            self._build_client = cloudbuild_v1.CloudBuildClient(credentials=self.credentials)
        return self._build_client

    @property
    def registry_client(self) -> Any:
        if self._registry_client is None:
            from google.cloud import artifactregistry_v1

            self._registry_client = artifactregistry_v1.ArtifactRegistryClient(credentials=self.credentials)
        return self._registry_client

    @property
    def storage_client(self) -> Any:
        if self._storage_client is None:
            from google.cloud import storage  # type: ignore[attr-defined]

            self._storage_client = storage.Client(project=self.project, credentials=self.credentials)
        return self._storage_client

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.region}"

    @staticmethod
    def tag_resource(image: str) -> str:
        """Artifact Registry's name for an image tag. A nested image path is one package whose '/' is %2F."""
        host, path, tag = _split_image(image)
        match = re.fullmatch(r"([a-z0-9-]+)-docker\.pkg\.dev", host)
        parts = path.split("/")
        if not match or len(parts) < 3:
            raise ValueError(f"{image!r} is not an Artifact Registry image (LOCATION-docker.pkg.dev/PROJECT/REPO/...)")
        package = urllib.parse.quote("/".join(parts[2:]), safe="")
        return f"projects/{parts[0]}/locations/{match.group(1)}/repositories/{parts[1]}/packages/{package}/tags/{tag}"

    def exists(self, image: str) -> bool:
        from google.api_core.exceptions import NotFound

        try:
            self.registry_client.get_tag(name=self.tag_resource(image))
        except NotFound:
            return False
        return True

    def source_object(self, spec: ImageSpec) -> str:
        return f"{self.staging_prefix}/{spec.tag}.tar.gz"

    @property
    def logs_url(self) -> str:
        return f"gs://{self.staging_bucket}/{self.staging_prefix}/logs"

    def build_request(
        self, spec: ImageSpec, source_object: str, *, source_generation: int | None = None
    ) -> cloudbuild_v1.Build:
        """The Build: one ``docker build`` step on the uploaded context; Cloud Build pushes ``images`` itself."""
        from google.cloud.devtools import cloudbuild_v1

        image = image_name(self.repository, spec)
        options = cloudbuild_v1.BuildOptions(logging=cloudbuild_v1.BuildOptions.LoggingMode.GCS_ONLY)
        if self.machine_type:
            options.machine_type = cloudbuild_v1.BuildOptions.MachineType[  # type: ignore[misc]  # an Enum
                self.machine_type.upper().replace("-", "_")
            ]
        return cloudbuild_v1.Build(
            source=cloudbuild_v1.Source(
                storage_source=cloudbuild_v1.StorageSource(
                    bucket=self.staging_bucket, object_=source_object, generation=source_generation or 0
                )
            ),
            steps=[cloudbuild_v1.BuildStep(name="gcr.io/cloud-builders/docker", args=["build", "--tag", image, "."])],
            images=[image],
            timeout=timedelta(seconds=self.timeout_seconds),
            logs_bucket=self.logs_url,
            options=options,
            tags=["kinetic-prefect", spec.tag],
        )

    def ensure(self, spec: ImageSpec, log: Callable[[str], None] = print) -> str:
        """The image of ``spec``: found in Artifact Registry, else built by Cloud Build. A set ``stop`` cancels the
        build within one poll (``BuildStopped``)."""
        stop = self.stop
        from google.cloud.devtools import cloudbuild_v1

        image = image_name(self.repository, spec)
        if self.exists(image):
            log(f"kinetic: image {image} is in Artifact Registry; not building")
            return image
        _stop_requested(stop, f"building {image}")
        archive = context_archive(spec, base_image=self.base_image, extra_files=self.extra_files)
        blob = self.storage_client.bucket(self.staging_bucket).blob(self.source_object(spec))
        blob.upload_from_string(archive, content_type="application/gzip")
        log(
            f"kinetic: uploaded the build context to gs://{self.staging_bucket}/{blob.name} "
            f"(sha256 {hashlib.sha256(archive).hexdigest()[:12]})"
        )
        operation = self.build_client.create_build(
            request=cloudbuild_v1.CreateBuildRequest(
                parent=self.parent, build=self.build_request(spec, blob.name, source_generation=blob.generation)
            )
        )
        build = operation.metadata.build
        log(
            f"kinetic: Cloud Build {build.id} is building {image}"
            + (f"; logs: {build.log_url}" if build.log_url else "")
        )
        from kinetic_prefect.pod.progress import line

        log(line(0, 1, f"image {image}: Cloud Build {build.id} running"))
        try:
            build, tail = self._wait(build.id, log, stop)
        except BaseException:  # interrupted or the API failed: do not leave a build running for nothing
            with contextlib.suppress(Exception):
                self.build_client.cancel_build(
                    request=cloudbuild_v1.CancelBuildRequest(name=f"{self.parent}/builds/{build.id}", id=build.id)
                )
                log(f"kinetic: cancelled Cloud Build {build.id}")
            raise
        status = build.status.name
        if status != "SUCCESS":
            text = "\n".join(tail)
            detail = f" ({build.status_detail})" if build.status_detail else ""
            raise ImageBuildError(
                f"Cloud Build {build.id} for {image} ended {status}{detail}; "
                f"full log: {build.log_url or self.logs_url}; last log lines:\n{text}",
                build_id=build.id,
                log_tail=text,
            )
        log(line(1, 1, f"image {image}: built by Cloud Build {build.id}"))
        self.builds += 1
        return image

    def _wait(
        self, build_id: str, log: Callable[[str], None], stop: threading.Event | None = None
    ) -> tuple[Any, list[str]]:
        """Poll the build and print new log lines until it ends, or ``stop`` is set (``BuildStopped``); returns
        (build, last log lines)."""
        from google.cloud.devtools import cloudbuild_v1

        reader = _LogTail(self.storage_client, self.logs_url, build_id, log)
        # Cloud Build enforces the build's timeout; this bound only keeps a lost build from hanging the caller.
        deadline = time.monotonic() + self.timeout_seconds + 3600
        request = cloudbuild_v1.GetBuildRequest(name=f"{self.parent}/builds/{build_id}", id=build_id)
        while True:
            build = self.build_client.get_build(request=request)
            reader.poll()
            if build.status.name in self.TERMINAL:
                reader.poll(final=True)  # lines written between the last read and the end
                return build, list(reader.tail)
            if time.monotonic() > deadline:
                raise ImageBuildError(
                    f"Cloud Build {build_id} still {build.status.name} after {self.timeout_seconds + 3600} s",
                    build_id=build_id,
                    log_tail="\n".join(reader.tail),
                )
            if stop is None:
                time.sleep(self.poll_seconds)
            elif stop.wait(self.poll_seconds):
                raise BuildStopped(f"Cloud Build {build_id}: stopped, its caller was cancelled", build_id=build_id)


class _LogTail:
    """Follows ``<logs bucket>/log-<build id>.txt`` by ranged reads from the last offset, as gcloud does."""

    def __init__(self, storage_client: Any, logs_url: str, build_id: str, log: Callable[[str], None]):
        bucket, _, prefix = logs_url.removeprefix("gs://").partition("/")
        self.bucket = storage_client.bucket(bucket)
        self.name = f"{prefix}/log-{build_id}.txt" if prefix else f"log-{build_id}.txt"
        self.log = log
        self.offset = 0
        self.partial = b""
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)

    def poll(self, final: bool = False) -> None:
        from google.api_core.exceptions import NotFound, RequestRangeNotSatisfiable

        try:
            # A new Blob each time: Cloud Build rewrites the object as the log grows (a new generation each
            # time), and a Blob that has downloaded once pins the generation it saw.
            data = self.bucket.blob(self.name).download_as_bytes(start=self.offset)
        except (NotFound, RequestRangeNotSatisfiable):  # not written yet / nothing new
            data = b""
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        if final and self.partial:
            lines.append(self.partial)
            self.partial = b""
        for raw in lines:
            line = raw.decode("utf-8", "replace").rstrip("\r")
            self.tail.append(line)
            self.log(line)


# ---------------------------------------------------------------------------------------------- configuration


def builder_from_settings(
    repository: str,
    *,
    builder: str = "auto",
    project: str | None = None,
    region: str | None = None,
    staging_bucket: str | None = None,
    base_image: str | None = None,
    image: str | None = None,
    **options: Any,
) -> ImageBuilder:
    """The builder a work pool's settings describe.

    ``image`` set: :class:`PrebuiltImage`. ``builder="auto"``: Cloud Build for an Artifact Registry repository
    (``LOCATION-docker.pkg.dev/PROJECT/REPO``) with a ``staging_bucket``, the local Docker engine otherwise.
    Project and region default to the ones in the repository path.
    """
    if image:
        return PrebuiltImage(image)
    match = re.fullmatch(r"([a-z0-9-]+)-docker\.pkg\.dev/([^/]+)/.+", repository.rstrip("/"))
    if builder == "auto":
        builder = "cloudbuild" if match and staging_bucket else "docker"
    if builder == "docker":
        return DockerBuilder(repository, base_image=base_image, **options)
    if builder == "cloudbuild":
        project = project or (match.group(2) if match else None)
        # A multi-region repository (us, europe, asia) is not a Cloud Build region: build in "global" then.
        location = match.group(1) if match else None
        region = region or ("global" if location in ("us", "europe", "asia") else location)
        if not (project and region and staging_bucket):
            raise ValueError(
                "Cloud Build needs a project, a region and a staging bucket "
                f"(repository={repository!r}, project={project!r}, region={region!r}, "
                f"staging_bucket={staging_bucket!r})"
            )
        return CloudBuildBuilder(project, region, repository, staging_bucket, base_image=base_image, **options)
    raise ValueError(f"unknown builder {builder!r}: use 'auto', 'docker' or 'cloudbuild'")
