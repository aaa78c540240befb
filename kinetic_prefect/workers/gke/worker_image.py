"""Worker side: the image that runs the in-cluster ``kinetic-gke`` worker (``docker/kinetic-gke-worker.Dockerfile``).

The image is built from a kinetic-prefect source checkout (the lock file is not in the wheel): the build context
is the Dockerfile, ``pyproject.toml``, ``uv.lock``, ``README.md``, ``kinetic_prefect/`` and ``work_pools/``, and the
tag is ``<version>-<digest>``, the digest covering those files and the base image. So a change to the lock or to
the code gives a new tag (a node never keeps running a stale image under an old tag), and the same checkout
always names the same reference, which is what ``gke-worker-manifests --repository`` puts in the Deployment.
"""

from __future__ import annotations

import hashlib
import re
import sys
import tempfile
import tomllib
from collections.abc import Callable
from pathlib import Path

from kinetic_prefect.shared.processes import run_streamed

DOCKERFILE = "docker/kinetic-gke-worker.Dockerfile"
DEFAULT_BASE_IMAGE = "python:3.12-slim"  # the Dockerfile's own default for BASE_IMAGE; a test keeps them equal
IMAGE_NAME = "kinetic-gke-worker"
WORKER_IMAGE_TAIL_LINES = 40  # the build's last lines an error carries
_SOURCE_DIRS = ("kinetic_prefect", "work_pools")
_SOURCE_FILES = ("pyproject.toml", "uv.lock", "README.md")


class WorkerImageError(RuntimeError):
    """The worker image cannot be named or built (no checkout, or docker failed)."""


def _is_checkout(path: Path) -> bool:
    try:
        project = tomllib.loads((path / "pyproject.toml").read_text())["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return False
    return project.get("name") == "kinetic-prefect" and (path / "uv.lock").is_file() and (path / DOCKERFILE).is_file()


def find_source(source: Path | str | None = None) -> Path:
    """The kinetic-prefect checkout to build from: ``source``, else the one this package is imported from."""
    if source is not None:
        path = Path(source).resolve()
        if not _is_checkout(path):
            raise WorkerImageError(
                f"{path} is not a kinetic-prefect checkout (it needs pyproject.toml, uv.lock and {DOCKERFILE})"
            )
        return path
    from kinetic_prefect import config

    path = config.package_dir().parent
    if not _is_checkout(path):
        raise WorkerImageError(
            "the worker image is built from a kinetic-prefect source checkout (with uv.lock and "
            f"{DOCKERFILE}), and this kinetic-prefect is installed from {path}; pass --source CHECKOUT"
        )
    return path


def _files_under(root: Path, folder: str) -> dict[str, bytes]:
    files = {}
    for path in sorted((root / folder).rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
            files[path.relative_to(root).as_posix()] = path.read_bytes()
    return files


def context_files(source: Path) -> dict[str, bytes]:
    """The build context (without extra files), path -> bytes; the Dockerfile is ``Dockerfile`` in it."""
    files = {"Dockerfile": (source / DOCKERFILE).read_bytes()}
    files.update({name: (source / name).read_bytes() for name in _SOURCE_FILES})
    for folder in _SOURCE_DIRS:
        files.update(_files_under(source, folder))
    return dict(sorted(files.items()))


def dockerfile_default_base_image(source: Path) -> str:
    match = re.search(r"^ARG BASE_IMAGE=(\S+)$", (source / DOCKERFILE).read_text(), re.M)
    if not match:
        raise WorkerImageError(f"{DOCKERFILE} has no `ARG BASE_IMAGE=...` line")
    return match.group(1)


def image_tag(source: Path | str | None = None, base_image: str = DEFAULT_BASE_IMAGE) -> str:
    """``<version>-<12 hex digits>``: the version from pyproject.toml, the digest of the context and base image."""
    root = find_source(source)
    version = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    digest = hashlib.sha256()
    digest.update(f"base-image\0{base_image}\0".encode())
    for name, data in context_files(root).items():
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', version)}-{digest.hexdigest()[:12]}"


def image_reference(repository: str, source: Path | str | None = None, base_image: str = DEFAULT_BASE_IMAGE) -> str:
    """``<repository>/kinetic-gke-worker:<tag>`` (``repository`` as the pools' ``image_repository``)."""
    repository = repository.strip().rstrip("/")
    if not repository:
        raise WorkerImageError("give the image repository, e.g. us-docker.pkg.dev/PROJECT/REPO")
    return f"{repository}/{IMAGE_NAME}:{image_tag(source, base_image)}"


def ca_bundle_files(bundle: Path | str) -> dict[str, bytes]:
    """Extra build-stage files that make pip and uv trust ``bundle`` (builds behind a TLS-intercepting proxy)."""
    return {
        "etc/ssl/certs/ca-certificates.crt": Path(bundle).read_bytes(),
        "etc/pip.conf": b"[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n",
    }


def _run(args: list[str], log: Callable[[str], None]) -> None:
    status, text = run_streamed(args, log, WORKER_IMAGE_TAIL_LINES)
    if status != 0:
        raise WorkerImageError(f"`{' '.join(args[:2])}` failed with exit status {status}; last output:\n" + text)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build(
    repository: str,
    *,
    source: Path | str | None = None,
    base_image: str = DEFAULT_BASE_IMAGE,
    push: bool = False,
    docker: str = "docker",
    network: str | None = None,
    extra_files: dict[str, bytes] | None = None,
    log: Callable[[str], None] = _stderr,
) -> str:
    """``docker build`` the worker image (and ``docker push`` it with ``push``); returns its reference.

    ``extra_files`` (path inside the image -> bytes) are placed into the build stage before anything is installed,
    never into the final image, and do not change the tag. ``network`` goes to ``docker build --network``."""
    root = find_source(source)
    image = image_reference(repository, root, base_image)
    with tempfile.TemporaryDirectory(prefix="kinetic-worker-image-") as tmp:
        context = Path(tmp)
        (context / "extra").mkdir()
        files = dict(context_files(root))
        for name, data in (extra_files or {}).items():
            relative = Path(name.lstrip("/"))
            if not relative.parts or ".." in relative.parts:
                raise WorkerImageError(f"extra file {name!r}: give a path inside the image such as 'etc/pip.conf'")
            files[f"extra/{relative.as_posix()}"] = data
        for name, data in files.items():
            path = context / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        network_args = ["--network", network] if network else []
        log(f"kinetic: building {image} from {root} on {base_image}")
        _run([docker, "build", *network_args, "--build-arg", f"BASE_IMAGE={base_image}", "--tag", image, tmp], log)
    if push:
        log(f"kinetic: pushing {image}")
        _run([docker, "push", image], log)
    return image
