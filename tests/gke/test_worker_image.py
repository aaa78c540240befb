"""The in-cluster kinetic-gke worker image: ``docker/kinetic-gke-worker.Dockerfile``, ``kinetic-prefect
gke-worker-image`` and the reference ``kinetic-prefect gke-worker-manifests`` puts in its Deployment.

The slow test builds the image with a real Docker engine on the locally made Debian base (Docker Hub is
unreachable here), pushes it to the local registry, deletes the local copy and runs what the registry holds: the
Deployment's own command against this session's Prefect server, with the host's network. Not run on GKE.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import tomllib
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from docker_fixture import proxy_files

from kinetic_prefect.cli import main
from kinetic_prefect.workers.gke import worker_image as gke_worker_image
from kinetic_prefect.workers.gke.deploy import worker_manifests

ROOT = Path(__file__).resolve().parents[2]


def _deployment_container(manifests_yaml: str) -> dict:
    import yaml

    deployment = [d for d in yaml.safe_load_all(manifests_yaml) if d["kind"] == "Deployment"]
    return deployment[0]["spec"]["template"]["spec"]["containers"][0]


# ------------------------------------------------------------------------------------------------ no Docker


def test_dockerfile_and_defaults_agree():
    source = gke_worker_image.find_source()
    assert source == ROOT
    assert gke_worker_image.dockerfile_default_base_image(source) == gke_worker_image.DEFAULT_BASE_IMAGE
    text = (ROOT / gke_worker_image.DOCKERFILE).read_text()
    # The Deployment's args are the whole command: no entrypoint may be left in front of them.
    assert "ENTRYPOINT []" in text and "\nUSER 10001:10001\n" in text
    assert "uv sync --frozen --no-dev --extra gcp --extra k8s --no-editable" in text


def _copy_checkout(dest: Path) -> Path:
    for name in ("pyproject.toml", "uv.lock", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    (dest / "docker").mkdir()
    shutil.copy(ROOT / gke_worker_image.DOCKERFILE, dest / gke_worker_image.DOCKERFILE)
    for folder in ("kinetic_prefect", "work_pools"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def test_tag_names_version_lock_code_and_base(tmp_path):
    source = _copy_checkout(tmp_path)
    tag = gke_worker_image.image_tag(source)
    assert tag == gke_worker_image.image_tag(ROOT)  # the same files: the same tag
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert re.fullmatch(re.escape(version) + r"-[0-9a-f]{12}", tag), tag
    assert gke_worker_image.image_reference("us-docker.pkg.dev/p/r/", source) == (
        f"us-docker.pkg.dev/p/r/kinetic-gke-worker:{tag}"
    )

    # Byte-code caches are not part of the context; the lock, the code and the base image are.
    (source / "kinetic_prefect" / "__pycache__").mkdir(exist_ok=True)
    (source / "kinetic_prefect" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"junk")
    assert gke_worker_image.image_tag(source) == tag
    assert gke_worker_image.image_tag(source, base_image="python:3.13-slim") != tag
    (source / "uv.lock").write_text((source / "uv.lock").read_text() + "\n# changed\n")
    locked = gke_worker_image.image_tag(source)
    assert locked != tag
    (source / "kinetic_prefect" / "cli" / "app.py").write_text(
        (source / "kinetic_prefect" / "cli" / "app.py").read_text() + "\n"
    )
    assert gke_worker_image.image_tag(source) not in (tag, locked)

    (source / "uv.lock").unlink()
    with pytest.raises(gke_worker_image.WorkerImageError, match="not a kinetic-prefect checkout"):
        gke_worker_image.image_tag(source)


def test_manifests_default_to_the_worker_image(capsys):
    assert main(["gke-worker-manifests", "--pool", "gpu", "--repository", "us-docker.pkg.dev/p/r"]) == 0
    container = _deployment_container(capsys.readouterr().out)
    assert container["image"] == gke_worker_image.image_reference("us-docker.pkg.dev/p/r")
    assert main(["gke-worker-image", "--repository", "us-docker.pkg.dev/p/r", "--print"]) == 0
    assert capsys.readouterr().out == container["image"] + "\n"
    assert main(["gke-worker-manifests", "--pool", "gpu"]) == 2
    err = capsys.readouterr().err
    assert "--image" in err and "--repository" in err


# -------------------------------------------------------------------------------------- real build and run


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _registry_has(image: str) -> bool:
    host, _, rest = image.partition("/")
    path, _, tag = rest.rpartition(":")
    request = urllib.request.Request(
        f"http://{host}/v2/{path}/manifests/{tag}",
        method="HEAD",
        headers={
            "Accept": "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status == 200
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise


PROBE = """
import json, os, sys
import kinetic_prefect, prefect, prefect_gcp, prefect_kubernetes
from prefect.workers.base import BaseWorker
worker = BaseWorker.get_worker_class_from_type("kinetic-gke")
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "home": os.path.expanduser("~"),
                  "worker": worker and f"{worker.__module__}.{worker.__qualname__}",
                  "types": sorted(BaseWorker.get_all_available_worker_types()),
                  "package": kinetic_prefect.__file__, "version": kinetic_prefect.__version__,
                  "prefect": prefect.__version__, "python": sys.executable}))
"""


@pytest.mark.slow
@pytest.mark.slow_tier  # ≈ 100 s: CONTRIBUTING says what the default run keeps of it
@pytest.mark.timeout(1200)
def test_worker_image_builds_pushes_and_runs_the_worker(
    docker_engine, local_registry, python_base_image, tmp_path, capsys
):
    """The worker image as `kinetic-prefect gke-worker-image --push` builds it, pulled back from the registry and
    started with the Deployment's own command against this session's server. Why it takes more than 60 s (≈ 90 s
    here): a real `docker build` that installs the locked dependencies into a fresh image (Docker's layer cache
    shortens later runs on the same engine), a push, a pull and a worker start inside the container; in the slow
    tier."""
    from prefect import get_client

    # A repository of its own: a registry that outlives the session must not already hold the tag. A snapshot
    # of the checkout (--source), so an edit made to the working tree while this runs does not change the tag.
    repository = f"{local_registry}/kinetic-test-{uuid.uuid4().hex[:8]}"
    (tmp_path / "checkout").mkdir()
    source = _copy_checkout(tmp_path / "checkout")
    bundle = tmp_path / "ca-bundle.crt"  # behind the TLS-intercepting proxy this machine reaches PyPI through
    bundle.write_bytes(proxy_files()["etc/ssl/certs/ca-certificates.crt"])
    started = time.monotonic()
    status = main(
        [
            "gke-worker-image",
            "--repository",
            repository,
            "--base-image",
            python_base_image,
            "--source",
            str(source),
            "--network",
            "host",
            "--ca-bundle",
            str(bundle),
            "--push",
        ]
    )
    build_s = time.monotonic() - started
    out, err = capsys.readouterr()
    assert status == 0, err[-5000:]
    image = out.strip()
    assert image == gke_worker_image.image_reference(repository, source, base_image=python_base_image)
    assert f"kinetic: building {image}" in err and "BASE_IMAGE" in err  # the build log went to stderr
    assert "digest: sha256:" in err and _registry_has(image)

    # What the registry holds, not the local copy.
    docker_engine.run("image", "rm", image)

    # Without args: the command's help (prefect, its CLI and the worker's entry point import).
    help_run = docker_engine.run("run", "--rm", "--network", "none", image, timeout=300)
    assert "Start a worker process" in help_run.stdout, help_run.stdout + help_run.stderr

    probe = json.loads(
        docker_engine.run("run", "--rm", "--network", "none", image, "python", "-c", PROBE, timeout=300)
        .stdout.strip()
        .splitlines()[-1]
    )
    assert probe["uid"] == 10001 and probe["gid"] == 10001 and probe["home"] == "/home/kinetic", probe
    assert probe["worker"] == "kinetic_prefect.workers.gke.worker.KineticGKEWorker", probe
    assert {"kinetic-gke", "kinetic-local"} <= set(probe["types"]), probe
    assert probe["package"].startswith("/opt/venv/lib/"), probe  # installed as a wheel, not editable
    assert probe["python"] == "/opt/venv/bin/python", probe
    import prefect

    assert probe["prefect"] == prefect.__version__  # the lock's Prefect, as here

    # The Deployment's own command, against this session's Prefect server; the pool does not exist yet, so the
    # worker creates it with its type: a kinetic-gke pool proves the type registered.
    pool = f"image-{uuid.uuid4().hex[:6]}"
    assert (
        main(
            [
                "gke-worker-manifests",
                "--pool",
                pool,
                "--repository",
                repository,
                "--base-image",
                python_base_image,
                "--source",
                str(source),
            ]
        )
        == 0
    )
    container = _deployment_container(capsys.readouterr().out)
    assert container["image"] == image
    assert (
        container["args"] == worker_manifests(pool, image=image)[3]["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    health_port = _free_port()
    env = {
        "PREFECT_API_URL": os.environ["PREFECT_API_URL"],
        "PREFECT_WORKER_WEBSERVER_PORT": str(health_port),
        "PREFECT_WORKER_HEARTBEAT_SECONDS": "5",
        "PREFECT_WORKER_QUERY_SECONDS": "2",
    }
    name = f"kinetic-worker-{uuid.uuid4().hex[:8]}"
    env_args = [arg for key, value in env.items() for arg in ("-e", f"{key}={value}")]
    docker_engine.run(
        "run", "-d", "--name", name, "--network", "host", *env_args, container["image"], *container["args"]
    )
    try:
        deadline = time.monotonic() + 180
        with get_client(sync_client=True) as client:
            while True:
                state = docker_engine.run("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
                assert state == "running", docker_engine.run("logs", name, check=False).stderr[-3000:]
                try:
                    work_pool = client.read_work_pool(pool)
                    online = [w for w in client.read_workers_for_work_pool(pool) if w.status.value == "ONLINE"]
                except Exception:  # the pool appears once the worker has made it
                    work_pool, online = None, []
                if online:
                    break
                assert time.monotonic() < deadline, docker_engine.run("logs", name, check=False).stderr[-3000:]
                time.sleep(1)
        assert work_pool.type == "kinetic-gke"
        assert work_pool.base_job_template["job_configuration"], work_pool.base_job_template
        # The health check the Deployment's livenessProbe asks (--with-healthcheck).
        with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/health", timeout=10) as response:
            assert response.status == 200
        assert docker_engine.run("exec", name, "id", "-u").stdout.strip() == "10001"
        online_s = time.monotonic() - started - build_s
        stop_started = time.monotonic()
        docker_engine.run("stop", "--time", "30", name, timeout=60)
        stop_s = time.monotonic() - stop_started
    finally:
        logs = docker_engine.run("logs", name, check=False)
        docker_engine.run("rm", "--force", name, check=False)
    output = logs.stdout + logs.stderr
    assert "Traceback" not in output, output[-3000:]
    print(
        f"\nworker image: build+push {build_s:.1f} s, worker online {online_s:.1f} s later, "
        f"docker stop {stop_s:.1f} s; {image}"
    )
