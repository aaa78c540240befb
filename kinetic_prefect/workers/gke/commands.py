"""kinetic-gke's side of the ``kinetic-prefect`` command: its own commands, ``gke-worker-image`` and
``gke-worker-manifests`` (the in-cluster worker's image and the manifests that run it), and its platform for ``up`` /
``down --platform gke``. The CLI imports this module for ``--help`` (its launcher's registration line names it), so
it is light: a command imports the launcher's code when it runs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

# click's exception (Typer carries its own click): a message and exit status 1, as the CLI's other commands fail
ClickException: Any = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def gke_worker_image_command(
    repository: str = typer.Option(
        ...,
        "--repository",
        metavar="REPOSITORY",
        help="where the image goes, e.g. us-docker.pkg.dev/PROJECT/REPO (the image is "
        "REPOSITORY/kinetic-gke-worker:<version>-<digest>)",
    ),
    push: bool = typer.Option(False, "--push", help="docker push the image after building it"),
    base_image: str | None = typer.Option(
        None,
        "--base-image",
        metavar="IMAGE",
        help="the Dockerfile's BASE_IMAGE, Debian-based with Python >= 3.11 "
        "(default: the Dockerfile's, python:3.12-slim)",
    ),
    source: Path | None = typer.Option(
        None,
        "--source",
        metavar="CHECKOUT",
        help="the kinetic-prefect checkout to build (default: the one this kinetic-prefect runs from)",
    ),
    network: str | None = typer.Option(
        None, "--network", metavar="NETWORK", help="passed to `docker build --network` (e.g. host)"
    ),
    ca_bundle: Path | None = typer.Option(
        None,
        "--ca-bundle",
        metavar="FILE",
        help="a CA bundle pip and uv trust during the build (behind a TLS-intercepting proxy); not kept in the image",
    ),
    docker: str = typer.Option("docker", "--docker", metavar="COMMAND", help="the docker CLI to use"),
    print_only: bool = typer.Option(False, "--print", help="only print the image reference; build nothing"),
) -> None:
    """Build the in-cluster kinetic-gke worker image (docker/kinetic-gke-worker.Dockerfile) and print its reference.

    The build log goes to stderr, the reference alone to stdout: IMAGE=$(kinetic-prefect gke-worker-image ...)."""
    from kinetic_prefect.workers.gke import worker_image as gke_worker_image

    base_image = base_image or gke_worker_image.DEFAULT_BASE_IMAGE
    try:
        if print_only:
            image = gke_worker_image.image_reference(repository, source, base_image)
        else:
            extra = gke_worker_image.ca_bundle_files(ca_bundle) if ca_bundle else None
            image = gke_worker_image.build(
                repository,
                source=source,
                base_image=base_image,
                push=push,
                docker=docker,
                network=network,
                extra_files=extra,
            )
    except (gke_worker_image.WorkerImageError, OSError) as exc:
        raise ClickException(str(exc)) from None
    sys.stdout.write(image + "\n")


def gke_worker_manifests_command(
    pool: str = typer.Option(..., "--pool"),
    image: str | None = typer.Option(
        None, "--image", help="the worker's image (default: the one `gke-worker-image --repository` builds)"
    ),
    repository: str | None = typer.Option(
        None,
        "--repository",
        metavar="REPOSITORY",
        help="name the image `gke-worker-image --repository REPOSITORY` builds from this checkout",
    ),
    base_image: str | None = typer.Option(
        None, "--base-image", metavar="IMAGE", help="the --base-image that image was built with"
    ),
    source: Path | None = typer.Option(None, "--source", metavar="CHECKOUT"),
    namespace: str = typer.Option("default", "--namespace"),
) -> None:
    """Print manifests that run a kinetic-gke worker in a cluster (pipe them to `kubectl apply -f -`)."""
    import yaml

    from kinetic_prefect.workers.gke.deploy import worker_manifests

    if image is None:
        if repository is None:
            raise typer.BadParameter(
                "give --image IMAGE, or --repository REPOSITORY for the image "
                "`kinetic-prefect gke-worker-image --repository REPOSITORY` builds",
                param_hint="'--image'",
            )
        from kinetic_prefect.workers.gke import worker_image as gke_worker_image

        try:
            image = gke_worker_image.image_reference(
                repository, source, base_image or gke_worker_image.DEFAULT_BASE_IMAGE
            )
        except gke_worker_image.WorkerImageError as exc:
            raise ClickException(f"{exc}; or give --image") from None
    sys.stdout.write(yaml.safe_dump_all(worker_manifests(pool, namespace=namespace, image=image), sort_keys=False))


PLATFORM = "gke"


def provisioning() -> Any:
    """The cluster and what it runs (``workers/gke/provision``)."""
    from kinetic_prefect.workers.gke.provision.platform import GKEPlatform

    return GKEPlatform()


def register(app: typer.Typer) -> None:
    """Add ``gke-worker-image`` and ``gke-worker-manifests`` to the ``kinetic-prefect`` app."""
    app.command("gke-worker-image")(gke_worker_image_command)
    app.command("gke-worker-manifests")(gke_worker_manifests_command)
